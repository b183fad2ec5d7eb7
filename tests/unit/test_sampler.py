from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.plan import BatchLayout
from storage.sampler import DeterministicSampler


def step_samples(sampler, consumed, layout):
    return np.concatenate([np.concatenate(sampler.rank_micro_batches(consumed, layout, r))
                           for r in range(layout.world_size)])


def trained(sampler, consumed, layout, steps) -> list[int]:
    """The sample ids of `steps` steps from stream position `consumed`, every rank's micro-batches in
    rank order, drawn from `steps()`: the iterator a worker (re)started at `consumed` trains from
    (workers/loop.py)."""
    ranks = [sampler.steps(consumed, layout, rank) for rank in range(layout.world_size)]
    return [int(i) for _ in range(steps) for it in ranks for batch in next(it) for i in batch]


@pytest.mark.parametrize("world,micro,accum", [(1, 4, 1), (2, 3, 2), (3, 2, 5), (4, 1, 1)])
def test_every_sample_exactly_once_per_epoch_across_ranks(world, micro, accum):
    n = 600
    layout = BatchLayout.uniform(world, micro, accum)
    sampler = DeterministicSampler(n, seed=7)
    steps = (2 * n) // layout.global_batch  # two epochs' worth of whole steps
    seen = [sid for s in range(steps) for sid in step_samples(sampler, s * layout.global_batch, layout)]
    first_epoch = sampler.samples_at(0, n)
    assert sorted(first_epoch.tolist()) == list(range(n))
    assert Counter(seen[:n]) == Counter(range(n))  # positions 0..n-1 are epoch 0, each sample once


def test_ranks_get_disjoint_samples_within_a_step():
    layout = BatchLayout((4, 2, 3), accum_steps=2)
    sampler = DeterministicSampler(1000, seed=0)
    per_rank = [np.concatenate(sampler.rank_micro_batches(100, layout, r)) for r in range(3)]
    assert [len(p) for p in per_rank] == [8, 4, 6]
    together = np.concatenate(per_rank)
    assert len(set(together.tolist())) == layout.global_batch == 18
    assert sorted(together.tolist()) == sorted(sampler.samples_at(100, 18).tolist())


def test_heterogeneous_workers_may_differ_in_micro_batch_and_accumulation():
    layout = BatchLayout((8, 3), (2, 4))  # a fast GPU: 2 × 8; a slow one: 4 × 3
    sampler = DeterministicSampler(500, seed=1)
    assert layout.global_batch == 28 and layout.rank_offset(1) == 16
    fast, slow = (sampler.rank_micro_batches(56, layout, r) for r in range(2))
    assert [len(b) for b in fast] == [8, 8] and [len(b) for b in slow] == [3, 3, 3, 3]
    assert np.array_equal(np.concatenate(fast + slow), sampler.samples_at(56, 28))
    with pytest.raises(ValueError, match="one micro-batch size and one accumulation count per rank"):
        BatchLayout((8, 3), (2,))


def test_order_depends_only_on_seed_and_epoch():
    a, b = DeterministicSampler(500, seed=3), DeterministicSampler(500, seed=3)
    b.samples_at(700, 50)  # b has visited epoch 1 first: must not change epoch 0
    assert np.array_equal(a.samples_at(0, 500), b.samples_at(0, 500))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(DeterministicSampler(500, seed=4).permutation(0), a.permutation(0))
    assert not np.array_equal(DeterministicSampler(500, seed=1).permutation(3),
                              DeterministicSampler(500, seed=3).permutation(1))  # seed and epoch do not commute


@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6))
@settings(max_examples=60, deadline=None, database=None)
def test_each_epoch_is_a_permutation(n, seed, epoch):
    order = DeterministicSampler(n, seed).permutation(epoch)
    assert np.array_equal(np.sort(order), np.arange(n))


def test_orders_look_shuffled():
    order = DeterministicSampler(10_000, seed=0).permutation(0)
    assert abs(np.corrcoef(np.arange(10_000), order)[0, 1]) < 0.05
    assert np.mean(np.abs(np.diff(order))) > 2000  # neighbours in the stream are far apart in the dataset


def test_a_billion_samples_need_no_index():
    sampler = DeterministicSampler(10**9, seed=2)
    ids = sampler.samples_at(10**9 - 50, 100)  # across the first epoch boundary
    assert ids.min() >= 0 and ids.max() < 10**9 and len(set(ids[:50].tolist())) == 50


def test_resume_with_another_world_size_continues_at_the_next_sample():
    before = BatchLayout.uniform(4, 2, 1)  # 8 samples a step on 4 workers
    after = BatchLayout((3, 1), 2)          # 8 samples a step on 2 unequal workers
    stream = trained(DeterministicSampler(997, seed=11), 0, before, 10)
    stream += trained(DeterministicSampler(997, seed=11), 80, after, 10)  # a fresh process resumes at 80
    # Exactly the uninterrupted stream, in order: no sample skipped, repeated or moved at the restart.
    assert stream == DeterministicSampler(997, seed=11).samples_at(0, 160).tolist()


layouts = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=5).map(
    lambda ranks: BatchLayout(tuple(m for m, _ in ranks), tuple(a for _, a in ranks)))


@given(n=st.integers(1, 400), seed=st.integers(0, 2**32),
       segments=st.lists(st.tuples(layouts, st.integers(0, 25)), min_size=1, max_size=5))
@settings(max_examples=100, deadline=None, database=None)
def test_restarts_with_any_world_sizes_consume_each_sample_once_per_pass(n, seed, segments):
    """Train a few steps per segment, 'restart' with a new layout at the saved position, repeat: the
    samples consumed form whole passes over the dataset plus one prefix of the next, with no repeats."""
    consumed, seen = 0, []
    for layout, steps in segments:
        seen += trained(DeterministicSampler(n, seed), consumed, layout, steps)  # a fresh process after every restart
        consumed += steps * layout.global_batch
    assert len(seen) == consumed
    full, rest = divmod(consumed, n)
    for epoch in range(full):
        assert sorted(seen[epoch * n:(epoch + 1) * n]) == list(range(n))
    tail = seen[full * n:]
    assert len(set(tail)) == len(tail) == rest


def test_crossing_an_epoch_boundary():
    sampler = DeterministicSampler(10, seed=1)
    ids = sampler.samples_at(8, 4)
    assert ids[:2].tolist() == sampler.permutation(0)[8:].tolist()
    assert ids[2:].tolist() == sampler.permutation(1)[:2].tolist()
    assert sampler.epoch_of(12) == 1
