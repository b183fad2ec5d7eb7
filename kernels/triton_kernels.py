"""Triton kernels for selection, compression and decompression; CUDA tensors only.

Imported only when a CUDA tensor arrives (kernels.compression imports it lazily), so machines
without triton can import kernels. Every function matches its twin in kernels/reference.py bit
for bit; the choices that make that so are noted where they are made.

Memory traffic per call, for a bucket of n fp32 elements and k = 1 % of n:
  estimate_threshold: a sample of at most 2**20 random elements of bucket and residual, into a
    histogram (L2-resident); independent of n beyond that.
  select: reads bucket and residual and writes residual (12 n bytes of DRAM), plus the payload
    (about 0.06 n bytes). Each program owns one scale block and reads it twice, first for the
    scale and then to quantise, the second time mostly from L2. A program claims its output
    slots with one atomic add per tile, which is why entries land in completion order.
  decompress_accumulate: the payload, and one read-modify-write of a 32-byte sector of
    dense_out per entry: entries are far apart at 1 %, so each owns a sector.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kernels.payload import QUANT_MAX, CompressedBucket
from kernels.plan import COARSE_BINS, FINE_BINS, KEY_SHIFT, NONFINITE_KEY, SelectionPlan

_KEY_SHIFT = tl.constexpr(KEY_SHIFT)
_NONFINITE_KEY = tl.constexpr(NONFINITE_KEY)
_COARSE_BINS = tl.constexpr(COARSE_BINS)
_FINE_BINS = tl.constexpr(FINE_BINS)
_QUANT_MAX = tl.constexpr(float(QUANT_MAX))
_ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2**23: (x + it) - it rounds x half-to-even for |x| < 2**22, as torch.round does."""

_SAMPLE_TILE = 1024
_DECOMPRESS_TILE = 1024
SELECT_TILE = 1024
SELECT_WARPS = 4
"""Elements per loop step of a selecting program, and its warps: 8 elements a thread keeps
registers low enough for several programs per multiprocessor."""


@triton.jit
def _magnitude_key(x):
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >> _KEY_SHIFT


@triton.jit
def _sample_histogram_kernel(source_ptr, residual_ptr, histogram_ptr, numel, sample_size, sample_stride,
                             HAS_RESIDUAL: tl.constexpr, TILE: tl.constexpr):
    j = tl.program_id(0) * TILE + tl.arange(0, TILE)
    in_sample = j < sample_size
    position = (j.to(tl.int64) * sample_stride) % numel
    acc = tl.load(source_ptr + position, mask=in_sample, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + position, mask=in_sample, other=0.0)
    bits = acc.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    key = bits >> _KEY_SHIFT
    counted = in_sample & (key < _NONFINITE_KEY)
    # Per-program histogram first: thousands of samples share an exponent, and one atomic per
    # sample on the same address would serialise.
    coarse = tl.histogram(key >> 8, _COARSE_BINS, mask=counted)
    tl.atomic_add(histogram_ptr + tl.arange(0, _COARSE_BINS), coarse, mask=coarse > 0, sem="relaxed")
    tl.atomic_add(histogram_ptr + _COARSE_BINS + key, 1, mask=counted, sem="relaxed")
    tl.atomic_max(histogram_ptr + _COARSE_BINS + _FINE_BINS + key, bits, mask=counted, sem="relaxed")


@triton.jit
def _bin_from_top(counts, need, bins):
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    b = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    here = bins == b
    count = tl.sum(tl.where(here, counts, 0), 0)
    return b, need - (tl.sum(tl.where(here, at_or_above, 0), 0) - count), count


@triton.jit
def _threshold_kernel(histogram_ptr, header_ptr, need):
    # The twin's threshold_bits, in integers so both agree exactly.
    bins = tl.arange(0, _COARSE_BINS)
    exponent, need, _ = _bin_from_top(tl.load(histogram_ptr + bins), need, bins)
    exponent = tl.maximum(exponent, 0)
    key_bin, need, count = _bin_from_top(tl.load(histogram_ptr + _COARSE_BINS + exponent * 256 + bins), need, bins)
    key = exponent * 256 + key_bin
    low = key.to(tl.int64) << _KEY_SHIFT
    high = tl.load(histogram_ptr + _COARSE_BINS + _FINE_BINS + key, mask=count > 0, other=0).to(tl.int64)
    bits = low + (high - low) * (count - need) // tl.maximum(count, 1)
    tl.store(header_ptr + 2, tl.where(count > 0, bits, 0).to(tl.int32))


@triton.jit
def _load_acc(source_ptr, residual_ptr, offsets, inside, HAS_RESIDUAL: tl.constexpr, POLICY: tl.constexpr):
    acc = tl.load(source_ptr + offsets, mask=inside, other=0.0, eviction_policy=POLICY).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offsets, mask=inside, other=0.0, eviction_policy=POLICY)
    return acc


