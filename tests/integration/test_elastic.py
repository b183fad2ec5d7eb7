"""Elastic and fault-tolerant fit() on a real multi-node Ray cluster (conftest.py's: a head and one worker
node on loopback, 1 CPU each, so two gloo CPU workers; a third node comes and goes in the resize test).

A watcher thread follows each run through its PlanCoordinator (`status`: the group's worker pids, the
last step, the events) and kills workers (SIGKILL), drains a node with a preemption notice, removes it
and adds one at the moments the test names. Every run keeps the sample ledger, so exactly-once is
checked on the ids the workers really trained on, over whole epochs of a small dataset; and the run
with faults is compared step by step with conftest.py's uninterrupted `straight` run of the same job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from core.errors import FailureBudgetError
from orchestrator import Orchestrator
from orchestrator.coordinator import COORDINATOR_NAME, WORKER_DEATHS
from storage.ledger import LEDGER_FILE, SampleLedger
from tests.integration.conftest import epoch_steps, job
from workers import checkpoint
from workers.models.gpt import GPT

pytestmark = pytest.mark.integration
DRAIN_DEADLINE_S = 10
"""The preemption notice's deadline: Ray Train restarts the group once it has passed (and the node is gone)."""
HEALTH_CHECK_TIMEOUT_S = 3.0
"""[elastic] health_check_timeout_s of the faults run, whose last fault is a frozen worker."""
LOSS_TOLERANCE = 1e-4
"""Relative: the same samples in the same order on the same two workers give the same losses up to
float32 reduction order; a lost or repeated batch moves them by far more."""


def run_with(orchestrator: Orchestrator, act):
    """Runs fit() on a thread while this (main) thread follows the run through its coordinator's status
    and calls `act(status)` until it returns True (Cluster.add_node needs the main thread)."""
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = orchestrator.fit()
        except Exception as e:  # noqa: BLE001 - raised below, on the test's thread
            outcome["error"] = e
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    coordinator, done = None, False
    while thread.is_alive():
        time.sleep(0.02)
        if done:
            continue
        try:
            coordinator = coordinator or ray.get_actor(COORDINATOR_NAME.format(orchestrator.config.name))
            status = ray.get(coordinator.status.remote())
        except (ValueError, ray.exceptions.RayActorError):  # not started yet, or over
            continue
        done = act(status)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def kill(status: dict, rank: int) -> None:
    os.kill(status["workers"][rank]["pid"], signal.SIGKILL)


def final_ledger(result) -> SampleLedger:
    return SampleLedger.from_bytes(checkpoint.read_extra(result.checkpoint, LEDGER_FILE))


def events(result, kind: str) -> list[dict]:
    return [r for r in result.metrics if r.get("event") == kind]


def losses(rows) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # a redone step: its last (committed) value


def mid_write_killer(run_dir: Path, after_step: int):
    """Kills rank 0 — the checkpoint's coordinator, which writes archipelago.json, the ledger and, last,
    .metadata — while it writes a checkpoint after `after_step`: stopped (SIGSTOP) the moment the step
    directory appears, killed if .metadata is not there yet, let go to try the next one otherwise."""
    caught: dict = {}

    def watch_writes(status: dict) -> bool:
        if status["last_step"] <= after_step:
            return False
        pid = status["workers"][0]["pid"]
        for step_dir in sorted(run_dir.glob("step_*")):
            step = int(step_dir.name.split("_")[1])
            if step <= after_step or step in caught.get("missed", set()) or (step_dir / ".metadata").exists():
                continue
            os.kill(pid, signal.SIGSTOP)
            if (step_dir / ".metadata").exists():  # finished before it stopped: try the next checkpoint
                caught.setdefault("missed", set()).add(step)
                os.kill(pid, signal.SIGCONT)
                continue
            caught["step"] = step
            os.kill(pid, signal.SIGKILL)
            return True
        return False
    return watch_writes, caught


