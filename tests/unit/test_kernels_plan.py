"""The selection plan, the payload layout and the threshold search, each on its own."""

import dataclasses

import pytest
import torch

from kernels import reference
from kernels.payload import SEGMENT, PayloadLayout, allocate
from kernels.selection import FINE_SHIFT, MAX_SAMPLE_SIZE, SAMPLE_CHUNK, SAMPLE_HITS, SelectionPlan


def test_small_bucket_is_sampled_whole_in_order():
    plan = SelectionPlan.for_ratio(5000, 0.01)
    assert (plan.k, plan.capacity, plan.sample_size, plan.sample_need) == (50, 55, 5000, 50)
    assert torch.equal(reference.sample_positions(plan, torch.device("cpu")), torch.arange(5000))


def test_large_bucket_samples_enough_to_expect_sample_hits_above_the_threshold():
    plan = SelectionPlan.for_ratio(250_000_000, 0.01)
    assert plan.k == 2_500_000 and plan.capacity == 2_750_000
    assert plan.sample_size == SAMPLE_HITS * 100 == plan.sample_chunks * SAMPLE_CHUNK
    assert plan.sample_need == SAMPLE_HITS


def test_sample_is_runs_of_neighbours_spread_evenly_over_the_bucket():
    plan = SelectionPlan.for_ratio(10_000_003, 0.01)
    positions = reference.sample_positions(plan, torch.device("cpu"))
    assert positions.numel() == plan.sample_size and positions.unique().numel() == plan.sample_size
    runs = positions.view(-1, SAMPLE_CHUNK)
    assert torch.equal(runs - runs[:, :1], torch.arange(SAMPLE_CHUNK).expand_as(runs))  # contiguous
    assert (runs[:, 0] % SAMPLE_CHUNK == 0).all()  # aligned: whole DRAM sectors
    gaps = runs[1:, 0] - runs[:-1, 0]
    assert gaps.max() - gaps.min() <= SAMPLE_CHUNK  # evenly spread
    assert runs[-1, -1] < 10_000_003 <= runs[-1, -1] + gaps.max()  # up to the end


def test_tiny_ratio_caps_the_sample():
    plan = SelectionPlan.for_ratio(250_000_000, 0.0001)
    assert plan.sample_size == MAX_SAMPLE_SIZE
    assert plan.sample_need == round(25_000 * MAX_SAMPLE_SIZE / 250_000_000)


def test_a_sample_nearly_as_large_as_the_bucket_takes_the_bucket_whole():
    plan = SelectionPlan.for_k(20_011, 20)  # wants 2048 * 1000 samples, more than the bucket holds
    assert plan.sample_size == 20_011 and plan.sample_chunks == plan.chunk_slots == -(-20_011 // SAMPLE_CHUNK)
    assert torch.equal(reference.sample_positions(plan, torch.device("cpu")), torch.arange(20_011))


@pytest.mark.parametrize("numel,k", [(0, 1), (10, 0), (10, 11), (2**31, 1)])
def test_impossible_plans_are_refused(numel, k):
    with pytest.raises(ValueError):
        SelectionPlan.for_k(numel, k)


def test_payload_layout_aligns_arrays_for_vector_access():
    layout = PayloadLayout(numel=40_000, capacity=401, value_dtype=torch.int8, block=4096)
    assert layout.values_offset == 16 + 2 * 401 and layout.entry_bytes == 3  # int16 offset, int8 code
    assert layout.scales_offset % 16 == 0 and layout.scales_offset >= layout.values_offset + 401
    assert layout.num_blocks == 10 and layout.starts_offset == layout.scales_offset + 48
    assert layout.num_segments == 3 and layout.nbytes == layout.starts_offset + 16
    raw = PayloadLayout(numel=10_000, capacity=100, value_dtype=torch.bfloat16, block=None)
    assert raw.num_blocks == raw.num_segments == 0 and raw.nbytes == 16 + 400 + 208 and raw.entry_bytes == 6


def test_segment_starts_say_where_each_segment_of_the_bucket_begins_in_the_entries():
    from kernels import compress
    n = 3 * SEGMENT + 5
    c = compress(torch.randn(n, generator=torch.Generator().manual_seed(4)), torch.zeros(n), 0.02)
    index = c.element_indices()
    assert torch.equal(c.indices[:c.sent()].long(), index % SEGMENT)
    want = [int((index < s * SEGMENT).sum()) for s in range(4)]
    assert c.segment_starts.tolist() == want and want[0] == 0 < want[1] < want[2] < want[3] <= c.sent()
    tied = compress(torch.ones(n), torch.zeros(n), 0.02)  # every element selected; capacity caps the starts
    assert tied.segment_starts.tolist() == [min(s * SEGMENT, tied.capacity) for s in range(4)]


def select_all(values: torch.Tensor, need: int):
    """The twin's selection with the whole of `values` as the sample, and room for all of it."""
    n = values.numel()
    runs = -(-n // SAMPLE_CHUNK)
    plan = dataclasses.replace(SelectionPlan.for_k(n, need), sample_size=n, sample_chunks=runs, chunk_slots=runs,
                               sample_need=need)
    out, workspace = allocate(PayloadLayout(n, n, values.dtype, None), plan, values.device)
    reference.select(values, None, plan, out, workspace)
    return out


def as_float(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def test_threshold_is_the_lower_edge_of_the_fine_bin_that_holds_the_need_th_largest():
    values = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 3
    for need in (1, 100, 5_000, 99_999):
        out = select_all(values, need)
        bits = int(out.header[2])
        assert bits % (1 << FINE_SHIFT) == 0
        low, high = as_float(bits), as_float(bits + (1 << FINE_SHIFT))
        assert int((values >= low).sum()) >= need > int((values >= high).sum())
        assert out.counts()[0] == int((values >= low).sum())
        # It overshoots by less than the bin holds: 2**-12 of a binade, ~16 of these values at most.
        assert 0 <= out.counts()[0] - need < int(((values >= low) & (values < high)).sum()) <= 40


def test_threshold_lands_on_tied_values_so_all_of_them_are_kept():
    values = torch.cat([torch.full((500,), 1.0), torch.full((500,), -0.25)])
    high, low = select_all(values, 10), select_all(values, 700)
    assert high.threshold.item() == 1.0 and high.counts()[0] == 500
    assert low.threshold.item() == 0.25 and low.counts()[0] == 1000


def test_threshold_is_zero_when_too_few_finite_values_were_seen():
    out = select_all(torch.tensor([float("inf"), float("nan"), 2.0, 0.0]), 2)
    assert int(out.header[2]) == 0
    assert out.counts()[1] == 2
