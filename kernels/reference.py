"""Plain-torch twins of the Triton kernels: the CPU implementation and the reference in tests.

Each public function has the signature and the bit-exact results of its namesake in
kernels/triton_kernels.py, down to the payload's bytes. The arithmetic is chosen so both agree
to the bit: integer histogram maths for the threshold, correctly rounded division,
round-half-even, and no fused multiply-add.
"""

from __future__ import annotations

import math

import torch

from kernels.payload import QUANT_MAX, SEGMENT, CompressedBucket, PayloadLayout
from kernels.selection import (
    EXPONENT_BINS,
    EXPONENT_SHIFT,
    FINE_BINS,
    FINE_SHIFT,
    NONFINITE_EXPONENT,
    SAMPLE_CHUNK,
    WORKSPACE_COUNTERS,
    WORKSPACE_FINE_COUNTS,
    SelectionPlan,
)

NONFINITE_BITS = NONFINITE_EXPONENT << EXPONENT_SHIFT


def magnitude_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 bits of |x| as int32: ordered like the magnitudes, with inf and NaN above every finite value."""
    return x.view(torch.int32) & 0x7FFFFFFF


def histograms(workspace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts per exponent, counts per fine bin inside the threshold's exponent) in `workspace`."""
    return workspace[:WORKSPACE_FINE_COUNTS], workspace[WORKSPACE_FINE_COUNTS:WORKSPACE_COUNTERS]


def sample_positions(plan: SelectionPlan, device: torch.device) -> torch.Tensor:
    """Element indices of the sample, run by run (see SelectionPlan.sample_chunks)."""
    chunk = torch.arange(plan.sample_chunks, dtype=torch.int64, device=device)
    start = chunk * plan.chunk_slots // plan.sample_chunks * SAMPLE_CHUNK
    positions = (start[:, None] + torch.arange(SAMPLE_CHUNK, device=device)).view(-1)
    return positions[positions < plan.numel]


def _estimate_threshold(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan,
                        header: torch.Tensor, workspace: torch.Tensor) -> None:
    """Sample source (+ residual), histogram the sample into `workspace` (zeroed) and write the
    threshold's fp32 bits to header[2]."""
    exponents, fine = histograms(workspace)
    positions = sample_positions(plan, source.device)
    sample = source[positions].float()
    if residual is not None:
        sample = sample + residual[positions]
    bits = magnitude_bits(sample).long()
    exponent = bits >> EXPONENT_SHIFT
    exponents += torch.bincount(exponent[exponent < NONFINITE_EXPONENT], minlength=EXPONENT_BINS).to(torch.int32)
    top, _, _ = _bin_from_top(exponents.tolist(), plan.sample_need)
    fine += torch.bincount((bits[exponent == top] >> FINE_SHIFT) & (FINE_BINS - 1), minlength=FINE_BINS).to(torch.int32)
    header[2] = threshold_bits(workspace, plan.sample_need)


def threshold_bits(workspace: torch.Tensor, need: int) -> int:
    """fp32 bits of a threshold that `need` of the histogrammed magnitudes reach: the lower edge
    of the fine bin holding the need-th largest, so tied values are kept together; 0 when fewer
    than `need` finite magnitudes were seen.

    The exponent histogram finds the binade, the fine histogram inside it the bin.
    """
    exponents, fine = histograms(workspace)
    top, need, _ = _bin_from_top(exponents.tolist(), need)
    if top < 0:
        return 0
    fine_bin, _, _ = _bin_from_top(fine.tolist(), need)
    return (top << EXPONENT_SHIFT) | (fine_bin << FINE_SHIFT)


def _bin_from_top(counts: list[int], need: int) -> tuple[int, int, int]:
    """(highest bin whose count with all above it reaches need, how many of need it must supply,
    its count); bin -1 and count 0 when all bins together fall short."""
    above = 0
    for b in range(len(counts) - 1, -1, -1):
        if above + counts[b] >= need:
            return b, need - above, counts[b]
        above += counts[b]
    return -1, need, 0