@pytest.fixture(scope="module")
def faults(cluster, small_dataset, tmp_path_factory):
    """The same run with rank 1 killed at step 6, then rank 0 killed in the middle of a checkpoint write,
    then rank 1 frozen (SIGSTOP, never continued) two steps after the restart."""
    runs = tmp_path_factory.mktemp("runs")
    config = job(small_dataset, runs, "faults", epoch_steps(small_dataset),
                 elastic={"health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S})
    killer, caught = mid_write_killer(runs / "faults", after_step=12)
    killed, frozen = {}, {}

    def act(status: dict) -> bool:
        if not killed and status["attempt"] == 1 and status["last_step"] >= 6:
            killed["at_step"] = status["last_step"]
            kill(status, rank=1)
        elif killed and status["attempt"] == 2 and not caught.get("step"):
            killer(status)
        elif caught.get("step") and status["attempt"] == 3 and status["last_step"] >= caught["step"] + 2:
            frozen.update(pid=status["workers"][1]["pid"], at_step=status["last_step"],
                          committed=newest_committed(runs / "faults"))
            os.kill(frozen["pid"], signal.SIGSTOP)
            return True
        return False
    started = time.monotonic()
    try:
        result = run_with(Orchestrator(config), act)
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen["pid"], signal.SIGKILL)
    return result, killed, caught, frozen, time.monotonic() - started


def newest_committed(run_dir: Path) -> int:
    return max((int(p.parent.name.split("_")[1]) for p in run_dir.glob("step_*/.metadata")), default=0)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a stopped one counts as alive)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def test_a_killed_worker_costs_only_uncommitted_steps_and_no_sample(faults, straight, small_dataset):
    result, killed, _, _, seconds = faults
    lost, first = events(result, "worker_lost")[0], events(result, "restart")[0]
    assert lost["ranks"] == [1] and lost["error"].startswith(WORKER_DEATHS) and lost["attempt"] == 1
    assert first["step"] == 4 and first["world_size"] == first["previous_world_size"] == 2  # checkpoints every 4
    assert first["steps_redone"] >= killed["at_step"] - 4
    for key in ("detect_s", "startup_s", "restore_s", "recompile_s", "recovery_s"):
        assert 0 <= first[key] < 120, key
    ledger = final_ledger(result)
    assert ledger.steps == list(range(1, epoch_steps(small_dataset) + 1))
    ledger.check_exactly_once(small_dataset[1])
    assert sorted(ledger.stream()[:small_dataset[1]]) == list(range(small_dataset[1]))
    assert checkpoint.read_info(result.checkpoint).consumed_samples == epoch_steps(small_dataset) * 8
    expected, got = losses(straight.result.metrics), losses(result.metrics)
    assert sorted(got) == sorted(expected)
    for step in expected:  # every step, the final one included, trained on the same samples from the same state
        assert got[step] == pytest.approx(expected[step], rel=LOSS_TOLERANCE), step
    print(f"faults run: {seconds:.0f} s; first recovery {first}")


def test_a_kill_during_a_checkpoint_write_resumes_from_the_previous_committed_step(faults, small_dataset):
    result, _, caught, _, _ = faults
    assert caught.get("step"), "the watcher never caught a checkpoint being written"
    second = events(result, "restart")[1]
    every = 4
    assert second["step"] == caught["step"] - every  # the half-written step was not loaded
    assert events(result, "worker_lost")[1]["ranks"] == [0]
    after = result.metrics[result.metrics.index(second):]
    assert {"event": "checkpoint", "step": caught["step"]} in after  # written again, whole, after the restart
    ledger = final_ledger(result)
    ledger.check_exactly_once(small_dataset[1])
    assert caught["step"] in ledger.steps


def test_a_frozen_worker_is_found_by_the_health_check_and_replaced(faults, small_dataset):
    """A worker stopped with SIGSTOP answers no health check: after [elastic] health_check_timeout_s
    Ray Train counts it failed, its process is killed, and the group restarts from the newest
    committed checkpoint; the ledger still holds every sample once."""
    result, _, _, frozen, _ = faults
    assert frozen, "the run ended before a worker could be frozen"
    lost, restart = events(result, "worker_lost")[2], events(result, "restart")[2]
    assert lost["ranks"] == [1] and lost["error"].startswith("WorkerHealthCheckTimeoutError"), lost
    assert frozen["committed"] <= restart["step"] <= frozen["at_step"]  # no committed step lost
    # From its last step to the failure: the timeout (the peer may have finished one more step first).
    assert HEALTH_CHECK_TIMEOUT_S - 1 <= restart["detect_s"] < HEALTH_CHECK_TIMEOUT_S + 30
    assert not alive(frozen["pid"])  # replaced, not left stopped
    assert len(events(result, "restart")) == 3
    final_ledger(result).check_exactly_once(small_dataset[1])


def test_redone_steps_repeat_the_lost_ones_exactly(faults):
    """The steps trained after the kill and lost with it were trained again from the restored state
    on the same samples: the same losses (metrics keep both rows)."""
    result = faults[0]
    seen: dict[int, list[float]] = {}
    for row in result.metrics:
        if "loss" in row:
            seen.setdefault(row["step"], []).append(row["loss"])
    redone = {step: values for step, values in seen.items() if len(values) > 1}
    assert len(redone) >= 3
    for step, values in redone.items():
        assert values == pytest.approx([values[0]] * len(values), rel=LOSS_TOLERANCE), step


