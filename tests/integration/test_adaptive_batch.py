"""An adaptive global batch on two CPU workers (conftest.py's cluster): the batch follows the measured
noise scale, changing in place — the same worker processes go on, no restart — and every sample is
trained exactly once (the ledger); a worker killed after the changes costs a restart that resumes
with the batch and learning rate the committed checkpoint had."""

from __future__ import annotations

import pytest

from orchestrator import Orchestrator
from tests.integration.conftest import job
from tests.integration.test_elastic import events, final_ledger, kill, run_with
from workers import checkpoint

pytestmark = pytest.mark.integration
STEPS = 60
"""[train] steps of the base batch: 240 samples, fewer steps once the batch has grown."""
ADAPTIVE = {"batch_size": "adaptive", "global_batch_size": 4, "min_batch_size": 4, "max_batch_size": 16,
            "micro_batch_size": 2, "log_every": 1, "eval_every": 100}


def test_the_batch_grows_in_place_keeps_every_sample_once_and_resumes_as_it_was(cluster, small_dataset,
                                                                                tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    config = job(small_dataset, runs, "adaptive", STEPS, train=ADAPTIVE)
    seen: dict = {}

    def act(status: dict) -> bool:
        pids = [w["pid"] for w in status["workers"]]
        if pids and status["attempt"] == 1:
            seen.setdefault("pids", pids)
        if status["attempt"] == 1 and seen.get("kill_at") is None and status["last_step"] >= 28:
            seen.update(pids_before_kill=pids, kill_at=status["last_step"])
            kill(status, rank=1)
            return True
        return False

    result = run_with(Orchestrator(config), act)
    changes = events(result, "batch_change")
    first_restart = result.metrics.index(events(result, "restart")[0])
    before = [c for c in changes if result.metrics.index(c) < first_restart]
    assert len(before) >= 2, changes  # at least two changes made in place, before any restart
    assert [c["from"] for c in before[1:]] == [c["to"] for c in before[:-1]]
    assert seen["pids_before_kill"] == seen["pids"]  # the same worker processes across those changes

    ledger = final_ledger(result)
    ledger.check_exactly_once(small_dataset[1])
    assert len(ledger.stream()) == checkpoint.read_info(result.checkpoint).consumed_samples >= STEPS * 4
    batches = [len(ids) for ids in ledger.ids]
    assert batches[0] == 4 and max(batches) > 4  # the ledger saw the batch change

    restart = events(result, "restart")[0]
    had = [c["to"] for c in before if c["step"] <= restart["step"]][-1]  # the batch after the restored step
    start = [r for r in result.metrics if r.get("event") == "start"][-1]
    assert start["global_batch"] == had > 4
    lrs: dict[int, list[float]] = {}
    for row in result.metrics:
        if "lr" in row:
            lrs.setdefault(row["step"], []).append(row["lr"])
    redone = [s for s, values in lrs.items() if len(values) > 1]
    assert redone, "no step was trained twice around the kill"
    for step in redone:  # the same learning rate on the redone steps: batch and noise estimate restored
        assert lrs[step][-1] == pytest.approx(lrs[step][0], rel=1e-4), step
