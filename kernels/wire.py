"""What the top-k hook sends: a quantised payload with its entries' places Elias–Fano coded.

A payload (kernels.payload) names each entry's place as an int16 offset in its segment, 2 bytes an
entry. The places are a rising sequence of `capacity` numbers below `numel`, and Elias–Fano codes
such a sequence in at most 2 + log2(numel / capacity) bits an entry: each place's low
L = floor(log2(numel / capacity)) bits as they are, and its high bits in unary, as one set bit
(place >> L) + j in a bitmap for entry j. A slot's place then costs 1.05 bytes at k = 1 % (10 %
slack included) and 0.65 at 10 %, where an offset costs 2 and a bitmap of the whole bucket (1/8 byte
an element) 1.14 at 10 %; with its int8 code a slot goes in 1.65-2.05 bytes instead of 3. Elias–Fano
is larger than that bitmap only above one slot in four elements (a ramp's first step, at 25 % of the
entries and 27.5 % of slots, sends about 1.5 % more than the bitmap would have).

    wire = encode_wire(mine)                                        # uint8[wire_nbytes(mine.layout)]
    payloads = decode_wires(gathered.view(world_size, -1), mine.layout)   # [world_size, layout.nbytes]

Decoding gives back every rank's payload as compress() made it, byte for byte, including one whose
selection overflowed its capacity (its entries are the lowest-indexed ones, and its segment starts
are clamped at the capacity as compress clamps them).

Layout (byte offsets, each array 16-byte aligned; bit b of byte i is bit 8i + b):

    header  int32[4]                       the payload's header
    low     uint32[ceil(capacity L / 32)]  entry j's low L bits, bits jL to jL + L - 1
    high    uint8[ceil(H / 8)]             bit (place_j >> L) + j set for each sent entry j, with
                                           H = capacity + ((numel - 1) >> L) + 1
    values  int8[capacity]                 the payload's codes, in ascending place order
    scales  float32[num_blocks]            the payload's scales

CUDA tensors run the Triton kernels (kernels/triton_wire.py), anything else the torch twins here;
both give the same bytes, and both drop a corrupted wire's places past the bucket or past capacity
(only a wire whose places stop rising, possible at L >= 15, can get different segment starts). Neither waits for the device, so a comm hook calls them while backward
runs; decoding takes all gathered rows at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.backend import use_triton
from kernels.payload import HEADER_BYTES, SEGMENT, CompressedBucket, PayloadLayout, _align16


@dataclass(frozen=True, slots=True)
class WireLayout:
    """Where each array of a wire lies, for one payload layout."""

    low_bits: int
    """L: the low bits of each place sent as they are."""
    high_bits: int
    """H: bits of the unary-coded high parts (one more than the highest an entry can set)."""
    low_words: int
    """32-bit words the low bits fill: capacity × L / 32, rounded up."""
    low: int
    high: int
    values: int
    scales: int
    """Byte offsets of the arrays in the wire."""
    nbytes: int

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def of(cls, layout: PayloadLayout) -> WireLayout:
        """Cached: a comm hook asks for the same few layouts every step."""
        if not layout.block:
            raise ValueError("the wire encoding is for quantised payloads (compress), not top-k selections")
        capacity, numel = layout.capacity, layout.numel
        low_bits = (numel // capacity).bit_length() - 1 if capacity else 0
        high_bits = capacity + (max(numel - 1, 0) >> low_bits) + 1 if numel else 0
        low_words = -(-capacity * low_bits // 32)
        high = _align16(HEADER_BYTES + 4 * low_words)
        values = _align16(high + -(-high_bits // 8))
        scales = _align16(values + capacity)
        return cls(low_bits, high_bits, low_words, HEADER_BYTES, high, values, scales,
                   _align16(scales + 4 * layout.num_blocks))

    @property
    def high_words(self) -> int:
        """32-bit words the unary code fills."""
        return -(-self.high_bits // 32)


def wire_nbytes(layout: PayloadLayout) -> int:
    """Bytes the top-k hook sends for a payload of this layout, whatever its entries."""
    return WireLayout.of(layout).nbytes


def encode_wire(bucket: CompressedBucket) -> torch.Tensor:
    """The wire encoding of a payload made by compress()."""
    shape = WireLayout.of(bucket.layout)
    wire = torch.zeros(shape.nbytes, dtype=torch.uint8, device=bucket.payload.device)
    if use_triton(wire):
        from kernels import triton_wire

        triton_wire.encode(bucket, wire, shape)
    else:
        encode_twin(bucket, wire, shape)
    return wire


def decode_wires(wires: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """Every row's payload (as compress() made it), uint8[rows, layout.nbytes], from the rows of an
    all-gather of wires of this layout."""
    shape = WireLayout.of(layout)
    if wires.dtype != torch.uint8 or wires.dim() != 2 or wires.shape[1] != shape.nbytes:
        raise ValueError(f"wires for {layout} must be a 2-D uint8 tensor of {shape.nbytes} bytes a row "
                         f"(one row per rank), got {wires.dtype} of shape {tuple(wires.shape)}")
    capacity = layout.capacity
    payloads = torch.zeros(wires.shape[0], layout.nbytes, dtype=torch.uint8, device=wires.device)
    payloads[:, :HEADER_BYTES] = wires[:, :HEADER_BYTES]
    payloads[:, layout.values_offset:layout.values_offset + capacity] = wires[:, shape.values:shape.values + capacity]
    scale_bytes = 4 * layout.num_blocks
    scales_at = layout.scales_offset
    payloads[:, scales_at:scales_at + scale_bytes] = wires[:, shape.scales:shape.scales + scale_bytes]
    if use_triton(wires):
        from kernels import triton_wire

        triton_wire.decode_places(wires.contiguous(), payloads, layout, shape)
    else:
        decode_places_twin(wires, payloads, layout, shape)
    return payloads


def encode_twin(bucket: CompressedBucket, wire: torch.Tensor, shape: WireLayout) -> None:
    """The torch twin of triton_wire.encode: bucket's wire into `wire`, zeroed."""
    layout, device = bucket.layout, wire.device
    wire[:HEADER_BYTES] = bucket.payload[:HEADER_BYTES]
    wire[shape.values:shape.values + layout.capacity] = bucket.values.view(torch.uint8)
    wire[shape.scales:shape.scales + 4 * layout.num_blocks] = bucket.scales.view(torch.uint8)
    # Each entry's place: its segment is the last whose first entry is at or before it.
    entry = torch.arange(layout.capacity, device=device)
    segment = (torch.searchsorted(bucket.segment_starts.long(), entry, right=True) - 1).clamp(min=0)
    sent = entry < bucket.header[0].clamp(max=layout.capacity)
    place = torch.where(sent, segment * SEGMENT + bucket.indices.long(), 0)
    if shape.low_bits:
        low = (place.unsqueeze(1) >> torch.arange(shape.low_bits, device=device)) & 1
        _pack_into(wire[shape.low:shape.high], low.view(-1))
    unary = torch.zeros(shape.high_bits + 1, dtype=torch.uint8, device=device)  # the last bit takes unsent entries
    unary.scatter_(0, torch.where(sent, (place >> shape.low_bits) + entry, shape.high_bits), 1)
    _pack_into(wire[shape.high:shape.values], unary[:shape.high_bits])