def test_an_exhausted_failure_budget_names_the_failures_and_keeps_the_checkpoint(cluster, small_dataset,
                                                                               tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    config = job(small_dataset, runs, "budget", 40, elastic={"max_failures": 0})
    killed = {}

    def act(status: dict) -> bool:
        if status["last_step"] >= 6:
            killed["node"] = status["workers"][1]["address"]
            kill(status, rank=1)
            return True
        return False
    with pytest.raises(FailureBudgetError) as info:
        run_with(Orchestrator(config), act)
    message = str(info.value)
    assert message.startswith("[elastic] max_failures: training stopped after 1 worker failure(s), more than "
                              "[elastic] max_failures = 0 allows: group 1: rank 1 on " + killed["node"])
    assert any(death in message for death in WORKER_DEATHS) and "step 4" in message and "--resume" in message
    latest = runs / "budget" / "step_00000004"
    info_file = checkpoint.read_info(latest)
    assert info_file.step == 4 and info_file.consumed_samples == 32
    model = GPT(config.model)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.load(latest, model, optimizer)  # loadable, whole
    ledger = SampleLedger.from_bytes(checkpoint.read_extra(latest, LEDGER_FILE))
    assert ledger.steps == [1, 2, 3, 4]
    ledger.check_exactly_once(small_dataset[1])


def test_a_preempted_node_shrinks_the_job_and_a_new_node_grows_it(cluster, small_dataset, tmp_path_factory,
                                                                 monkeypatch):
    runs = tmp_path_factory.mktemp("runs")
    steps = 8 * epoch_steps(small_dataset)  # long enough for a node to join while one worker trains
    # After the node goes, Ray Train first tries the old size on its stale view of the cluster and gives
    # up after this timeout (60 s by default) before it starts the smaller group.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    # Ray Train reads the nodes' drain state every 5 s by default: the notice would reach the workers later.
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    config = job(small_dataset, runs, "resize", steps, train={"eval_every": 1000},  # no test here reads val_loss
                 elastic={"min_workers": 1, "resize_check_s": 1.0, "preemption_grace_s": 5.0})
    (node,) = [n for n in cluster.worker_nodes]
    seen: dict = {}

    def act(status: dict) -> bool:
        names = [e["event"] for e in status["events"]]
        if "drained" not in seen and status["last_step"] >= 6:
            ray_node = next(w["ray_node_id"] for w in status["workers"] if w["ray_node_id"] == node.node_id)
            drain(cluster, ray_node)
            seen["drained"] = True
        elif "drained" in seen and "removed" not in seen and "preemption" in names:
            cluster.remove_node(node)
            seen["removed"] = status["last_step"]
        elif "removed" in seen and "added" not in seen and status["world_size"] == 1:
            cluster.add_node(num_cpus=1)
            seen["added"] = status["last_step"]
        if "added" in seen and status["world_size"] == 1:
            throttle.hold(status["workers"][0]["pid"])
        else:
            throttle.release()
        return status["world_size"] == 2 and status["attempt"] >= 3
    throttle = Throttle()
    try:
        result = run_with(Orchestrator(config), act)
    finally:
        throttle.release()

    preemption = events(result, "preemption")[0]
    restarts = events(result, "restart")
    assert [(r["previous_world_size"], r["world_size"]) for r in restarts] == [(2, 1), (1, 2)]
    assert restarts[0]["step"] == preemption["step"]  # the checkpoint taken on notice: no committed step lost
    assert events(result, "worker_lost")[0]["preempted"] and restarts[0]["cause"] == "preemption"
    assert restarts[0]["step"] % 4 != 0 or preemption["step"] % 4 == 0
    replans = events(result, "replan")
    assert [(r["world_size"], r["micro_batch_sizes"], r["grad_accum_steps"]) for r in replans] == \
           [(1, [2], 4), (2, [2, 2], 2)]
    assert [e["world_size"] for e in events(result, "resize")] == [1, 2]
    plan = json.loads((runs / "resize" / "plan.json").read_text())
    assert len(plan["workers"]) == 2 and plan["global_batch_size"] == 8
    assert result.plan.world_size == 2 and result.report.final_step == steps
    assert checkpoint.read_info(result.checkpoint).consumed_samples == steps * 8  # global batch unchanged
    ledger = final_ledger(result)
    assert ledger.steps == list(range(1, steps + 1)) and {len(ids) for ids in ledger.ids} == {8}
    ledger.check_exactly_once(small_dataset[1])


class Throttle:
    """Slows one worker process to a fifth of its speed: stopped (SIGSTOP) for 200 ms of every 250 ms.

    Ray Train notices a new node only after its resource view and resize monitor catch up (several
    seconds); on an idle machine the lone worker finishes the run's remaining steps sooner (265 steps in
    11 s in one CI run), and the job never grows. A slow worker keeps the run going until the resize; it
    still answers Ray's polls within 200 ms, far inside the health-check timeout."""

    def __init__(self):
        self.pid: int | None = None

    def hold(self, pid: int) -> None:
        self.pid = pid
        stopped = time.monotonic() % 0.25 < 0.2
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    def release(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        self.pid = None


def drain(cluster: Cluster, ray_node_id: str) -> None:
    """What a cloud's spot reclaim does through the autoscaler: drain the node with a deadline (preemption)."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    accepted, why = gcs.drain_node(ray_node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "spot reclaim (test)", int(time.time() * 1000) + DRAIN_DEADLINE_S * 1000)
    assert accepted, why
