"""Triton kernels for selection, compression and decompression; CUDA tensors only.

Imported only when a CUDA tensor arrives (kernels.compression imports it lazily), so machines
without triton can import kernels. Every function matches its twin in kernels/reference.py bit
for bit; the choices that make that so are noted where they are made.

select() launches three kernels:
  _sample_kernel     gathers the sample (at most 2**20 random elements of bucket and residual),
                     stores its magnitude bits and histograms their exponents
  _key_bins_kernel   histograms, within the exponent that holds the threshold, the next 8 bits
                     (few atomics: one per program per bin, and one per sample in that exponent)
  _select_kernel     one pass over the bucket: reads bucket and residual, writes residual (12 n
                     bytes for fp32) and the payload (about 0.06 n bytes at k = 1 %)
A selecting program owns a contiguous run of tiles (one tile per scale block) and loads the next
tile while it works on the current one. Its chosen entries go first to a private staging area
(L2-resident) and reach the payload in batches, each claiming its slots with one atomic add: one
atomic per tile on a single counter serialised the whole kernel (measured). That is also why
entries land in the payload in batches, in no global order.
decompress_accumulate() adds each entry into its dense element: one read-modify-write of a
32-byte sector per entry, since at k = 1 % entries are about 100 elements apart.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from kernels.payload import QUANT_MAX, CompressedBucket
from kernels.plan import BINS, EXPONENT_SHIFT, KEY_SHIFT, NONFINITE_EXPONENT, WORKSPACE_SAMPLES, SelectionPlan

_KEY_SHIFT = tl.constexpr(KEY_SHIFT)
_EXPONENT_SHIFT = tl.constexpr(EXPONENT_SHIFT)
_NONFINITE_EXPONENT = tl.constexpr(NONFINITE_EXPONENT)
_BINS = tl.constexpr(BINS)
_SAMPLES = tl.constexpr(WORKSPACE_SAMPLES)
_QUANT_MAX = tl.constexpr(float(QUANT_MAX))
_ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2**23: (x + it) - it rounds x half-to-even for |x| < 2**22, as torch.round does."""