@triton.jit
def _select_kernel(source_ptr, residual_ptr, header_ptr, indices_ptr, values_ptr, scales_ptr, numel, capacity,
                   HAS_RESIDUAL: tl.constexpr, QUANTISE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    # One program per scale block, walked in tiles of TILE elements so that registers hold a
    # tile, not a block, and several programs share each multiprocessor (one would leave it
    # idle while it reduces). With quantisation the block is read twice: first for its scale,
    # then to quantise and write; the second read mostly hits L2, as the first asked
    # (evict_last), so DRAM still sees each byte once.
    pid = tl.program_id(0)
    threshold = tl.load(header_ptr + 2).to(tl.float32, bitcast=True)
    if QUANTISE:
        largest = tl.full([], 0.0, tl.float32)
        for start in range(0, BLOCK, TILE):
            offsets = pid * BLOCK + start + tl.arange(0, TILE)
            magnitude = tl.abs(_load_acc(source_ptr, residual_ptr, offsets, offsets < numel, HAS_RESIDUAL, "evict_last"))
            largest = tl.maximum(largest, tl.max(tl.where(magnitude >= threshold, magnitude, 0.0), 0))
        scale = tl.div_rn(largest, _QUANT_MAX)
        tl.store(scales_ptr + pid, scale)
    for start in range(0, BLOCK, TILE):
        offsets = pid * BLOCK + start + tl.arange(0, TILE)
        inside = offsets < numel
        acc = _load_acc(source_ptr, residual_ptr, offsets, inside, HAS_RESIDUAL, "evict_first")
        nonfinite = tl.sum((_magnitude_key(acc) >= _NONFINITE_KEY).to(tl.int32), 0)
        if nonfinite > 0:
            tl.atomic_add(header_ptr + 1, nonfinite, sem="relaxed")
        magnitude = tl.abs(acc)
        chosen = (magnitude >= threshold) & (magnitude > 0.0)
        if QUANTISE:
            # Correctly rounded division and half-even rounding, as torch does: then a code of 1
            # means |acc| > scale / 2, and acc - code * scale is exact (Sterbenz), which is what
            # makes the residual update lossless.
            ratio = tl.div_rn(acc, tl.where(scale > 0.0, scale, 1.0))
            codes = tl.minimum(tl.maximum((ratio + _ROUND_MAGIC) - _ROUND_MAGIC, -_QUANT_MAX), _QUANT_MAX)
            codes = tl.where(scale > 0.0, codes, 0.0)
            chosen = chosen & (codes != 0.0)
            stored = codes
            sent_value = codes * scale
        else:
            stored = acc
            sent_value = acc
        first = tl.atomic_add(header_ptr, tl.sum(chosen.to(tl.int32), 0), sem="relaxed")
        slot = first + tl.cumsum(chosen.to(tl.int32), 0) - 1
        sent = chosen & (slot < capacity)
        tl.store(indices_ptr + slot, offsets, mask=sent)
        tl.store(values_ptr + slot, stored.to(values_ptr.dtype.element_ty), mask=sent)
        if HAS_RESIDUAL:
            tl.store(residual_ptr + offsets, tl.where(sent, acc - sent_value, acc), mask=inside)


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


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's GPU, not merely the current one. CPU tensors only reach here under
    TRITON_INTERPRET=1, which the interpreter tests use."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def estimate_threshold(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan,
                       header: torch.Tensor, histogram: torch.Tensor) -> None:
    with _on_device(source):
        _sample_histogram_kernel[(triton.cdiv(plan.sample_size, _SAMPLE_TILE),)](
            source, source if residual is None else residual, histogram, plan.numel, plan.sample_size,
            plan.sample_stride, HAS_RESIDUAL=residual is not None, TILE=_SAMPLE_TILE, num_warps=4)
        _threshold_kernel[(1,)](histogram, header, plan.sample_need, num_warps=4)


def select(source: torch.Tensor, residual: torch.Tensor | None, out: CompressedBucket) -> None:
    quantised = out.layout.block is not None
    block = out.layout.block if quantised else SELECT_TILE
    with _on_device(source):
        # No fused multiply-add: acc - code * scale must round code * scale first, exactly as
        # the receiver's dequantisation does, or the residual would not be exact.
        _select_kernel[(triton.cdiv(out.numel, block),)](
            source, source if residual is None else residual, out.header, out.indices, out.values,
            out.scales if quantised else out.header, out.numel, out.capacity,
            HAS_RESIDUAL=residual is not None, QUANTISE=quantised, BLOCK=block, TILE=min(block, SELECT_TILE),
            num_warps=SELECT_WARPS, enable_fp_fusion=False)


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    with _on_device(dense_out):
        _decompress_kernel[(triton.cdiv(compressed.capacity, _DECOMPRESS_TILE),)](
            compressed.header, compressed.indices, compressed.values, compressed.scales, dense_out,
            compressed.numel, compressed.capacity, BLOCK=compressed.layout.block, TILE=_DECOMPRESS_TILE,
            num_warps=4, enable_fp_fusion=False)
