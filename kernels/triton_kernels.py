"""Triton kernels for selection, compression and decompression; CUDA tensors only.

Imported only when a CUDA tensor arrives (kernels.compression imports it lazily), so machines
without triton can import kernels. Every function matches its twin in kernels/reference.py bit
for bit; the choices that make that so are noted where they are made.

select() is one launch (after the memset that zeroes payload and workspace). Its programs fall
into four phases by program id, each waiting only for phases before it:
  count exponents  gather the sample (runs of 16 contiguous elements of bucket and residual) and
                   histogram the magnitudes' exponents
  count fine bins  histogram the next 12 bits of the sampled magnitudes inside the exponent that
                   holds the threshold (twice as many programs, half the runs each); the last to
                   finish turns the histograms into the threshold
  quantise         the one pass over the bucket, `unit` tiles per program, each tile loaded while
                   the one before is worked on: reads bucket and residual, writes residual (12
                   bytes per fp32 element), compacts each tile's entries (index in the tile,
                   code) into the tile's own slots of a scratch array, and adds the unit's count
                   to its group's word (a group is 2**18 elements)
  place            a program per 32 tiles, its group's placing programs right after the next
                   group's units: once its group is counted, sums the words of the groups before
                   and the counts of its group's tiles before its own, and moves its tiles'
                   entries to the payload in ascending index order (about 6 bytes per entry), so
                   Triton and the twin give the same payload bytes; only the last group's placing
                   is left when the pass over the bucket ends
A program that waits spins on a counter that programs of lower id advance. The GPU starts a
grid's programs in increasing id order (CUB's single-pass scan relies on the same: "blocks are
launched in increasing order"), so those have started and will finish: the wait ends. Triton's
interpreter runs programs one after another in id order, so there every wait is already over;
tests/unit/test_kernels_triton_interpreter.py also runs them all at once, highest id first.
A counter is advanced with release after a barrier, and waited on with acquire (then a barrier),
so what its writers wrote is what the waiter reads; data written by other programs is read
with .cg loads, from L2. Each wait sits where the data is in flight: a quantise program loads
its tile before it waits for the threshold, so the first wave's reads overlap the threshold's
computation. Per call: a memset and one launch, against a memset, five Triton kernels and a
torch.cumsum (two CUB kernels) before.
The quantise pass holds few registers per element, so many programs fit on each
multiprocessor and enough loads are in flight to stream (Tuning says how the pass is cut): an
earlier design that placed entries in the payload from the quantising programs held ~16
registers per element and stalled at ~35 % of copy bandwidth (measured), and one slot-claiming
atomic per tile on a single counter serialised another. Every other phase keeps to no more
registers than the quantise pass (80 at block 1024 compiled for sm_90 by triton 3.6, as the
separate quantise kernel before), so the fusion costs no occupancy. The scratch array costs
memory (4 bytes per element, allocated per call) but almost no traffic: only the ~k entries are
written. Other cuts of the pass were measured and lost (benchmarks/RESULTS.md): four tiles per
program (two win for top-k only), larger top-k tiles, evict-first hints on the streamed lines.

decompress_sum() writes a bucket from several ranks' payloads, a program per SEGMENT (16384
elements): the segment is zeroed in cache, each rank's entries for it are added in rank order
(the payload says where each segment's entries begin, and their offsets count from the
segment's start), the next two ranks' entries loading meanwhile, and the segment reaches DRAM
once. Its speed is set by how many segments are in flight: each program spends most of its life
waiting on its chain of ranks, so it holds few entries (few registers), yet the segments in
flight must stay in L2 between zeroing and the last rank (benchmarks/RESULTS.md has the
measurements that set SUM_TUNING). decompress_accumulate() is the
same kernel over one payload, adding to the bucket instead of zeroing it: one read-modify-write
of a 32-byte sector per entry, since at k = 1 % entries are about 100 elements apart.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.payload import HEADER_BYTES, QUANT_MAX, SEGMENT, CompressedBucket, PayloadLayout
from kernels.reference import power_of_two
from kernels.selection import (
    EXPONENT_BINS,
    EXPONENT_SHIFT,
    FINE_BINS,
    FINE_SHIFT,
    GROUP_ELEMENTS,
    NONFINITE_EXPONENT,
    SAMPLE_CHUNK,
    WORKSPACE_COUNTERS,
    WORKSPACE_FINE_COUNTS,
    WORKSPACE_GROUP_WORDS,
    SelectionPlan,
)

_EXPONENT_SHIFT = tl.constexpr(EXPONENT_SHIFT)
_NONFINITE_EXPONENT = tl.constexpr(NONFINITE_EXPONENT)
_EXPONENT_BINS = tl.constexpr(EXPONENT_BINS)
_FINE_SHIFT = tl.constexpr(FINE_SHIFT)
_FINE_BINS = tl.constexpr(FINE_BINS)
_FINE_COUNTS = tl.constexpr(WORKSPACE_FINE_COUNTS)
_SAMPLED = tl.constexpr(WORKSPACE_COUNTERS)
"""Counter: exponent-counting programs done."""
_FINE_COUNTED = tl.constexpr(WORKSPACE_COUNTERS + 32)
"""Counter: fine-bin-counting programs done; the one that makes it complete computes the threshold."""
_THRESHOLD = tl.constexpr(WORKSPACE_COUNTERS + 64)
"""The threshold's bits + 1 once known (0 before): one word, so a reader needs nothing else. Written
to _COPIES words a 128-byte line apart, each polled by every _COPIES-th quantise program: the
first wave (~1000 programs) spinning on one word would queue at one L2 slice, ahead of the
threshold's own traffic there."""
_COPIES = tl.constexpr(32)
_FINE_PIECES = tl.constexpr(WORKSPACE_COUNTERS + 64 + 32 * 32)
"""The fine counts summed 16 bins at a time (256 pieces), so the threshold needs two loads, not 17."""
_PIECES = tl.constexpr(256)
_GROUP_WORDS = tl.constexpr(WORKSPACE_GROUP_WORDS)
_GROUP_ELEMENTS = tl.constexpr(GROUP_ELEMENTS)
_SAMPLE_CHUNK = tl.constexpr(SAMPLE_CHUNK)
_SEGMENT = tl.constexpr(SEGMENT)
_QUANT_MAX = tl.constexpr(float(QUANT_MAX))
_ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2**23: (x + it) - it rounds x half-to-even for |x| < 2**22, as torch.round does."""

@dataclass(frozen=True, slots=True)
class Tuning:
    """How the selection kernel cuts its one pass over the bucket into programs."""
    tile: int
    """Elements a quantising program selects from at a time (for compress, its scale block instead)."""
    unit: int
    """Tiles per quantising program, each loaded while the one before is worked on."""
    elements_per_thread: int
    """Sets the warps: tile // (32 * elements_per_thread). Measured on an H200 at 400 MB, for the
    quantising pass alone with one tile per program: blocks of 1024 with 16 elements a thread
    (2 warps, ~80 registers, 12 programs per multiprocessor) streamed at 85 % of copy bandwidth;
    32 a thread, 68 %; blocks of 4096 with 8 or 4 warps, 62 % and 51 %; with 16 warps (one
    program per multiprocessor), about a third."""

    row_scan: bool = False
    """Place entries by a scan inside runs of 16 elements and one over the runs' counts."""

    def warps(self, tile: int) -> int:
        return max(1, min(16, tile // (32 * self.elements_per_thread)))


COMPRESS_TUNING = Tuning(tile=0, unit=1, elements_per_thread=16, row_scan=True)
TOPK_TUNING = Tuning(tile=1024, unit=2, elements_per_thread=16)
"""Chosen by `benchmarks/kernels.py --sweep` on an H200 (benchmarks/RESULTS.md): compress one tile
a program with the scan by runs (+1.5 % at 400 MB-1 GB), top-k two tiles a program (+7 %) with
the plain scan (the scan by runs was 4 % slower there)."""
PLACE_ROWS = 32
PLACE_WIDTH = 8
"""A placing program moves the entries of 32 tiles, 8 per tile at a time."""
_WORDS = tl.constexpr(256)
"""Group words a placing program reads at a time while it sums the groups before its own."""


@dataclass(frozen=True, slots=True)
class SumTuning:
    chunk: int
    """Entries of a rank loaded at once: at k = 1 % a segment holds about 164 per rank; more are
    added from a loop."""
    warps: int
    """Sets the programs in flight: at 16 warps (40 registers a thread) 3 fit on a multiprocessor,
    ~400 segments (26 MB) in flight, which L2 holds; at 8 warps 8 fit, and their segments spill
    to DRAM before their last rank is added (2x slower for 8 ranks, measured on an H200)."""


SUM_TUNING = SumTuning(chunk=256, warps=16)
SUM_PIECE = 2048


@triton.jit
def _wait_until(counter_ptr, target):
    """Spin until the counter reaches target, then every thread of the program may read what was
    written before it was advanced. An atomic add of 0 whose result is used compiles to an
    acquire load (ld.acquire.gpu), not a read-modify-write; unused, it would be dropped."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _signal(counter_ptr):
    """Count this program as done, after every one of its threads' writes; returns the count before."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel")


@triton.jit
def _bin_from_top(counts, need):
    # The twin's _bin_from_top over a tensor of counts, in integers so both agree exactly.
    bins = tl.arange(0, counts.shape[0])
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    b = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    here = bins == b
    count = tl.sum(tl.where(here, counts, 0), 0)
    return b, need - (tl.sum(tl.where(here, at_or_above, 0), 0) - count), count


@triton.jit
def _exponent_from_top(workspace_ptr, need):
    return _bin_from_top(tl.load(workspace_ptr + tl.arange(0, _EXPONENT_BINS), cache_modifier=".cg"), need)


@triton.jit
def _threshold_bits(workspace_ptr, need):
    # The twin's threshold_bits: the binade, then the piece of 16 fine bins, then the bin.
    exponent, need, _ = _exponent_from_top(workspace_ptr, need)
    piece, need, _ = _bin_from_top(tl.load(workspace_ptr + _FINE_PIECES + tl.arange(0, _PIECES), cache_modifier=".cg"),
                                   need)
    piece = tl.maximum(piece, 0)
    width: tl.constexpr = _FINE_BINS // _PIECES
    fine, _, _ = _bin_from_top(tl.load(workspace_ptr + _FINE_COUNTS + piece * width + tl.arange(0, width),
                                       cache_modifier=".cg"), need)
    bits = (exponent << _EXPONENT_SHIFT) | ((piece * width + fine) << _FINE_SHIFT)
    return tl.where(exponent >= 0, bits, 0)


@triton.jit
def _sample_bits(source_ptr, residual_ptr, program, numel, sample_chunks, chunk_slots, HAS_RESIDUAL: tl.constexpr,
                 CHUNKS: tl.constexpr):
    """Magnitude bits of this program's CHUNKS sampled runs, flat; those past the sample read as
    infinite, which no histogram counts."""
    chunk = program * CHUNKS + tl.arange(0, CHUNKS)
    start = (chunk.to(tl.int64) * chunk_slots // sample_chunks).to(tl.int32) * _SAMPLE_CHUNK
    position = start[:, None] + tl.arange(0, _SAMPLE_CHUNK)[None, :]
    valid = (chunk < sample_chunks)[:, None] & (position < numel)
    acc = tl.load(source_ptr + position, mask=valid, other=float("inf")).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + position, mask=valid, other=0.0)
    return tl.reshape(acc.to(tl.int32, bitcast=True) & 0x7FFFFFFF, [CHUNKS * _SAMPLE_CHUNK])


@triton.jit
def _count_exponents(source_ptr, residual_ptr, workspace_ptr, program, numel, sample_chunks, chunk_slots,
                     HAS_RESIDUAL: tl.constexpr, CHUNKS: tl.constexpr):
    bits = _sample_bits(source_ptr, residual_ptr, program, numel, sample_chunks, chunk_slots, HAS_RESIDUAL, CHUNKS)
    exponent = bits >> _EXPONENT_SHIFT
    # Histogram per program first: most samples share a few exponents, and an atomic per
    # sample on those few counters would queue.
    counts = tl.histogram(exponent, _EXPONENT_BINS, mask=exponent < _NONFINITE_EXPONENT)
    tl.atomic_add(workspace_ptr + tl.arange(0, _EXPONENT_BINS), counts, mask=counts > 0, sem="relaxed")
    _signal(workspace_ptr + _SAMPLED)


@triton.jit
def _count_fine_bins(source_ptr, residual_ptr, workspace_ptr, header_ptr, program, numel, sample_chunks, chunk_slots,
                     sample_need, sample_programs, HAS_RESIDUAL: tl.constexpr, CHUNKS: tl.constexpr):
    # The same runs again (from L2 now), loaded before the wait for every exponent to be counted.
    # Twice as many programs as count exponents, each with half the runs: two atomics per sample
    # hold a 64-bit address per element each, and at full size this phase would need more
    # registers than the quantise pass.
    bits = _sample_bits(source_ptr, residual_ptr, program, numel, sample_chunks, chunk_slots, HAS_RESIDUAL,
                        CHUNKS // 2)
    _wait_until(workspace_ptr + _SAMPLED, sample_programs)
    exponent, _, _ = _exponent_from_top(workspace_ptr, sample_need)
    here = (bits >> _EXPONENT_SHIFT) == exponent  # never the infinite exponent: it is counted in no bin
    # An atomic per sample in the threshold's binade: they spread over 4096 counters, and a
    # per-program histogram that wide would need far more registers than the other phases.
    fine = (bits >> _FINE_SHIFT) & (_FINE_BINS - 1)
    tl.atomic_add(workspace_ptr + _FINE_COUNTS + fine, 1, mask=here, sem="relaxed")
    # The pieces are 16 times wider, and the few at the binade's low edge hold most samples: an
    # atomic per sample queued thousands deep on one counter (25 MB compress 50.3 -> 45.7 us with
    # a histogram per program first, benchmarks/RESULTS.md).
    pieces = tl.histogram(fine // (_FINE_BINS // _PIECES), _PIECES, mask=here)
    tl.atomic_add(workspace_ptr + _FINE_PIECES + tl.arange(0, _PIECES), pieces, mask=pieces > 0, sem="relaxed")
    if _signal(workspace_ptr + _FINE_COUNTED) == 2 * sample_programs - 1:
        threshold = _threshold_bits(workspace_ptr, sample_need)
        tl.store(header_ptr + 2, threshold)
        tl.store(workspace_ptr + _THRESHOLD + 32 * tl.arange(0, _COPIES), threshold + 1 + tl.zeros([_COPIES], tl.int32))


@triton.jit
def _load_tile(source_ptr, residual_ptr, tile, numel, COMPRESS: tl.constexpr, TILE: tl.constexpr):
    offsets = tile * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    acc = tl.load(source_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if COMPRESS:
        acc += tl.load(residual_ptr + offsets, mask=inside, other=0.0)
    return acc


@triton.jit
def _quantise_tile(acc, threshold, residual_ptr, header_ptr, scales_ptr, scratch_ptr, tile, numel, tiles,
                   COMPRESS: tl.constexpr, TILE: tl.constexpr, ROW_SCAN: tl.constexpr):
    """Selects and quantises one tile already loaded as acc; returns how many entries it keeps.
    A tile past the bucket (the last unit's spare) has acc all zero and keeps none."""
    offsets = tile * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    magnitude = tl.abs(acc)
    if COMPRESS:
        # NaN and inf are the magnitudes not below inf. Counted and reduced here, not with the
        # entries at the end: a flag held across the tile's work costs registers, hence occupancy.
        nonfinite = tl.sum((~(magnitude < float("inf"))).to(tl.int32), 0)
        if nonfinite > 0:
            tl.atomic_add(header_ptr + 1, nonfinite, sem="relaxed")
        chosen = magnitude >= threshold
        scale = tl.div_rn(tl.max(tl.where(chosen, magnitude, 0.0), 0), _QUANT_MAX)
        tl.store(scales_ptr + tile, scale, mask=tile < tiles)
        # One correctly rounded reciprocal per tile, then a multiply per element instead of a
        # division (fewer instructions: the pass is bound by its integer and logic pipe as much
        # as by memory), and half-even rounding, as the twin does. The code is within
        # 0.5 + 2**-16 of acc / scale, and acc - code * scale is exact (Sterbenz) when
        # |acc| >= |code * scale| / 2: true for |code| >= 2, and for a code of ±1 too, since the
        # rounded product exceeds 0.5 (a tie at 0.5 rounds to 0) only if
        # |acc| * (1/scale) (1 + 2**-24) > 0.5 (1 + 2**-24). That exactness is what makes the
        # residual update lossless.
        ratio = acc * tl.div_rn(1.0, tl.where(scale > 0.0, scale, 1.0))
        codes = tl.minimum(tl.maximum((ratio + _ROUND_MAGIC) - _ROUND_MAGIC, -_QUANT_MAX), _QUANT_MAX)
        codes = tl.where(scale > 0.0, tl.where(chosen, codes, 0.0), 0.0)
        chosen = codes != 0.0
        tl.store(residual_ptr + offsets, acc - codes * scale, mask=inside)
        entry = (tl.arange(0, TILE) | ((codes.to(tl.int32) & 0xFF) << 16))
    else:
        # Top-k selects NaN and inf too (never below the threshold) and counts them where it
        # places entries, among ~k values instead of every element: the pass is bound by its
        # instructions per element, not by memory.
        chosen = ~(magnitude < threshold)
        entry = tl.arange(0, TILE)
    # The tile's entries, compacted to the front of its own TILE slots: no other tile's count
    # is needed to place them, so no atomics and no second pass over the bucket.
    if ROW_SCAN:
        # Positions from a scan inside runs of 16 and a scan of the runs' counts.
        RUNS: tl.constexpr = TILE // 16
        kept = tl.reshape(chosen.to(tl.int32), [RUNS, 16])
        per_run = tl.sum(kept, 1)
        slot = (tl.cumsum(per_run, 0) - per_run)[:, None] + tl.cumsum(kept, 1) - 1
        count = tl.sum(per_run, 0)
        tl.store(scratch_ptr + tile * TILE + slot, tl.reshape(entry, [RUNS, 16]), mask=kept != 0)
    else:
        count = tl.sum(chosen.to(tl.int32), 0)
        tl.store(scratch_ptr + tile * TILE + tl.cumsum(chosen.to(tl.int32), 0) - 1, entry, mask=chosen)
    tl.store(scratch_ptr + tiles * TILE + tile, count, mask=tile < tiles)
    return count


@triton.jit
def _quantise_unit(source_ptr, residual_ptr, workspace_ptr, header_ptr, scales_ptr, scratch_ptr, first_tile, numel,
                   tiles, COMPRESS: tl.constexpr, TILE: tl.constexpr, UNIT: tl.constexpr, ROW_SCAN: tl.constexpr):
    """Quantises UNIT consecutive tiles, each loaded while the one before is worked on, and counts
    them into their group's word with one atomic: fewer programs, each with loads in flight for
    more of its life, and one release per UNIT tiles."""
    acc = _load_tile(source_ptr, residual_ptr, first_tile, numel, COMPRESS, TILE)
    copy = workspace_ptr + _THRESHOLD + 32 * (first_tile // UNIT % _COPIES)
    published = tl.load(copy, volatile=True)
    while published == 0:
        published = tl.load(copy, volatile=True)
    # At least the smallest subnormal, so `>= threshold` alone also says "> 0" when too few
    # magnitudes were seen for a threshold (bits 0): one compare less per element.
    threshold = tl.maximum(published - 1, 1).to(tl.float32, bitcast=True)
    total = 0
    for step in tl.static_range(UNIT):
        if step + 1 < UNIT:
            following = _load_tile(source_ptr, residual_ptr, first_tile + step + 1, numel, COMPRESS, TILE)
        total += _quantise_tile(acc, threshold, residual_ptr, header_ptr, scales_ptr, scratch_ptr, first_tile + step,
                                numel, tiles, COMPRESS, TILE, ROW_SCAN)
        if step + 1 < UNIT:
            acc = following
    tl.debug_barrier()
    # One word per group: entries in the low half, tiles done in the high half, so a placing
    # program reads both at once. Fire-and-forget, and spread over a word per 2**18 elements.
    word_ptr = (workspace_ptr + _GROUP_WORDS).to(tl.pointer_type(tl.int64)) + first_tile * TILE // _GROUP_ELEMENTS
    done = tl.minimum(tiles - first_tile, UNIT)
    tl.atomic_add(word_ptr, total.to(tl.int64) + (done.to(tl.int64) << 32), sem="release")


@triton.jit
def _entries_before(workspace_ptr, scratch_ptr, first_tile, tiles, TILE: tl.constexpr):
    """Entries of every tile before first_tile, once every group up to first_tile's is counted."""
    TILES_PER_GROUP: tl.constexpr = _GROUP_ELEMENTS // TILE
    group = first_tile // TILES_PER_GROUP
    words_ptr = (workspace_ptr + _GROUP_WORDS).to(tl.pointer_type(tl.int64))
    # Its own group's tiles wrote what this program reads: wait for all of them with acquire.
    _wait_until(words_ptr + group, tl.minimum(tiles - group * TILES_PER_GROUP, TILES_PER_GROUP).to(tl.int64) << 32)
    # Of the groups before, only the words themselves are read.
    total = 0
    for first in range(0, group, _WORDS):
        g = first + tl.arange(0, _WORDS)
        live = g < group
        expected = tl.minimum(tiles - g * TILES_PER_GROUP, TILES_PER_GROUP)
        words = tl.load(words_ptr + g, mask=live, other=0, volatile=True)
        while tl.sum((live & ((words >> 32) != expected)).to(tl.int32), 0) > 0:
            words = tl.load(words_ptr + g, mask=live, other=0, volatile=True)
        total += tl.sum(tl.where(live, words.to(tl.int32), 0), 0)
    # Then the tiles of its own group before first_tile.
    for first in range(group * TILES_PER_GROUP, first_tile, _WORDS):
        row = first + tl.arange(0, _WORDS)
        total += tl.sum(tl.load(scratch_ptr + tiles * TILE + row, mask=row < first_tile, other=0,
                                cache_modifier=".cg"), 0)
    return total


@triton.jit
def _place_tiles(source_ptr, residual_ptr, workspace_ptr, header_ptr, scales_ptr, starts_ptr, indices_ptr,
                 values_ptr, scratch_ptr, first_tile, tiles, capacity, COMPRESS: tl.constexpr, TILE: tl.constexpr,
                 ROWS: tl.constexpr, WIDTH: tl.constexpr):
    placed = _entries_before(workspace_ptr, scratch_ptr, first_tile, tiles, TILE)  # waits: read the counts after
    row = first_tile + tl.arange(0, ROWS)
    row_inside = row < tiles
    count = tl.load(scratch_ptr + tiles * TILE + row, mask=row_inside, other=0, cache_modifier=".cg")
    first = placed + tl.cumsum(count, 0) - count
    if COMPRESS:
        # Where each segment's entries begin, for decompress_sum: segments are whole tiles.
        starts_here = row_inside & ((row * TILE) % _SEGMENT == 0)
        tl.store(starts_ptr + row * TILE // _SEGMENT, tl.minimum(first, capacity), mask=starts_here)
    for start in range(0, tl.max(count, 0), WIDTH):
        j = start + tl.arange(0, WIDTH)
        live = j[None, :] < count[:, None]
        entry = tl.load(scratch_ptr + row[:, None] * TILE + j[None, :], mask=live, other=0, cache_modifier=".cg")
        index = row[:, None] * TILE + (entry & 0xFFFF)
        slot = first[:, None] + j[None, :]
        fits = live & (slot < capacity)
        if COMPRESS:
            tl.store(indices_ptr + slot, (index & (_SEGMENT - 1)).to(tl.int16), mask=fits)  # offset in its segment
            code = (entry << 8) >> 24  # the signed byte packed at bits 16..23
            tl.store(values_ptr + slot, code.to(tl.int8), mask=fits)
            # Past capacity: give the value back to the residual, which holds acc - code * scale;
            # adding code * scale back restores acc exactly.
            lost = live & (slot >= capacity)
            scale = tl.load(scales_ptr + row, mask=row_inside, other=0.0, cache_modifier=".cg")
            kept = tl.load(residual_ptr + index, mask=lost, other=0.0, cache_modifier=".cg")
            tl.store(residual_ptr + index, kept + code.to(tl.float32) * scale[:, None], mask=lost)
        else:
            tl.store(indices_ptr + slot, index, mask=fits)
            value = tl.load(source_ptr + index, mask=live, other=0.0)
            tl.store(values_ptr + slot, value, mask=fits)
            # Every NaN and inf was selected, so counting them among the selected, past capacity
            # too, counts them all.
            nonfinite = tl.sum(tl.sum((live & ~(tl.abs(value.to(tl.float32)) < float("inf"))).to(tl.int32), 1), 0)
            if nonfinite > 0:
                tl.atomic_add(header_ptr + 1, nonfinite, sem="relaxed")
    if first_tile + ROWS >= tiles:
        tl.store(header_ptr, tl.sum(tl.where(row == tiles - 1, first + count, 0), 0))


@triton.jit
def _unit_or_rows(program, tiles, TILES_PER_GROUP: tl.constexpr, UNIT: tl.constexpr, ROWS: tl.constexpr):
    """(whether to place, first tile to quantise or to place) for the program-th program after the
    sample's. A quantising program takes UNIT tiles, a placing one ROWS tiles' entries. Each
    group's units are followed by the placing programs of the group before, so a group is placed
    while the next streams and only the last group's placing is left at the end:
        [units of group 0] [units of 1 | place 0] ... [units of G-1 | place G-2] [place G-1]"""
    UNITS: tl.constexpr = TILES_PER_GROUP // UNIT
    PLACES: tl.constexpr = TILES_PER_GROUP // ROWS
    BLOCK: tl.constexpr = UNITS + PLACES
    groups = tl.cdiv(tiles, TILES_PER_GROUP)
    last_units = tl.cdiv(tiles - (groups - 1) * TILES_PER_GROUP, UNIT)
    last_block = tl.where(groups > 1, UNITS + (groups - 2) * BLOCK, 0)
    if program < last_block:
        rest = program - UNITS
        group = 1 + rest // BLOCK
        offset = rest % BLOCK
        place = (program >= UNITS) & (offset >= UNITS)
        tile = tl.where(program < UNITS, program * UNIT, group * TILES_PER_GROUP + offset * UNIT)
        index = tl.where(place, (group - 1) * TILES_PER_GROUP + (offset - UNITS) * ROWS, tile)
    else:
        # The last group's units, the places of the group before it (if any), then its own.
        offset = program - last_block
        place = offset >= last_units
        rows = offset - last_units
        before = tl.where(groups > 1, PLACES, 0)
        first_row = tl.where(rows < before, (groups - 2) * TILES_PER_GROUP + rows * ROWS,
                             (groups - 1) * TILES_PER_GROUP + (rows - before) * ROWS)
        index = tl.where(place, first_row, (groups - 1) * TILES_PER_GROUP + offset * UNIT)
    return place, index


def selection_programs(tiles: int, unit: int, tiles_per_group: int) -> int:
    """Quantising and placing programs for `tiles` tiles, as _unit_or_rows lays them out."""
    groups = triton.cdiv(tiles, tiles_per_group)
    last_tiles = tiles - (groups - 1) * tiles_per_group
    return (groups - 1) * (tiles_per_group // unit) + triton.cdiv(last_tiles, unit) + triton.cdiv(tiles, PLACE_ROWS)


# Counts that vary from bucket to bucket are not specialised on (Triton would compile a variant for
# each pattern of which are multiples of 16), so a hook's buckets share a few compiled kernels.
@triton.jit(do_not_specialize=["capacity", "tiles", "sample_chunks", "chunk_slots", "sample_need", "sample_programs"])
def _select_kernel(source_ptr, residual_ptr, workspace_ptr, header_ptr, scales_ptr, starts_ptr, indices_ptr,
                   values_ptr, scratch_ptr, numel, capacity, tiles, sample_chunks, chunk_slots, sample_need,
                   sample_programs, COMPRESS: tl.constexpr, TILE: tl.constexpr, UNIT: tl.constexpr,
                   ROWS: tl.constexpr, WIDTH: tl.constexpr, ROW_SCAN: tl.constexpr):
    # Phases by program id: [exponents | fine bins, twice as many | quantise UNIT tiles each,
    # interleaved group by group with place ROWS tiles each].
    program = tl.program_id(0)
    runs: tl.constexpr = TILE // _SAMPLE_CHUNK  # sample runs per program: a tile's worth of elements
    if program < sample_programs:
        _count_exponents(source_ptr, residual_ptr, workspace_ptr, program, numel, sample_chunks, chunk_slots,
                         COMPRESS, runs)
    elif program < 3 * sample_programs:
        _count_fine_bins(source_ptr, residual_ptr, workspace_ptr, header_ptr, program - sample_programs, numel,
                         sample_chunks, chunk_slots, sample_need, sample_programs, COMPRESS, runs)
    else:
        place, index = _unit_or_rows(program - 3 * sample_programs, tiles, _GROUP_ELEMENTS // TILE, UNIT, ROWS)
        if place:
            _place_tiles(source_ptr, residual_ptr, workspace_ptr, header_ptr, scales_ptr, starts_ptr, indices_ptr,
                         values_ptr, scratch_ptr, index, tiles, capacity, COMPRESS, TILE, ROWS, WIDTH)
        else:
            _quantise_unit(source_ptr, residual_ptr, workspace_ptr, header_ptr, scales_ptr, scratch_ptr, index, numel,
                           tiles, COMPRESS, TILE, UNIT, ROW_SCAN)


def select(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan, out: CompressedBucket,
           workspace: torch.Tensor) -> None:
    compress = residual is not None
    tuning = COMPRESS_TUNING if compress else TOPK_TUNING
    tile = out.layout.block if compress else tuning.tile
    tiles = triton.cdiv(plan.numel, tile)
    sample_programs = triton.cdiv(plan.sample_chunks, tile // SAMPLE_CHUNK)
    # Scratch: a slot per element for the entries each tile compacts into its own slots (only
    # about k of them are written), then a count per tile.
    scratch = torch.empty(tiles * (tile + 1), dtype=torch.int32, device=source.device)
    residual_or_source = residual if compress else source
    scales, starts = (out.scales, out.segment_starts) if compress else (scratch, scratch)
    programs = 3 * sample_programs + selection_programs(tiles, tuning.unit, GROUP_ELEMENTS // tile)
    with _on_device(source):
        # No fused multiply-add: acc - code * scale must round code * scale first, exactly as
        # the receiver's dequantisation does, or the residual would not be exact.
        _select_kernel[(programs,)](
            source, residual_or_source, workspace, out.header, scales, starts, out.indices, out.values, scratch,
            plan.numel, out.capacity, tiles, plan.sample_chunks, plan.chunk_slots, plan.sample_need,
            sample_programs, COMPRESS=compress, TILE=tile, UNIT=tuning.unit, ROWS=PLACE_ROWS, WIDTH=PLACE_WIDTH,
            ROW_SCAN=tuning.row_scan, num_warps=tuning.warps(tile), enable_fp_fusion=False)


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    # decompress_sum of one row that adds to what dense_out holds: times 1.0 is exact, so each
    # element gets the twin's one addition.
    _decompress(dense_out, compressed.payload.view(1, -1), compressed.layout, 1.0, accumulate=True)


@triton.jit
def _segment_bounds(payloads_ptr, row_bytes, rank, ranks, segment, segments, capacity, starts_offset):
    """first << 32 | last: the entries of rank's payload row that fall in the segment, as one
    int64 (see the kernel for why); 0 for a rank past the last, and never past the entries sent
    or the capacity."""
    live = rank < ranks
    row = payloads_ptr + row_bytes.to(tl.int64) * rank
    sent = tl.load(row.to(tl.pointer_type(tl.int32)), mask=live, other=0)
    sent = tl.maximum(tl.minimum(sent, capacity), 0)
    starts = (row + starts_offset).to(tl.pointer_type(tl.int32)) + segment
    first = tl.load(starts, mask=live, other=0)
    # A segment ends where the next begins; the last one where the entries sent end.
    not_last = segment + 1 < segments
    last = tl.where(not_last, tl.load(starts + 1, mask=live & not_last, other=0), sent)
    first = tl.minimum(tl.maximum(first, 0), sent)
    last = tl.minimum(tl.maximum(last, first), sent)
    return (first.to(tl.int64) << 32) | last.to(tl.int64)


@triton.jit
def _load_rank(payloads_ptr, row_bytes, rank, bounds, segment, numel, values_offset, scales_offset,
               INDICES_OFFSET: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """(offsets, codes) of rank's first CHUNK entries in the segment, and the scales of the
    segment's blocks (none loaded where it sent nothing)."""
    first = (bounds >> 32).to(tl.int32)
    last = (bounds & 0xFFFFFFFF).to(tl.int32)
    offsets, codes = _load_entries(payloads_ptr, row_bytes, rank, first, last, values_offset, INDICES_OFFSET, CHUNK)
    blocks: tl.constexpr = _SEGMENT // BLOCK
    block = segment * blocks + tl.arange(0, blocks)
    row = payloads_ptr + row_bytes.to(tl.int64) * rank
    scales = tl.load((row + scales_offset).to(tl.pointer_type(tl.float32)) + block,
                     mask=(block * BLOCK < numel) & (first < last), other=0.0)
    return offsets, codes, scales


@triton.jit
def _load_entries(payloads_ptr, row_bytes, rank, first, last, values_offset, INDICES_OFFSET: tl.constexpr,
                  CHUNK: tl.constexpr):
    """(offsets, codes) of rank's entries first.. (at most CHUNK, before last); a missing entry
    reads as offset -1, which no segment holds."""
    row = payloads_ptr + row_bytes.to(tl.int64) * rank
    entry = first + tl.arange(0, CHUNK)
    live = entry < last
    offsets = tl.load((row + INDICES_OFFSET).to(tl.pointer_type(tl.int16)) + entry, mask=live, other=-1)
    codes = tl.load((row + values_offset).to(tl.pointer_type(tl.int8)) + entry, mask=live, other=0)
    return offsets, codes


@triton.jit
def _add_decoded(out_ptr, offsets, codes, scales, low, high, inverse, BLOCK: tl.constexpr, SCALE_FIRST: tl.constexpr):
    """out[low + offset] += code * scale (* inverse) for every valid entry; an offset outside the
    segment (missing, or a corrupted payload) adds nothing."""
    offset = offsets.to(tl.int32)
    index = low + offset
    live = (offset >= 0) & (index < high)
    value = codes.to(tl.float32) * tl.gather(scales, tl.where(live, offset // BLOCK, 0), 0)
    if SCALE_FIRST:
        value = value * inverse
    current = tl.load(out_ptr + index, mask=live, other=0.0)
    tl.store(out_ptr + index, current + value, mask=live)


# The payload's array offsets follow its capacity, which changes with k (every step of a top-k
# sparsity ramp): as constexprs each new capacity compiled a new kernel, 250-360 ms on an H200.
@triton.jit(do_not_specialize=["ranks", "segments", "capacity"])
def _decompress_sum_kernel(payloads_ptr, row_bytes, out_ptr, numel, ranks, segments, capacity, divisor, inverse,
                           values_offset, scales_offset, starts_offset, INDICES_OFFSET: tl.constexpr,
                           BLOCK: tl.constexpr, SCALE_FIRST: tl.constexpr, ACCUMULATE: tl.constexpr,
                           CHUNK: tl.constexpr, PIECE: tl.constexpr):
    # One program per segment. The segment is zeroed (unless accumulating), each rank's entries in
    # it are added in rank order (read-modify-write of lines this program just wrote, so the
    # scattered accesses hit cache, not DRAM) and, unless the values were scaled first, the sum is
    # divided; DRAM sees the payload entries read and the bucket written once.
    # Ranks go through a pipeline two deep: while rank r's entries are added, the entries and
    # scales of ranks r + 1 and r + 2 and the bounds of rank r + 3 are loading, so adding a rank
    # waits for a round trip to cache, not for memory. Few entries are held at a time, so
    # SumTuning.warps, not registers, sets how many segments are in flight.
    segment = tl.program_id(0)
    low = segment * _SEGMENT
    high = tl.minimum(low + _SEGMENT, numel)
    # Each rank's bounds travel as one int64 (first << 32 | last): carried through the loop as six
    # int32s, two of them lost their updates in Triton 3.6's TTGIR passes (the loop kept their
    # first values; the interpreter, which skips those passes, did not show it).
    bounds = _segment_bounds(payloads_ptr, row_bytes, 0, ranks, segment, segments, capacity, starts_offset)
    bounds_next = _segment_bounds(payloads_ptr, row_bytes, 1, ranks, segment, segments, capacity, starts_offset)
    bounds_after = _segment_bounds(payloads_ptr, row_bytes, 2, ranks, segment, segments, capacity, starts_offset)
    offsets, codes, scales = _load_rank(payloads_ptr, row_bytes, 0, bounds, segment, numel, values_offset,
                                        scales_offset, INDICES_OFFSET, BLOCK, CHUNK)
    offsets_next, codes_next, scales_next = _load_rank(payloads_ptr, row_bytes, 1, bounds_next, segment, numel,
                                                       values_offset, scales_offset, INDICES_OFFSET, BLOCK, CHUNK)
    if not ACCUMULATE:
        for piece in range(low, high, PIECE):
            zeroed = piece + tl.arange(0, PIECE)
            tl.store(out_ptr + zeroed, tl.zeros([PIECE], dtype=tl.float32), mask=zeroed < high)
        tl.debug_barrier()  # the zeros are in place
    for rank in range(ranks):
        bounds_later = _segment_bounds(payloads_ptr, row_bytes, rank + 3, ranks, segment, segments, capacity,
                                       starts_offset)
        offsets_after, codes_after, scales_after = _load_rank(payloads_ptr, row_bytes, rank + 2, bounds_after, segment,
                                                              numel, values_offset, scales_offset, INDICES_OFFSET,
                                                              BLOCK, CHUNK)
        _add_decoded(out_ptr, offsets, codes, scales, low, high, inverse, BLOCK, SCALE_FIRST)
        # Entries past the first CHUNK, where this rank's segment is denser than CHUNK / SEGMENT
        # (rare at k = 1 %): a rank's entries are distinct elements, so they need no ordering.
        last = (bounds & 0xFFFFFFFF).to(tl.int32)
        for start in range((bounds >> 32).to(tl.int32) + CHUNK, last, CHUNK):
            more_offsets, more_codes = _load_entries(payloads_ptr, row_bytes, rank, start, last, values_offset,
                                                     INDICES_OFFSET, CHUNK)
            _add_decoded(out_ptr, more_offsets, more_codes, scales, low, high, inverse, BLOCK, SCALE_FIRST)
        tl.debug_barrier()  # orders ranks that share an element
        bounds, bounds_next, bounds_after = bounds_next, bounds_after, bounds_later
        offsets, codes, scales = offsets_next, codes_next, scales_next
        offsets_next, codes_next, scales_next = offsets_after, codes_after, scales_after
    if not SCALE_FIRST:
        for piece in range(low, high, PIECE):
            offsets_divided = piece + tl.arange(0, PIECE)
            inside = offsets_divided < high
            total = tl.load(out_ptr + offsets_divided, mask=inside, other=0.0)
            tl.store(out_ptr + offsets_divided, tl.div_rn(total, divisor), mask=inside)


def decompress_sum(dense_out: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, divisor: float) -> None:
    _decompress(dense_out, payloads, layout, divisor, accumulate=False)


def _decompress(dense_out: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, divisor: float, *,
                accumulate: bool) -> None:
    segments = layout.num_segments
    with _on_device(dense_out):
        _decompress_sum_kernel[(segments,)](
            payloads, payloads.shape[1], dense_out, layout.numel, payloads.shape[0], segments, layout.capacity,
            float(divisor), 1.0 / divisor, layout.values_offset, layout.scales_offset, layout.starts_offset,
            INDICES_OFFSET=HEADER_BYTES, BLOCK=layout.block,
            SCALE_FIRST=power_of_two(divisor), ACCUMULATE=accumulate, CHUNK=SUM_TUNING.chunk, PIECE=SUM_PIECE,
            num_warps=SUM_TUNING.warps, enable_fp_fusion=False)


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's GPU, not merely the current one. CPU tensors only reach here under
    TRITON_INTERPRET=1, which the interpreter tests use."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