SAMPLE_TILE = 1024
DECOMPRESS_TILE = 1024
TOPK_TILE = 1024
"""Elements per selecting step when there are no scale blocks (top-k alone)."""
STAGE_ENTRIES = 2048
"""Entries a selecting program stages before claiming payload slots for them (at least a tile)."""


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
def _flush(staged, stage, header_ptr, stage_indices_ptr, stage_values_ptr, indices_ptr, values_ptr, scales_ptr,
           residual_ptr, capacity, COMPRESS: tl.constexpr, TILE: tl.constexpr, STAGE: tl.constexpr):
    """Copy `staged` entries from this program's staging area to freshly claimed payload slots."""
    tl.debug_barrier()  # every thread's staged stores (and residual stores) are visible
    first = tl.atomic_add(header_ptr, staged, sem="relaxed")
    for start in range(0, staged, TILE):
        j = start + tl.arange(0, TILE)
        valid = j < staged
        index = tl.load(stage_indices_ptr + stage + j, mask=valid, other=0)
        value = tl.load(stage_values_ptr + stage + j, mask=valid, other=0)
        slot = first + j
        fits = valid & (slot < capacity)
        tl.store(indices_ptr + slot, index, mask=fits)
        tl.store(values_ptr + slot, value, mask=fits)
        if COMPRESS:
            # Past capacity: give the value back to the residual, which held acc - code * scale;
            # adding code * scale back restores acc exactly.
            lost = valid & (slot >= capacity)
            scale = tl.load(scales_ptr + index // TILE, mask=lost, other=0.0)
            kept = tl.load(residual_ptr + index, mask=lost, other=0.0)
            tl.store(residual_ptr + index, kept + value.to(tl.float32) * scale, mask=lost)
    tl.debug_barrier()  # the staging area is free again


@triton.jit
def _select_kernel(source_ptr, residual_ptr, workspace_ptr, need, header_ptr, indices_ptr, values_ptr, scales_ptr,
                   stage_indices_ptr, stage_values_ptr, numel, capacity, tiles_per_program,
                   COMPRESS: tl.constexpr, TILE: tl.constexpr, STAGE: tl.constexpr):
    pid = tl.program_id(0)
    threshold_bits = _threshold_bits(workspace_ptr, need)
    if pid == 0:
        tl.store(header_ptr + 2, threshold_bits)
    threshold = threshold_bits.to(tl.float32, bitcast=True)
    stage = pid * STAGE
    first_tile = pid * tiles_per_program
    tiles = tl.cdiv(numel, TILE)
    end = tl.minimum((first_tile + tiles_per_program) * TILE, numel)
    staged = 0
    # Every program loops tiles_per_program times; only the last one can run past the bucket,
    # and its empty tiles cost no memory traffic.
    for step in range(tiles_per_program):
        tile = first_tile + step
        offsets = tile * TILE + tl.arange(0, TILE)
        inside = offsets < end
        acc = tl.load(source_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if COMPRESS:
            acc += tl.load(residual_ptr + offsets, mask=inside, other=0.0)

        exponent = (acc.to(tl.int32, bitcast=True) >> _EXPONENT_SHIFT) & 0xFF
        nonfinite = tl.sum((exponent == _NONFINITE_EXPONENT).to(tl.int32), 0)
        if nonfinite > 0:
            tl.atomic_add(header_ptr + 1, nonfinite, sem="relaxed")
        magnitude = tl.abs(acc)
        chosen = (magnitude >= threshold) & (magnitude > 0.0)
        if COMPRESS:
            scale = tl.div_rn(tl.max(tl.where(chosen, magnitude, 0.0), 0), _QUANT_MAX)
            tl.store(scales_ptr + tile, scale, mask=tile < tiles)
            # Correctly rounded division and half-even rounding, as torch does: then a code of 1
            # means |acc| > scale / 2, and acc - code * scale is exact (Sterbenz), which is what
            # makes the residual update lossless.
            ratio = tl.div_rn(acc, tl.where(scale > 0.0, scale, 1.0))
            codes = tl.minimum(tl.maximum((ratio + _ROUND_MAGIC) - _ROUND_MAGIC, -_QUANT_MAX), _QUANT_MAX)
            codes = tl.where(scale > 0.0, codes, 0.0)
            chosen = chosen & (codes != 0.0)
            stored = codes
        else:
            stored = acc
        count = tl.sum(chosen.to(tl.int32), 0)
        if staged + count > STAGE:
            _flush(staged, stage, header_ptr, stage_indices_ptr, stage_values_ptr, indices_ptr, values_ptr,
                   scales_ptr, residual_ptr, capacity, COMPRESS, TILE, STAGE)
            staged = 0
        position = stage + staged + tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(stage_indices_ptr + position, offsets, mask=chosen)
        tl.store(stage_values_ptr + position, stored.to(stage_values_ptr.dtype.element_ty), mask=chosen)
        if COMPRESS:
            tl.store(residual_ptr + offsets, tl.where(chosen, acc - codes * scale, acc), mask=inside)
        staged += count
    if staged > 0:
        _flush(staged, stage, header_ptr, stage_indices_ptr, stage_values_ptr, indices_ptr, values_ptr,
               scales_ptr, residual_ptr, capacity, COMPRESS, TILE, STAGE)


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


def select(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan, out: CompressedBucket,
           workspace: torch.Tensor) -> None:
    compress = residual is not None
    tile = out.layout.block if compress else TOPK_TILE
    options = _select_options(compress, tile)
    tiles = triton.cdiv(plan.numel, tile)
    with _on_device(source):
        per_program = triton.cdiv(tiles, _resident_programs(source.device, source.dtype, compress, tile))
        programs = triton.cdiv(tiles, per_program)
        stage_indices = torch.empty(programs * options["STAGE"], dtype=torch.int32, device=source.device)
        stage_values = torch.empty(programs * options["STAGE"], dtype=out.values.dtype, device=source.device)
        samples = (triton.cdiv(plan.sample_size, SAMPLE_TILE),)
        _sample_kernel[samples](source, residual if compress else source, workspace, plan.numel, plan.sample_size,
                                plan.sample_stride, HAS_RESIDUAL=compress, TILE=SAMPLE_TILE, num_warps=4)
        _key_bins_kernel[samples](workspace, plan.sample_size, plan.sample_need, TILE=SAMPLE_TILE, num_warps=4)
        _select_kernel[(programs,)](
            source, residual if compress else source, workspace, plan.sample_need, out.header, out.indices,
            out.values, out.scales if compress else out.header, stage_indices, stage_values, plan.numel,
            out.capacity, per_program, **options)


def _select_options(compress: bool, tile: int) -> dict:
    # STAGE: a whole tile always fits after a flush. No fused multiply-add: acc - code * scale
    # must round code * scale first, exactly as the receiver's dequantisation does, or the
    # residual would not be exact.
    return dict(COMPRESS=compress, TILE=tile, STAGE=max(STAGE_ENTRIES, tile), num_warps=max(1, min(16, tile // 256)),
                enable_fp_fusion=False)


@functools.cache
def _resident_programs(device: torch.device, dtype: torch.dtype, compress: bool, tile: int) -> int:
    """Selecting programs that fit on the GPU at once: each keeps its tile in registers, and a
    program that waited for a second wave would finish last by a whole run of tiles."""
    if device.type != "cuda":
        return 4  # under TRITON_INTERPRET=1 there is no GPU to fill
    f32, i32 = torch.empty(16, device=device), torch.empty(16, dtype=torch.int32, device=device)
    source = torch.empty(16, dtype=dtype, device=device)
    values = torch.empty(16, dtype=torch.int8 if compress else dtype, device=device)
    kernel = _select_kernel.warmup(source, f32 if compress else source, i32, 17, i32, i32, values, f32, i32, values,
                                   4096, 17, 17, grid=(1,), **_select_options(compress, tile))
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    threads = kernel.metadata.num_warps * 32
    registers = getattr(props, "regs_per_multiprocessor", 65536)  # 64 Ki on every NVIDIA GPU since sm_50
    by_registers = registers // (-(-kernel.n_regs // 8) * 8 * threads)
    by_threads = props.max_threads_per_multi_processor // threads
    return props.multi_processor_count * max(1, min(by_registers, by_threads))


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    with _on_device(dense_out):
        _decompress_kernel[(triton.cdiv(compressed.capacity, DECOMPRESS_TILE),)](
            compressed.header, compressed.indices, compressed.values, compressed.scales, dense_out,
            compressed.numel, compressed.capacity, BLOCK=compressed.layout.block, TILE=DECOMPRESS_TILE,
            num_warps=4, enable_fp_fusion=False)


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's GPU, not merely the current one. CPU tensors only reach here under
    TRITON_INTERPRET=1, which the interpreter tests use."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
