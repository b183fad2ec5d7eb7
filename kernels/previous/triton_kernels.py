"""Triton kernels for selection, compression and decompression; CUDA tensors only.

Imported only when a CUDA tensor arrives (kernels.compression imports it lazily), so machines
without triton can import kernels. Every function matches its twin in kernels/reference.py bit
for bit; the choices that make that so are noted where they are made.

select() runs, for a bucket of n elements:
  _sample_kernel     gathers the sample (at most 2**20 random elements of bucket and residual),
                     stores its magnitude bits and histograms their exponents
  _key_bins_kernel   histograms, within the exponent that holds the threshold, the next 8 bits
                     (few atomics: one per program per bin, and one per sample in that exponent)
  _threshold_kernel  turns the histograms into the threshold
  _quantise_kernel   the one pass over the bucket: reads bucket and residual, writes residual
                     (12 bytes per fp32 element), and compacts each tile's entries (index in the
                     tile, code) into that tile's own slots of a scratch array, with a count
  torch.cumsum       over the counts: where each tile's entries start in the payload
  _gather_kernel     moves each tile's entries to the payload (about 8 bytes per entry), in
                     ascending index order, so Triton and the twin give the same payload bytes
An earlier single-pass design (programs compacting into the payload through staging and atomic
slot claims) held ~16 registers per element, so few programs fit per multiprocessor and it
stalled on load latency at ~35 % of copy bandwidth (measured); one slot-claiming atomic per tile
on a single counter serialised an earlier one still. The scratch array costs memory (4 bytes
per element, allocated per call) but almost no traffic: only the ~k entries are written.
decompress_accumulate() adds each entry into its dense element: one read-modify-write of a
32-byte sector per entry, since at k = 1 % entries are about 100 elements apart.
decompress_sum() averages several ranks' payloads into a bucket in one pass per block: the
block's entries are found by a binary search per block boundary (_block_starts_kernel), then
each block is built in cache and written once (_decompress_sum_kernel).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kernels.previous.payload import HEADER_BYTES, QUANT_MAX, CompressedBucket, PayloadLayout
from kernels.previous.plan import BINS, EXPONENT_SHIFT, KEY_SHIFT, NONFINITE_EXPONENT, WORKSPACE_SAMPLES, SelectionPlan

_KEY_SHIFT = tl.constexpr(KEY_SHIFT)
_EXPONENT_SHIFT = tl.constexpr(EXPONENT_SHIFT)
_NONFINITE_EXPONENT = tl.constexpr(NONFINITE_EXPONENT)
_BINS = tl.constexpr(BINS)
_SAMPLES = tl.constexpr(WORKSPACE_SAMPLES)
_QUANT_MAX = tl.constexpr(float(QUANT_MAX))
_ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2**23: (x + it) - it rounds x half-to-even for |x| < 2**22, as torch.round does."""

SAMPLE_TILE = 256
"""Samples per program: small, so the random gathers spread over every multiprocessor."""
DECOMPRESS_TILE = 1024
TOPK_TILE = 1024
"""Elements per quantising program when there are no scale blocks (top-k alone)."""
ELEMENTS_PER_THREAD = 16
"""Sets a quantising program's warps. Measured on an H200 at 400 MB, for the quantising kernel
alone: blocks of 1024 with 16 elements a thread (2 warps, ~80 registers, 12 programs per
multiprocessor) streamed at 85 % of copy bandwidth; 32 a thread, 68 %; blocks of 4096 with
8 or 4 warps, 62 % and 51 %; with 16 warps (one program per multiprocessor), about a third."""
SEARCH_LANES = 256
"""Block boundaries searched per program when locating each block's entries in a payload."""
SUM_CHUNK = 32
"""Entries a summing program adds per step (at k = 1 % a block has about 10 per rank)."""
GATHER_ROWS = 32
GATHER_WIDTH = 16
"""A gathering program moves the entries of 32 tiles, 16 per tile at a time (4 lanes a thread)."""


