"""The sample ledger: round trip through bytes, and the exactly-once check catches a lost or repeated sample."""

import numpy as np
import pytest

from core.plan import BatchLayout
from storage.ledger import LEDGER_FILE, LedgerError, SampleLedger
from storage.sampler import DeterministicSampler


def ledger_of(sampler: DeterministicSampler, layout: BatchLayout, steps: int) -> SampleLedger:
    ledger = SampleLedger()
    for step in range(steps):
        blocks = [np.concatenate(sampler.rank_micro_batches(step * layout.global_batch, layout, r))
                  for r in range(layout.world_size)]
        ledger.record(step + 1, np.concatenate(blocks))
    return ledger


def test_round_trip_keeps_every_step_and_id():
    ledger = ledger_of(DeterministicSampler(50, seed=3), BatchLayout.uniform(2, 2, 2), steps=7)
    back = SampleLedger.from_bytes(ledger.to_bytes())
    assert back.steps == list(range(1, 8)) and back.last_step == 7
    assert np.array_equal(back.stream(), ledger.stream()) and len(back.stream()) == 7 * 8
    assert SampleLedger.from_bytes(SampleLedger().to_bytes()).steps == []


def test_two_epochs_across_a_resize_hold_every_sample_once_per_epoch():
    sampler = DeterministicSampler(40, seed=1)
    ledger = ledger_of(sampler, BatchLayout.uniform(2, 2, 2), steps=6)  # 48 samples on two workers
    for step in range(6, 10):  # then three heterogeneous workers, same global batch of 8
        layout = BatchLayout((2, 1, 1), 2)
        ids = np.concatenate([np.concatenate(sampler.rank_micro_batches(step * 8, layout, r)) for r in range(3)])
        ledger.record(step + 1, ids)
    ledger.check_exactly_once(40)
    assert sorted(ledger.stream()[:40]) == list(range(40))


def test_a_repeated_sample_or_a_gap_is_caught():
    sampler = DeterministicSampler(16, seed=0)
    ledger = ledger_of(sampler, BatchLayout.uniform(1, 4, 1), steps=4)
    ledger.check_exactly_once(16)
    ledger.ids[2] = ledger.ids[1].copy()  # a redone step that re-read the previous step's samples
    with pytest.raises(LedgerError, match="epoch 0: 4 samples trained more than once"):
        ledger.check_exactly_once(16)
    with pytest.raises(LedgerError, match="step 6 recorded after step 4"):
        ledger.record(6, np.arange(4))


def test_the_keeper_records_what_the_loader_was_handed_even_when_it_reads_ahead():
    from workers.elastic import LedgerKeeper

    sampler, layout = DeterministicSampler(30, seed=2), BatchLayout.uniform(1, 2, 2)
    keeper = LedgerKeeper(True, None, rank=0, replica=0, group=None)
    steps = keeper.tap(sampler.steps(0, layout, 0))
    ahead = [next(steps), next(steps)]  # the loader keeps two steps in flight
    for step in range(1, 4):
        keeper.trained(step)
        ahead.append(next(steps))
    ledger = SampleLedger.from_bytes(keeper.extra()[LEDGER_FILE])
    assert ledger.steps == [1, 2, 3]
    assert np.array_equal(ledger.stream(), sampler.samples_at(0, 12))
    resumed = LedgerKeeper(True, ledger.to_bytes(), rank=0, replica=0, group=None)
    assert resumed.ledger.last_step == 3
    assert LedgerKeeper(False, None, rank=0, replica=0, group=None).extra() == {}