def decode_places_twin(wires: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, shape: WireLayout) -> None:
    """The torch twin of triton_wire.decode_places: each row's offsets and segment starts into `payloads` (zeroed)."""
    rows, capacity, device = wires.shape[0], layout.capacity, wires.device
    place, sent = _places(wires, shape, capacity)
    sent &= place < layout.numel  # a corrupted place is dropped, never written out of range
    offsets = payloads[:, HEADER_BYTES:layout.values_offset].view(torch.int16)
    offsets.copy_(torch.where(sent, place % SEGMENT, 0))
    segments = layout.num_segments
    per_segment = torch.zeros(rows, segments + 1, dtype=torch.int32, device=device)
    per_segment.scatter_add_(1, torch.where(sent, place // SEGMENT, segments),
                             torch.ones_like(place, dtype=torch.int32))
    per_segment = per_segment[:, :segments]
    starts = payloads[:, layout.starts_offset:layout.starts_offset + 4 * segments].view(torch.int32)
    starts.copy_((torch.cumsum(per_segment, 1) - per_segment).clamp(max=capacity))


def _places(wires: torch.Tensor, shape: WireLayout, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(place of each entry, int64[rows, capacity]; whether the entry was sent) from the rows' codes."""
    rows, device = wires.shape[0], wires.device
    unary = _unpack(wires[:, shape.high:shape.values])[:, :shape.high_bits]
    # The j-th set bit of a row is entry j's, at (place >> L) + j; a corrupted row's bits past its
    # capacity-th are dropped, as the Triton kernel drops them. One compaction finds every row's set
    # bits in row order (a scatter per bit queued the unset ones on one address: 17 ms at 1 GB).
    unary &= (torch.cumsum(unary, 1, dtype=torch.int32) <= capacity).to(torch.uint8)
    set_bits = unary.sum(1, dtype=torch.int64)
    first = torch.cumsum(set_bits, 0) - set_bits
    found = torch.nonzero_static(unary.reshape(-1), size=rows * capacity, fill_value=-1).view(-1)
    entry = torch.arange(capacity, device=device)
    sent = entry < set_bits.unsqueeze(1)
    flat = found[(first.unsqueeze(1) + entry).clamp(max=rows * capacity - 1)]
    position = flat - torch.arange(rows, device=device).unsqueeze(1) * shape.high_bits
    place = torch.where(sent, position - entry, 0) << shape.low_bits
    if shape.low_bits:
        low = _unpack(wires[:, shape.low:shape.high])[:, :capacity * shape.low_bits]
        low = low.view(rows, capacity, shape.low_bits)
        place |= (low.long() << torch.arange(shape.low_bits, device=device)).sum(2)
    return place, sent


def _pack_into(out: torch.Tensor, bits: torch.Tensor) -> None:
    """out (uint8) holds `bits` (0/1 values, at most 8 * len(out)) eight to a byte, the rest zero."""
    padded = torch.zeros(out.numel() * 8, dtype=torch.uint8, device=bits.device)
    padded[:bits.numel()] = bits
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)  # made on the device: no host copy to wait on
    out.copy_((padded.view(-1, 8) << shifts).sum(1, dtype=torch.uint8))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8[rows, 8 * bytes] of 0/1 from uint8[rows, bytes]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(2) >> shifts) & 1).view(packed.shape[0], -1)