def select(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan, out: CompressedBucket,
           workspace: torch.Tensor) -> None:
    """Estimate the threshold, then keep elements of source (+ residual) at or above it into `out`
    (zeroed); with a residual, leave in it exactly what was not sent."""
    _estimate_threshold(source, residual, plan, out.header, workspace)
    acc = source.float() if residual is None else source.float() + residual
    out.header[1] = int((magnitude_bits(acc) >= NONFINITE_BITS).sum())
    magnitude = acc.abs()
    if out.layout.block is None:  # top-k keeps NaN and inf too, as the kernel does (the count raises)
        chosen = ~(magnitude < out.threshold) & (magnitude != 0)
        stored, sent_values = source, acc
    else:
        chosen = (magnitude >= out.threshold) & (magnitude > 0)
        codes, scale_per_element = _quantise(acc, torch.where(chosen, magnitude, 0.0), out)
        chosen &= codes != 0
        stored, sent_values = codes, codes * scale_per_element
    index = chosen.nonzero().squeeze(1)
    out.header[0] = index.numel()
    sent = index[:out.capacity]
    # A quantised entry carries its offset inside its segment; the segment starts give the base.
    out.indices[:sent.numel()] = (sent.to(torch.int32) if out.layout.block is None
                                  else (sent % SEGMENT).to(torch.int16))
    out.values[:sent.numel()] = stored[sent].to(out.layout.value_dtype)
    boundaries = torch.arange(out.layout.num_segments, device=index.device) * SEGMENT
    out.segment_starts.copy_(torch.searchsorted(index, boundaries).clamp_(max=out.capacity))
    if residual is not None:
        residual.copy_(acc)
        residual[sent] = acc[sent] - sent_values[sent]


def _quantise(acc: torch.Tensor, chosen_magnitude: torch.Tensor, out: CompressedBucket) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one scale per block (its largest chosen magnitude / 127); return every element's
    code (round-half-even, in [-127, 127], 0 where the block's scale is 0) and scale."""
    block, blocks = out.layout.block, out.layout.num_blocks
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=acc.device)
    padded[:acc.numel()] = chosen_magnitude
    amax = padded.view(blocks, block).amax(dim=1)
    # Divide by a tensor, not the number 127: on CUDA, torch turns division by a number into
    # multiplication by its reciprocal, which is not correctly rounded.
    scales = amax / torch.full_like(amax, QUANT_MAX)
    out.scales.copy_(scales)
    # One correctly rounded reciprocal per block, then a multiply, as the kernel does (which says
    # why acc - code * scale stays exact).
    reciprocals = torch.ones_like(scales) / torch.where(scales > 0, scales, 1.0)
    scale = scales.repeat_interleave(block)[:acc.numel()]
    codes = torch.round(acc * reciprocals.repeat_interleave(block)[:acc.numel()]).clamp_(-QUANT_MAX, QUANT_MAX)
    return torch.where(scale > 0, codes, 0.0), scale


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    """dense_out[index] += code * scale for every valid entry (indices out of range are skipped)."""
    index, values = _dequantised(compressed)
    dense_out.index_add_(0, index, values)


def _dequantised(compressed: CompressedBucket) -> tuple[torch.Tensor, torch.Tensor]:
    """(element indices, code * scale) of the valid entries."""
    entry, index = compressed.entries()
    return index, compressed.values[entry].float() * compressed.scales[index // compressed.layout.block]


def decompress_sum(dense_out: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, divisor: float) -> None:
    """dense_out = (sum over rows of each row's dequantised payload, added in row order) / divisor.

    With a power-of-two divisor each value is scaled by 1 / divisor before it is added instead:
    scaling by a power of two is exact, so the bits are those of dividing the sum (unless a value
    falls below 2**-126, where fp32 is subnormal), and no division is left for a last pass.
    """
    total = torch.zeros(dense_out.numel(), dtype=torch.float32, device=dense_out.device)
    scale_first = power_of_two(divisor)
    for row in payloads:
        index, values = _dequantised(CompressedBucket(row, layout))
        total.index_add_(0, index, values * (1.0 / divisor) if scale_first else values)
    # Divide by a tensor, not the number: on CUDA, torch multiplies by the reciprocal instead.
    dense_out.copy_(total if scale_first else total / torch.full_like(total, divisor))


def power_of_two(x: float) -> bool:
    return math.frexp(x)[0] == 0.5