@triton.jit
def _sample_kernel(source_ptr, residual_ptr, workspace_ptr, numel, sample_size, sample_stride,
                   HAS_RESIDUAL: tl.constexpr, TILE: tl.constexpr):
    j = tl.program_id(0) * TILE + tl.arange(0, TILE)
    in_sample = j < sample_size
    position = (j.to(tl.int64) * sample_stride) % numel
    acc = tl.load(source_ptr + position, mask=in_sample, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + position, mask=in_sample, other=0.0)
    bits = acc.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.store(workspace_ptr + _SAMPLES + j, bits, mask=in_sample)
    exponent = bits >> _EXPONENT_SHIFT
    # Histogram per program first: most samples share a few exponents, and an atomic per
    # sample on those few counters would queue.
    counts = tl.histogram(exponent, _BINS, mask=in_sample & (exponent < _NONFINITE_EXPONENT))
    tl.atomic_add(workspace_ptr + tl.arange(0, _BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _bin_from_top(counts, need):
    bins = tl.arange(0, _BINS)
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    b = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    here = bins == b
    count = tl.sum(tl.where(here, counts, 0), 0)
    return b, need - (tl.sum(tl.where(here, at_or_above, 0), 0) - count), count


@triton.jit
def _key_bins_kernel(workspace_ptr, sample_size, need, TILE: tl.constexpr):
    exponent, _, _ = _bin_from_top(tl.load(workspace_ptr + tl.arange(0, _BINS)), need)
    j = tl.program_id(0) * TILE + tl.arange(0, TILE)
    bits = tl.load(workspace_ptr + _SAMPLES + j, mask=j < sample_size, other=0)
    here = (j < sample_size) & ((bits >> _EXPONENT_SHIFT) == exponent)
    key_bin = (bits >> _KEY_SHIFT) & (_BINS - 1)
    counts = tl.histogram(key_bin, _BINS, mask=here)
    tl.atomic_add(workspace_ptr + _BINS + tl.arange(0, _BINS), counts, mask=counts > 0, sem="relaxed")
    tl.atomic_max(workspace_ptr + 2 * _BINS + key_bin, bits, mask=here, sem="relaxed")


@triton.jit
def _threshold_bits(workspace_ptr, need):
    # The twin's threshold_bits, in integers so both agree exactly.
    exponent, need, _ = _bin_from_top(tl.load(workspace_ptr + tl.arange(0, _BINS)), need)
    key_bin, need, count = _bin_from_top(tl.load(workspace_ptr + _BINS + tl.arange(0, _BINS)), need)
    low = (tl.maximum(exponent, 0) * _BINS + key_bin).to(tl.int64) << _KEY_SHIFT
    high = tl.load(workspace_ptr + 2 * _BINS + key_bin, mask=count > 0, other=0).to(tl.int64)
    bits = low + (high - low) * (count - need) // tl.maximum(count, 1)
    return tl.where(count > 0, bits, 0).to(tl.int32)


@triton.jit
def _threshold_kernel(workspace_ptr, header_ptr, need):
    tl.store(header_ptr + 2, _threshold_bits(workspace_ptr, need))


@triton.jit
def _quantise_kernel(source_ptr, residual_ptr, header_ptr, scales_ptr, entries_ptr, counts_ptr, numel,
                     COMPRESS: tl.constexpr, TILE: tl.constexpr):
    # Few registers per element, so many programs fit on each multiprocessor and keep enough
    # loads in flight to stream at copy speed; placing entries in the payload is left to
    # _gather_kernel, which needs every tile's count first.
    tile = tl.program_id(0)
    offsets = tile * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    acc = tl.load(source_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if COMPRESS:
        acc += tl.load(residual_ptr + offsets, mask=inside, other=0.0)
    threshold = tl.load(header_ptr + 2).to(tl.float32, bitcast=True)
    exponent = (acc.to(tl.int32, bitcast=True) >> _EXPONENT_SHIFT) & 0xFF
    nonfinite = tl.sum((exponent == _NONFINITE_EXPONENT).to(tl.int32), 0)
    if nonfinite > 0:
        tl.atomic_add(header_ptr + 1, nonfinite, sem="relaxed")
    magnitude = tl.abs(acc)
    chosen = (magnitude >= threshold) & (magnitude > 0.0)
    if COMPRESS:
        scale = tl.div_rn(tl.max(tl.where(chosen, magnitude, 0.0), 0), _QUANT_MAX)
        tl.store(scales_ptr + tile, scale)
        # Correctly rounded division and half-even rounding, as torch does: then a code of 1
        # means |acc| > scale / 2, and acc - code * scale is exact (Sterbenz), which is what
        # makes the residual update lossless.
        ratio = tl.div_rn(acc, tl.where(scale > 0.0, scale, 1.0))
        codes = tl.minimum(tl.maximum((ratio + _ROUND_MAGIC) - _ROUND_MAGIC, -_QUANT_MAX), _QUANT_MAX)
        codes = tl.where(scale > 0.0, tl.where(chosen, codes, 0.0), 0.0)
        chosen = codes != 0.0
        tl.store(residual_ptr + offsets, acc - codes * scale, mask=inside)
        entry = (tl.arange(0, TILE) | ((codes.to(tl.int32) & 0xFF) << 16))
    else:
        entry = tl.arange(0, TILE)
    # The tile's entries, compacted to the front of its own TILE slots: no other tile's count
    # is needed to place them, so no atomics and no second pass over the bucket.
    tl.store(entries_ptr + tile * TILE + tl.cumsum(chosen.to(tl.int32), 0) - 1, entry, mask=chosen)
    tl.store(counts_ptr + tile, tl.sum(chosen.to(tl.int32), 0))


@triton.jit
def _gather_kernel(source_ptr, residual_ptr, header_ptr, scales_ptr, entries_ptr, counts_ptr, ends_ptr, indices_ptr,
                   values_ptr, capacity, tiles, COMPRESS: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr,
                   WIDTH: tl.constexpr):
    # ROWS tiles per program. ends_ptr holds the running sum of the counts, so every entry's
    # slot is known without atomics and the payload comes out in ascending index order.
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_inside = row < tiles
    if tl.program_id(0) == 0:
        tl.store(header_ptr, tl.load(ends_ptr + tiles - 1))
    count = tl.load(counts_ptr + row, mask=row_inside, other=0)
    first = tl.load(ends_ptr + row, mask=row_inside, other=0) - count
    for start in range(0, tl.max(count, 0), WIDTH):
        j = start + tl.arange(0, WIDTH)
        live = j[None, :] < count[:, None]
        entry = tl.load(entries_ptr + row[:, None] * TILE + j[None, :], mask=live, other=0)
        index = row[:, None] * TILE + (entry & 0xFFFF)
        slot = first[:, None] + j[None, :]
        fits = live & (slot < capacity)
        tl.store(indices_ptr + slot, index, mask=fits)
        if COMPRESS:
            code = (entry << 8) >> 24  # the signed byte packed at bits 16..23
            tl.store(values_ptr + slot, code.to(tl.int8), mask=fits)
            # Past capacity: give the value back to the residual, which holds acc - code * scale;
            # adding code * scale back restores acc exactly.
            lost = live & (slot >= capacity)
            scale = tl.load(scales_ptr + row, mask=row_inside, other=0.0)
            kept = tl.load(residual_ptr + index, mask=lost, other=0.0)
            tl.store(residual_ptr + index, kept + code.to(tl.float32) * scale[:, None], mask=lost)
        else:
            tl.store(values_ptr + slot, tl.load(source_ptr + index, mask=fits, other=0.0), mask=fits)


@triton.jit
def _decompress_kernel(header_ptr, indices_ptr, values_ptr, scales_ptr, out_ptr, numel, capacity,
                       BLOCK: tl.constexpr, TILE: tl.constexpr):
    entry = tl.program_id(0) * TILE + tl.arange(0, TILE)
    valid = entry < tl.minimum(tl.load(header_ptr), capacity)
    index = tl.load(indices_ptr + entry, mask=valid, other=0)
    valid = valid & (index >= 0) & (index < numel)
    code = tl.load(values_ptr + entry, mask=valid, other=0).to(tl.float32)
    scale = tl.load(scales_ptr + index // BLOCK, mask=valid, other=0.0)
    # Indices within one payload are distinct, so a plain read-modify-write is race-free and
    # the sum is deterministic; payloads from several ranks are applied one launch each.
    current = tl.load(out_ptr + index, mask=valid, other=0.0)
    tl.store(out_ptr + index, current + code * scale, mask=valid)


@triton.jit
def _block_starts_kernel(payloads_ptr, row_bytes, starts_ptr, capacity, blocks, INDICES_OFFSET: tl.constexpr,
                         BLOCK: tl.constexpr, LANES: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    # starts[rank, b] = the first entry of rank's payload whose index is >= b * BLOCK, for b in
    # 0..blocks: one binary search per lane over the payload's sorted indices, many lanes in
    # flight so the dependent loads overlap (a search per tile inside the summing kernel stalled).
    rank = tl.program_id(1)
    b = tl.program_id(0) * LANES + tl.arange(0, LANES)
    row = payloads_ptr + row_bytes.to(tl.int64) * rank
    sent = tl.minimum(tl.load(row.to(tl.pointer_type(tl.int32))), capacity)
    indices = (row + INDICES_OFFSET).to(tl.pointer_type(tl.int32))
    target = b * BLOCK
    lo = tl.zeros([LANES], dtype=tl.int32)
    hi = lo + sent
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = active & (tl.load(indices + mid, mask=active, other=0) < target)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    tl.store(starts_ptr + rank * (blocks + 1) + b, lo, mask=b <= blocks)


@triton.jit
def _decompress_sum_kernel(payloads_ptr, row_bytes, starts_ptr, out_ptr, numel, ranks, blocks, divisor,
                           INDICES_OFFSET: tl.constexpr, VALUES_OFFSET: tl.constexpr, SCALES_OFFSET: tl.constexpr,
                           BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # One program per scale block: the block is zeroed, each rank's entries for it are added in
    # rank order (read-modify-write of a 4 KB tile this program just wrote, so the scattered
    # accesses hit cache, not DRAM), then divided and written once. DRAM sees the payload
    # entries read and the bucket written, about 4 bytes per element whatever the density.
    tile = tl.program_id(0)
    offsets = tile * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    tl.store(out_ptr + offsets, tl.zeros([BLOCK], dtype=tl.float32), mask=inside)
    tl.debug_barrier()
    for rank in range(ranks):
        row = payloads_ptr + row_bytes.to(tl.int64) * rank
        first = tl.load(starts_ptr + rank * (blocks + 1) + tile)
        last = tl.load(starts_ptr + rank * (blocks + 1) + tile + 1)
        scale = tl.load((row + SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + tile)
        for start in range(first, last, CHUNK):
            entry = start + tl.arange(0, CHUNK)
            live = entry < last
            index = tl.load((row + INDICES_OFFSET).to(tl.pointer_type(tl.int32)) + entry, mask=live, other=0)
            code = tl.load((row + VALUES_OFFSET).to(tl.pointer_type(tl.int8)) + entry, mask=live, other=0)
            # Indices of one payload are distinct, so lanes never collide within a rank.
            current = tl.load(out_ptr + index, mask=live, other=0.0)
            tl.store(out_ptr + index, current + code.to(tl.float32) * scale, mask=live)
        tl.debug_barrier()
    total = tl.load(out_ptr + offsets, mask=inside, other=0.0)
    tl.store(out_ptr + offsets, tl.div_rn(total, divisor), mask=inside)


def decompress_sum(dense_out: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, divisor: float) -> None:
    ranks, blocks = payloads.shape[0], layout.num_blocks
    starts = torch.empty((ranks, blocks + 1), dtype=torch.int32, device=dense_out.device)
    with _on_device(dense_out):
        _block_starts_kernel[(triton.cdiv(blocks + 1, SEARCH_LANES), ranks)](
            payloads, payloads.shape[1], starts, layout.capacity, blocks, INDICES_OFFSET=HEADER_BYTES,
            BLOCK=layout.block, LANES=SEARCH_LANES, SEARCH_STEPS=max(1, layout.capacity.bit_length()), num_warps=4)
        _decompress_sum_kernel[(blocks,)](
            payloads, payloads.shape[1], starts, dense_out, layout.numel, ranks, blocks, float(divisor),
            INDICES_OFFSET=HEADER_BYTES, VALUES_OFFSET=layout.values_offset, SCALES_OFFSET=layout.scales_offset,
            BLOCK=layout.block, CHUNK=SUM_CHUNK, num_warps=max(1, min(8, layout.block // 256)), enable_fp_fusion=False)


def select(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan, out: CompressedBucket,
           workspace: torch.Tensor) -> None:
    compress = residual is not None
    tile = out.layout.block if compress else TOPK_TILE
    tiles = triton.cdiv(plan.numel, tile)
    # Scratch: a slot per element for the entries each tile compacts into its own slots (only
    # about k of them are written), and a count per tile, whose running sum places each tile's
    # entries in the payload.
    entries = torch.empty(tiles * tile, dtype=torch.int32, device=source.device)
    counts = torch.empty(tiles, dtype=torch.int32, device=source.device)
    residual_or_source = residual if compress else source
    scales = out.scales if compress else counts
    samples = (triton.cdiv(plan.sample_size, SAMPLE_TILE),)
    with _on_device(source):
        _sample_kernel[samples](source, residual_or_source, workspace, plan.numel, plan.sample_size,
                                plan.sample_stride, HAS_RESIDUAL=compress, TILE=SAMPLE_TILE, num_warps=2)
        _key_bins_kernel[samples](workspace, plan.sample_size, plan.sample_need, TILE=SAMPLE_TILE, num_warps=2)
        _threshold_kernel[(1,)](workspace, out.header, plan.sample_need, num_warps=1)
        # No fused multiply-add: acc - code * scale must round code * scale first, exactly as
        # the receiver's dequantisation does, or the residual would not be exact.
        _quantise_kernel[(tiles,)](source, residual_or_source, out.header, scales, entries, counts, plan.numel,
                                   COMPRESS=compress, TILE=tile,
                                   num_warps=max(1, min(16, tile // (32 * ELEMENTS_PER_THREAD))),
                                   enable_fp_fusion=False)
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        _gather_kernel[(triton.cdiv(tiles, GATHER_ROWS),)](
            source, residual_or_source, out.header, scales, entries, counts, ends, out.indices, out.values,
            out.capacity, tiles, COMPRESS=compress, TILE=tile, ROWS=GATHER_ROWS, WIDTH=GATHER_WIDTH, num_warps=4,
            enable_fp_fusion=False)


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    with _on_device(dense_out):
        _decompress_kernel[(triton.cdiv(compressed.capacity, DECOMPRESS_TILE),)](
            compressed.header, compressed.indices, compressed.values, compressed.scales, dense_out,
            compressed.numel, compressed.capacity, BLOCK=compressed.layout.block, TILE=DECOMPRESS_TILE,
            num_warps=4, enable_fp_fusion=False)


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's GPU, not merely the current one. CPU tensors only reach here under
    TRITON_INTERPRET=1, which the interpreter tests use."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
