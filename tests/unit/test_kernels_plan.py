"""The selection plan, the payload layout and the threshold search, each on its own."""

import dataclasses
import math

import pytest
import torch

from kernels import reference
from kernels.payload import PayloadLayout, allocate
from kernels.plan import KEY_SHIFT, MAX_SAMPLE_SIZE, SAMPLE_HITS, SelectionPlan


def test_small_bucket_is_sampled_whole_in_a_permutation():
    plan = SelectionPlan.for_ratio(5000, 0.01)
    assert (plan.k, plan.capacity, plan.sample_size, plan.sample_need) == (50, 55, 5000, 50)
    assert math.gcd(plan.sample_stride, 5000) == 1
    positions = {(j * plan.sample_stride) % 5000 for j in range(5000)}
    assert len(positions) == 5000


def test_large_bucket_samples_enough_to_expect_sample_hits_above_the_threshold():
    plan = SelectionPlan.for_ratio(250_000_000, 0.01)
    assert plan.k == 2_500_000 and plan.capacity == 2_750_000
    assert plan.sample_size == SAMPLE_HITS * 100
    assert plan.sample_need == SAMPLE_HITS


def test_tiny_ratio_caps_the_sample():
    plan = SelectionPlan.for_ratio(250_000_000, 0.0001)
    assert plan.sample_size == MAX_SAMPLE_SIZE
    assert plan.sample_need == round(25_000 * MAX_SAMPLE_SIZE / 250_000_000)


@pytest.mark.parametrize("numel,k", [(0, 1), (10, 0), (10, 11), (2**31, 1)])
def test_impossible_plans_are_refused(numel, k):
    with pytest.raises(ValueError):
        SelectionPlan.for_k(numel, k)


def test_payload_layout_aligns_arrays_for_vector_access():
    layout = PayloadLayout(numel=10_000, capacity=101, value_dtype=torch.int8, block=4096)
    assert layout.values_offset == 16 + 4 * 101
    assert layout.scales_offset % 16 == 0 and layout.scales_offset >= layout.values_offset + 101
    assert layout.num_blocks == 3 and layout.nbytes == layout.scales_offset + 16
    raw = PayloadLayout(numel=10_000, capacity=100, value_dtype=torch.bfloat16, block=None)
    assert raw.num_blocks == 0 and raw.nbytes == 16 + 400 + 208


def select_all(values: torch.Tensor, need: int):
    """The twin's selection with the whole of `values` as the sample, and room for all of it."""
    n = values.numel()
    plan = dataclasses.replace(SelectionPlan.for_k(n, need), sample_size=n, sample_need=need)
    out, workspace = allocate(PayloadLayout(n, n, values.dtype, None), plan, values.device)
    reference.select(values, None, plan, out, workspace)
    return out


def as_float(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def test_threshold_falls_in_the_right_bin_and_interpolates_inside_it():
    values = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 3
    for need in (1, 100, 5_000, 99_999):
        out = select_all(values, need)
        bits = int(out.header[2])
        low, high = as_float(bits >> KEY_SHIFT << KEY_SHIFT), as_float(((bits >> KEY_SHIFT) + 1) << KEY_SHIFT)
        assert int((values >= low).sum()) >= need > int((values >= high).sum())
        # Inside the 0.4 %-wide bin the threshold is interpolated by rank: off by a few values.
        assert abs(out.counts()[0] - need) <= 2 + need // 20


def test_threshold_lands_on_tied_values_so_all_of_them_are_kept():
    values = torch.cat([torch.full((500,), 1.0), torch.full((500,), -0.25)])
    high, low = select_all(values, 10), select_all(values, 700)
    assert high.threshold.item() == 1.0 and high.counts()[0] == 500
    assert low.threshold.item() == 0.25 and low.counts()[0] == 1000


def test_threshold_is_zero_when_too_few_finite_values_were_seen():
    out = select_all(torch.tensor([float("inf"), float("nan"), 2.0, 0.0]), 2)
    assert int(out.header[2]) == 0
    assert out.counts()[1] == 2
