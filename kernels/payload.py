"""The compressed bucket: one contiguous byte tensor, what the decompress kernels read.

Every rank's payload is the same size for the same bucket and settings. The top-k hook sends it
with its offsets Elias–Fano coded (kernels.wire), decodes each gathered row back to a payload and
hands it on through `CompressedBucket.with_payload`.

Layout (byte offsets; each array starts 16-byte aligned except the values):

    header   int32[4]            selected, nonfinite, threshold (fp32 bits), 0
    offsets  int16[capacity]     quantised payloads: each sent entry's place inside its segment of
                                 SEGMENT elements, entries in ascending element order
 or indices  int32[capacity]     top-k selections: each entry's element index, ascending
    values   int8[capacity]      quantised codes (or raw values, for top-k)
    scales   float32[blocks]     one per `block` elements of the bucket: dequantised = code * scale
    starts   int32[segments]     with scales only: the first entry of each SEGMENT elements of the
                                 bucket; entry j lies in the segment s with starts[s] <= j < starts[s + 1]
                                 (the last segment's entries end at the count sent)

A quantised entry costs 3 bytes (offset and code), not 5 with an int32 index: the segment starts
that tell a receiver where each segment's entries begin also give their offsets a base.

`selected` counts the elements chosen; the first min(selected, capacity) entries are valid and
the rest of the payload is zero. `nonfinite` counts NaN/inf elements seen, so every receiver can
refuse a poisoned bucket too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.errors import NonFiniteGradientError
from kernels.selection import SelectionPlan

HEADER_BYTES = 16
QUANT_MAX = 127
"""Codes lie in [-127, 127]: symmetric, so a scale is max|value| / 127 and -128 is never used."""
SEGMENT = 1 << 14
"""Bucket elements per segment start: 4 bytes per 16384 elements, 0.7 % of a payload at k = 1 %.
A multiple of every block size, so segments are whole scale blocks; below 2**15, so an offset
inside a segment fits an int16."""


def _align16(offset: int) -> int:
    return -(-offset // 16) * 16


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    numel: int
    """Elements in the dense bucket the payload describes."""
    capacity: int
    """Entries the payload has room for."""
    value_dtype: torch.dtype
    """torch.int8 for quantised codes; the input's dtype for raw top-k values."""
    block: int | None
    """Bucket elements per scale, or None when values are raw (no scales)."""

    @property
    def num_blocks(self) -> int:
        return -(-self.numel // self.block) if self.block else 0

    @property
    def num_segments(self) -> int:
        return -(-self.numel // SEGMENT) if self.block else 0

    @property
    def index_dtype(self) -> torch.dtype:
        """int16 offsets inside a segment for quantised payloads, int32 element indices for top-k."""
        return torch.int16 if self.block else torch.int32

    @property
    def entry_bytes(self) -> int:
        """Bytes per entry: its offset or index and its value."""
        return self.index_dtype.itemsize + self.value_dtype.itemsize

    @property
    def values_offset(self) -> int:
        return HEADER_BYTES + self.index_dtype.itemsize * self.capacity

    @property
    def scales_offset(self) -> int:
        return _align16(self.values_offset + self.capacity * self.value_dtype.itemsize)

    @property
    def starts_offset(self) -> int:
        return _align16(self.scales_offset + 4 * self.num_blocks)

    @property
    def nbytes(self) -> int:
        return _align16(self.starts_offset + 4 * self.num_segments)


@dataclass(frozen=True, slots=True)
class CompressedBucket:
    payload: torch.Tensor
    """uint8, 1-D, contiguous, exactly layout.nbytes long."""
    layout: PayloadLayout
    header: torch.Tensor = field(init=False, repr=False)
    """int32[4] view: selected, nonfinite, threshold bits, 0."""
    indices: torch.Tensor = field(init=False, repr=False)
    """int32[capacity] view of a top-k selection's element indices, or int16[capacity] of a
    quantised payload's offsets inside their segments (element_indices() adds the bases)."""
    values: torch.Tensor = field(init=False, repr=False)
    """layout.value_dtype[capacity] view."""
    scales: torch.Tensor = field(init=False, repr=False)
    """float32[num_blocks] view."""
    segment_starts: torch.Tensor = field(init=False, repr=False)
    """int32[num_segments] view: entry where each SEGMENT of the bucket begins, at most capacity."""

    def __post_init__(self):
        p, layout = self.payload, self.layout
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous() or p.numel() != layout.nbytes:
            raise ValueError(f"a payload for {layout} must be a contiguous 1-D uint8 tensor of "
                             f"{layout.nbytes} bytes, got {p.dtype} of shape {tuple(p.shape)}; "
                             "gather payloads of compress() calls with the same bucket size, k_ratio and block")
        # Views made once: a comm hook touches them every step, and each view costs host time.
        values_end = layout.values_offset + layout.capacity * layout.value_dtype.itemsize
        object.__setattr__(self, "header", p[:HEADER_BYTES].view(torch.int32))
        object.__setattr__(self, "indices", p[HEADER_BYTES:layout.values_offset].view(layout.index_dtype))
        object.__setattr__(self, "values", p[layout.values_offset:values_end].view(layout.value_dtype))
        scales_end = layout.scales_offset + 4 * layout.num_blocks
        object.__setattr__(self, "scales", p[layout.scales_offset:scales_end].view(torch.float32))
        starts_end = layout.starts_offset + 4 * layout.num_segments
        object.__setattr__(self, "segment_starts", p[layout.starts_offset:starts_end].view(torch.int32))

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def threshold(self) -> torch.Tensor:
        """The magnitude threshold used, as a one-element float32 tensor (on the device)."""
        return self.header[2:3].view(torch.float32)

    def counts(self) -> tuple[int, int]:
        """(selected, nonfinite) read from the header; waits for the device."""
        selected, nonfinite = self.header[:2].tolist()
        return selected, nonfinite

    def sent(self) -> int:
        """Valid entries: those selected, up to capacity; waits for the device."""
        return min(self.counts()[0], self.capacity)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(entry numbers, element indices) of the valid entries, int64, in segment order; waits for
        the device. A quantised entry's segment is the one whose range of entries holds it, with the
        starts clamped to the entries sent exactly as the decompress kernels clamp them, and an
        offset that falls outside its segment (a corrupted payload) is left out."""
        sent = max(self.sent(), 0)
        if not self.layout.block:
            entry = torch.arange(sent, device=self.payload.device)
            index = self.indices[:sent].long()
            valid = (index >= 0) & (index < self.numel)
            return entry[valid], index[valid]
        first = self.segment_starts.long().clamp(0, sent)
        after = torch.cat([self.segment_starts[1:].long(), first.new_tensor([sent])])
        last = torch.maximum(after.clamp(max=sent), first)
        lengths = last - first
        segment = torch.repeat_interleave(torch.arange(len(first), device=first.device), lengths)
        before = torch.cumsum(lengths, 0) - lengths
        entry = (torch.arange(int(lengths.sum()), device=first.device)
                 + torch.repeat_interleave(first - before, lengths))
        offset = self.indices[entry].long()
        index = segment * SEGMENT + offset
        valid = (offset >= 0) & (offset < SEGMENT) & (index < self.numel)
        return entry[valid], index[valid]

    def element_indices(self) -> torch.Tensor:
        """Element index of every valid entry, int64, ascending for an uncorrupted payload."""
        return self.entries()[1]

    def raise_if_nonfinite(self) -> None:
        """Raise NonFiniteGradientError if the bucket that made this payload held NaN or inf."""
        nonfinite = self.counts()[1]
        if nonfinite:
            raise NonFiniteGradientError(nonfinite, self.numel, with_residual=True)

    def with_payload(self, payload: torch.Tensor) -> CompressedBucket:
        """The same layout over another rank's payload, e.g. a row of an all-gather."""
        return CompressedBucket(payload, self.layout)


def allocate(layout: PayloadLayout, plan: SelectionPlan | None, device: torch.device) -> tuple[CompressedBucket, torch.Tensor]:
    """A zeroed payload and the plan's zeroed int32 workspace, from one allocation and one memset."""
    workspace = plan.workspace_int32s if plan else 0
    buffer = torch.zeros(layout.nbytes + 4 * workspace, dtype=torch.uint8, device=device)
    return CompressedBucket(buffer[:layout.nbytes], layout), buffer[layout.nbytes:].view(torch.int32)
