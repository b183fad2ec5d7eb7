from collections import Counter

import numpy as np
import pytest

from storage.sampler import BatchLayout, DeterministicSampler


def step_samples(sampler, consumed, layout):
    return np.concatenate([np.concatenate(sampler.rank_micro_batches(consumed, layout, r))
                           for r in range(len(layout.micro_batch_sizes))])


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


def test_order_depends_only_on_seed_and_epoch():
    a, b = DeterministicSampler(500, seed=3), DeterministicSampler(500, seed=3)
    b.samples_at(700, 50)  # b has visited epoch 1 first: must not change epoch 0
    assert np.array_equal(a.samples_at(0, 500), b.samples_at(0, 500))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(DeterministicSampler(500, seed=4).permutation(0), a.permutation(0))


def test_resume_with_another_world_size_continues_at_the_next_sample():
    sampler = DeterministicSampler(997, seed=11)
    before = BatchLayout.uniform(4, 2, 1)  # 8 samples a step on 4 workers
    after = BatchLayout((3, 1), 2)          # 8 samples a step on 2 unequal workers
    used = [step_samples(sampler, s * 8, before) for s in range(10)]
    used += [step_samples(DeterministicSampler(997, seed=11), 80 + s * 8, after) for s in range(10)]
    stream = np.concatenate(used)
    assert np.array_equal(np.sort(stream), np.sort(sampler.samples_at(0, 160)))
    assert len(set(stream.tolist())) == 160


def test_crossing_an_epoch_boundary():
    sampler = DeterministicSampler(10, seed=1)
    ids = sampler.samples_at(8, 4)
    assert ids[:2].tolist() == sampler.permutation(0)[8:].tolist()
    assert ids[2:].tolist() == sampler.permutation(1)[:2].tolist()
    assert sampler.epoch_of(12) == 1
