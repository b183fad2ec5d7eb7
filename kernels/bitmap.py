"""A second wire encoding of a quantised payload: one bit per bucket element instead of an offset per entry.

An entry's place costs 2 bytes as an int16 offset (kernels.payload), or 1/8 byte per element of the
bucket as a bit, however many entries are sent. Above about one entry in 16 elements the bitmap is
the smaller of the two, so a comm hook sends whichever is: a sparsity ramp that starts at 25 % of
the entries sends about half the bytes in its dense steps.

    if bitmap_nbytes(mine.layout) < mine.layout.nbytes:
        wire = encode_bitmap(mine)                       # uint8[bitmap_nbytes(layout)]
        payload = decode_bitmap(wire, mine.layout)       # the payload compress() made, byte for byte

Layout (byte offsets, each array 16-byte aligned):

    header  int32[4]              the payload's header
    bits    uint8[ceil(numel/8)]  bit b of byte i is set when element 8i + b is sent
    values  int8[capacity]        the payload's codes, in ascending element order
    scales  float32[num_blocks]   the payload's scales

Both directions are plain torch ops on any device, with no host synchronisation (the entries are
found with nonzero_static), so a comm hook can call them while backward runs. Decoding gives back
the payload compress() made, byte for byte, including one whose selection overflowed its capacity:
its entries are the lowest-indexed ones, and its segment starts are clamped as the bitmap's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.payload import HEADER_BYTES, SEGMENT, CompressedBucket, PayloadLayout, _align16, allocate

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class _BitmapViews:
    header: torch.Tensor
    bits: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor


def _offsets(layout: PayloadLayout) -> tuple[int, int, int, int]:
    """(bits, values, scales, end) byte offsets."""
    values = _align16(HEADER_BYTES + -(-layout.numel // 8))
    scales = _align16(values + layout.capacity)
    return HEADER_BYTES, values, scales, _align16(scales + 4 * layout.num_blocks)


def bitmap_nbytes(layout: PayloadLayout) -> int:
    """Bytes of the bitmap encoding of a payload with this layout."""
    return _offsets(layout)[3]


def wire_nbytes(layout: PayloadLayout) -> int:
    """Bytes a comm hook sends for a payload of this layout: the bitmap encoding where it is smaller
    (dense steps), the payload itself otherwise."""
    return min(layout.nbytes, bitmap_nbytes(layout))


def sends_bitmap(layout: PayloadLayout) -> bool:
    return bitmap_nbytes(layout) < layout.nbytes


def _views(wire: torch.Tensor, layout: PayloadLayout) -> _BitmapViews:
    if not layout.block:
        raise ValueError("the bitmap encoding is for quantised payloads (compress), not top-k selections")
    bits, values, scales, end = _offsets(layout)
    if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() != end:
        raise ValueError(f"a bitmap wire for {layout} must be a 1-D uint8 tensor of {end} bytes, "
                         f"got {wire.dtype} of shape {tuple(wire.shape)}")
    return _BitmapViews(header=wire[:HEADER_BYTES].view(torch.int32), bits=wire[bits:bits + -(-layout.numel // 8)],
                        values=wire[values:values + layout.capacity].view(torch.int8),
                        scales=wire[scales:scales + 4 * layout.num_blocks].view(torch.float32))


def encode_bitmap(bucket: CompressedBucket) -> torch.Tensor:
    """The bitmap encoding of a payload made by compress()."""
    layout, device = bucket.layout, bucket.payload.device
    wire = torch.zeros(bitmap_nbytes(layout), dtype=torch.uint8, device=device)
    views = _views(wire, layout)
    views.header.copy_(bucket.header)
    views.values.copy_(bucket.values)
    views.scales.copy_(bucket.scales)
    # Each entry's element: its segment is the last whose first entry is at or before it.
    entry = torch.arange(layout.capacity, device=device)
    segment = (torch.searchsorted(bucket.segment_starts.long(), entry, right=True) - 1).clamp(min=0)
    element = segment * SEGMENT + bucket.indices.long()
    sent = entry < bucket.header[0].clamp(max=layout.capacity)
    nbits = views.bits.numel() * 8
    mask = torch.zeros(nbits + 1, dtype=torch.uint8, device=device)  # the last slot takes unsent entries
    mask[torch.where(sent, element, nbits)] = 1
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)
    views.bits.copy_((mask[:nbits].view(-1, 8) * weights).sum(1, dtype=torch.uint8))
    return wire


def decode_bitmap(wire: torch.Tensor, layout: PayloadLayout, out: torch.Tensor | None = None) -> CompressedBucket:
    """The payload (offsets, codes, scales, segment starts) that `wire` encodes: in `out` (a zeroed
    uint8 tensor of layout.nbytes, e.g. a row of the payloads decompress_sum reads) or a new one."""
    views = _views(wire, layout)
    device = wire.device
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    mask = ((views.bits.unsqueeze(1) >> shifts) & 1).view(-1)
    padded = torch.zeros(layout.num_segments * SEGMENT, dtype=torch.uint8, device=device)
    padded[:layout.numel] = mask[:layout.numel]
    element = torch.nonzero_static(padded, size=layout.capacity, fill_value=-1).squeeze(1)
    payload = allocate(layout, None, device)[0] if out is None else CompressedBucket(out, layout)
    payload.header.copy_(views.header)
    payload.values.copy_(views.values)
    payload.scales.copy_(views.scales)
    payload.indices.copy_(torch.where(element >= 0, element % SEGMENT, 0).to(torch.int16))
    per_segment = padded.view(layout.num_segments, SEGMENT).sum(1, dtype=torch.int32)
    payload.segment_starts.copy_((torch.cumsum(per_segment, 0) - per_segment).clamp(max=layout.capacity))
    return payload
