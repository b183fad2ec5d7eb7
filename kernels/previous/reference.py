"""Plain-torch twins of the Triton kernels: the CPU implementation and the reference in tests.

Each public function has the signature and the bit-exact results of its namesake in
kernels/triton_kernels.py, down to the payload's bytes. The arithmetic is chosen so both agree
to the bit: integer histogram maths for the threshold, correctly rounded division,
round-half-even, and no fused multiply-add.
"""

from __future__ import annotations

import torch

from kernels.previous.payload import QUANT_MAX, CompressedBucket, PayloadLayout
from kernels.previous.plan import BINS, EXPONENT_SHIFT, KEY_SHIFT, NONFINITE_EXPONENT, WORKSPACE_SAMPLES, SelectionPlan

NONFINITE_BITS = NONFINITE_EXPONENT << EXPONENT_SHIFT


def magnitude_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 bits of |x| as int32: ordered like the magnitudes, with inf and NaN above every finite value."""
    return x.view(torch.int32) & 0x7FFFFFFF


def workspace_parts(workspace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts per exponent, counts per key bin, largest bits per key bin, sampled bits)."""
    return workspace[:BINS], workspace[BINS:2 * BINS], workspace[2 * BINS:WORKSPACE_SAMPLES], workspace[WORKSPACE_SAMPLES:]


def _estimate_threshold(source: torch.Tensor, residual: torch.Tensor | None, plan: SelectionPlan,
                       header: torch.Tensor, workspace: torch.Tensor) -> None:
    """Sample source (+ residual), histogram the sample into `workspace` (zeroed histograms) and
    write the threshold's fp32 bits to header[2]."""
    exponents, key_bins, key_max, samples = workspace_parts(workspace)
    positions = torch.arange(plan.sample_size, dtype=torch.int64, device=source.device) * plan.sample_stride % plan.numel
    sample = source[positions].float()
    if residual is not None:
        sample = sample + residual[positions]
    samples.copy_(magnitude_bits(sample))
    exponent = (samples >> EXPONENT_SHIFT).long()
    exponents += torch.bincount(exponent[exponent < NONFINITE_EXPONENT], minlength=BINS).to(torch.int32)
    top, need, _ = _bin_from_top(exponents.tolist(), plan.sample_need)
    inside = samples[exponent == top]
    key_bin = ((inside >> KEY_SHIFT) & (BINS - 1)).long()
    key_bins += torch.bincount(key_bin, minlength=BINS).to(torch.int32)
    key_max.scatter_reduce_(0, key_bin, inside, reduce="amax")
    header[2] = threshold_bits(workspace, plan.sample_need)


def threshold_bits(workspace: torch.Tensor, need: int) -> int:
    """fp32 bits of a threshold that `need` of the histogrammed magnitudes reach.

    The exponent histogram finds the binade, the key-bin histogram inside it the 0.4 %-wide bin;
    inside that bin the threshold is interpolated by rank between the bin's lower edge and the
    largest magnitude seen in it, so tied values (all equal to that largest) are all kept.
    """
    exponents, key_bins, key_max, _ = workspace_parts(workspace)
    top, need, _ = _bin_from_top(exponents.tolist(), need)
    key_bin, need, count = _bin_from_top(key_bins.tolist(), need)
    if count == 0:
        return 0
    low = (top * BINS + key_bin) << KEY_SHIFT
    return low + (int(key_max[key_bin]) - low) * (count - need) // count


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
    chosen = (magnitude >= out.threshold) & (magnitude > 0)
    if out.layout.block is None:
        stored, sent_values = source, acc
    else:
        codes, scale_per_element = _quantise(acc, torch.where(chosen, magnitude, 0.0), out)
        chosen &= codes != 0
        stored, sent_values = codes, codes * scale_per_element
    index = chosen.nonzero().squeeze(1)
    out.header[0] = index.numel()
    sent = index[:out.capacity]
    out.indices[:sent.numel()] = sent.to(torch.int32)
    out.values[:sent.numel()] = stored[sent].to(out.layout.value_dtype)
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
    scale = scales.repeat_interleave(block)[:acc.numel()]
    codes = torch.round(acc / torch.where(scale > 0, scale, 1.0)).clamp_(-QUANT_MAX, QUANT_MAX)
    return torch.where(scale > 0, codes, 0.0), scale


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    """dense_out[index] += code * scale for every valid entry (indices out of range are skipped)."""
    count = min(int(compressed.header[0]), compressed.capacity)
    index, codes = compressed.indices[:count].long(), compressed.values[:count]
    valid = (index >= 0) & (index < compressed.numel)
    index, codes = index[valid], codes[valid]
    dense_out.index_add_(0, index, codes.float() * compressed.scales[index // compressed.layout.block])


def decompress_sum(dense_out: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, divisor: float) -> None:
    """dense_out = (sum over rows of each row's dequantised payload, added in row order) / divisor."""
    total = torch.zeros(dense_out.numel(), dtype=torch.float32, device=dense_out.device)
    for row in payloads:
        decompress_accumulate(total, CompressedBucket(row, layout))
    # Divide by a tensor, not the number: on CUDA, torch multiplies by the reciprocal instead.
    dense_out.copy_(total / torch.full_like(total, divisor))
