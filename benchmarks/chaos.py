"""Chaos: one long CPU run through many seeded random faults, then the sample-ledger audit.

    python benchmarks/chaos.py                                 # 52 faults, seed 0: about an hour on 2 cores
    python benchmarks/chaos.py --faults 6 --steps 60 --json chaos.json

A ray.cluster_utils.Cluster on loopback, a head and three worker nodes of 1 CPU each, runs the job: 2
gloo workers of a tiny GPT, a checkpoint every 4 steps with the sample ledger, any number of failures
and preemptions allowed. It is elastic (min_workers = 1): a fixed-size job pins each worker to its
planned node, and one whose node is gone never starts again. The driver is `archipelago fit --address`
in a child process, so that it too can be killed. Each fault, drawn with the seed, strikes once the
group that recovered from the last one has trained `gap` more steps (3 to 10, drawn too):

  kill     SIGKILL one Ray Train worker process
  preempt  drain a worker's node with a preemption notice (10 s deadline); once the workers have
           committed on notice, remove the node and add a fresh one
  remove   remove a worker's node with no notice (its raylet and processes gone), add a fresh one
  driver   SIGKILL the driver (Ray ends the run's actors with it), then `archipelago fit --resume`

Then the same job runs uninterrupted on a fresh cluster of the same shape, and the report says:

  faults injected / survived  a fault is survived when training resumed after it
  committed steps lost        per fault, the newest committed step when it struck minus the step
                              training resumed from (0: no committed work redone)
  samples lost / repeated     the final checkpoint's ledger (storage/ledger.py) against the sampler's
                              stream for steps 1..N: ids missing from it, and ids trained too often
  loss                        every step's loss (its last, committed value) against the uninterrupted
                              run's, the largest relative difference

The goal (DESIGN.md): at least 50 faults, 0 committed steps and 0 samples lost or repeated, every loss
within 1e-4 of the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from storage.ledger import LEDGER_FILE, SampleLedger  # noqa: E402
from storage.prepare import prepare_dataset  # noqa: E402
from storage.sampler import DeterministicSampler  # noqa: E402
from storage.shards import TokenDataset  # noqa: E402
from workers import checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__import__("sysconfig").get_paths()["stdlib"]) / "email"
SEQ_LEN, GLOBAL_BATCH, EVERY = 64, 8, 4
KINDS = {"kill": 0.5, "preempt": 0.2, "remove": 0.2, "driver": 0.1}
"""Each fault's kind is drawn with these weights."""
DRAIN_DEADLINE_S = 10
DRIVER_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
"""For the driver, which hands them to Ray Train's controller: give up on a dead node's stale slot after
10 s (60 by default), and see a preemption notice within a second (5 by default)."""


JOB = """name = "{name}"
runs_dir = "{runs}"
[model]
n_layer = 1
n_head = 2
n_embd = 32
seq_len = {seq_len}
[data]
path = "{data}"
prepare_from = ""
[train]
steps = {steps}
global_batch_size = {batch}
micro_batch_size = 2
lr = 0.01
min_lr = 0.01
warmup_steps = 0
log_every = 1
eval_every = 100000
eval_samples = 8
[checkpoint]
every_steps = {every}
keep_last = 2
[cluster]
num_workers = 2
[elastic]
min_workers = 1
max_failures = -1
max_preemption_failures = -1
preemption_grace_s = 5.0
preemption_check_steps = 1
sample_ledger = true
"""


@dataclass
class Fault:
    kind: str
    at_step: int
    """The last step the run had reported when it struck."""
    committed: int
    """The newest committed checkpoint then."""
    resumed: int | None = None
    """The step training resumed from (None: it never did)."""
    detail: str = ""

    @property
    def committed_steps_lost(self) -> int:
        return max(0, self.committed - self.resumed) if self.resumed is not None else 0


@dataclass
class Run:
    """One `archipelago fit` child and the cluster it runs on."""

    cluster: Cluster
    job: Path
    run_dir: Path
    log: Path
    driver: subprocess.Popen | None = None
    invocations: int = 0
    spare_nodes: list = field(default_factory=list)

    def start(self, resume: bool) -> None:
        self.invocations += 1
        out = self.log.open("a")
        out.write(f"\n---- invocation {self.invocations}{' --resume' if resume else ''}\n")
        out.flush()
        self.driver = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "fit", str(self.job), "--address", self.cluster.address,
             *(["--resume"] if resume else [])], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **DRIVER_ENV, "PYTHONPATH": str(REPO), "COLUMNS": "1000"})

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        with contextlib.suppress(FileNotFoundError):
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return []

    def newest_committed(self) -> int:
        return max((int(p.parent.name.split("_")[1]) for p in self.run_dir.glob("step_*/.metadata")), default=0)

    def workers(self) -> dict[int, object]:
        """pid -> Ray node of every live Ray Train worker of this cluster (its raylet is its parent): the
        targets of kills and of node faults."""
        raylets = {node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: node
                   for node in [self.cluster.head_node, *self.cluster.worker_nodes]}
        found = {}
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                if not (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    continue
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent in raylets:
                    found[int(proc.name)] = raylets[parent]
        return found


def recover(run: Run, fault: Fault, lines: int, timeout_s: float = 900) -> None:
    """Blocks until a group has trained after `fault` (`lines`: the metrics rows before it struck) and
    sets the step it resumed from: the first restart row after the fault, or after a driver kill the new
    driver's `resuming from` line and then a step trained past it (the driver rewinds metrics.jsonl to
    that step first). Returns early if the run ends meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fault.resumed = resumed_step(run, fault, lines)
        if fault.resumed is not None and (fault.kind != "driver" or any(
                r.get("step") == fault.resumed + 1 and "loss" in r for r in run.rows())):
            return
        if run.driver.poll() is not None:
            return
        time.sleep(0.2)
    raise RuntimeError(f"no recovery within {timeout_s} s of fault {fault}; see {run.log}")


def loss_rows_after(run: Run, lines: int) -> int:
    return sum("loss" in row for row in run.rows()[lines:])


def strike(run: Run, fault: Fault, rng: random.Random) -> None:
    """Injects `fault`; returns once it has struck (and, for node faults, a fresh node is in). The newest
    committed step is read just before the blow: a preempted group goes on training until its node goes."""
    workers = run.workers()
    if fault.kind == "kill":
        pid = rng.choice(sorted(workers))
        fault.detail = f"pid {pid}"
        fault.committed = run.newest_committed()
        os.kill(pid, signal.SIGKILL)
    elif fault.kind == "driver":
        fault.detail = f"driver pid {run.driver.pid}"
        fault.committed = run.newest_committed()
        run.driver.kill()
        run.driver.wait()
        time.sleep(2.0)  # Ray notices the driver is gone and ends its actors
        run.start(resume=True)
    elif not (nodes := [node for node in set(workers.values()) if node is not run.cluster.head_node]):
        # The group shrank onto the head node, which stays: strike its worker instead.
        pid = rng.choice(sorted(workers))
        fault.kind, fault.detail = "kill", f"pid {pid} (drawn: {fault.kind}, but no worker on a worker node)"
        fault.committed = run.newest_committed()
        os.kill(pid, signal.SIGKILL)
    else:
        node = rng.choice(sorted(nodes, key=lambda n: n.node_id))
        fault.detail = f"node {node.node_id[:8]}"
        if fault.kind == "preempt":
            lines = len(run.rows())
            drain(run.cluster, node.node_id)
            deadline = time.monotonic() + DRAIN_DEADLINE_S + 30
            while not any(r.get("event") == "preemption" for r in run.rows()[lines:]):
                if time.monotonic() > deadline:
                    fault.detail += ", no preemption row (the group restarted at the deadline)"
                    break
                time.sleep(0.1)
        fault.committed = run.newest_committed()
        run.cluster.remove_node(node)
        run.cluster.add_node(num_cpus=1)


def resumed_step(run: Run, fault: Fault, lines: int) -> int | None:
    """The step the recovered group restored: the driver's `resuming from` line after a driver kill,
    else the first restart row after the fault."""
    if fault.kind == "driver":
        text = run.log.read_text().rsplit("---- invocation", 1)[-1]
        found = [line for line in text.splitlines() if line.startswith("resuming from ")]
        return int(found[0].rsplit("step_", 1)[1]) if found else None
    restart = next((r for r in run.rows()[lines:] if r.get("event") == "restart"), None)
    return restart["step"] if restart else None


def chaos(run: Run, faults: int, steps: int, rng: random.Random) -> list[Fault]:
    run.start(resume=False)
    done: list[Fault] = []
    lines, gap = 0, rng.randint(3, 10)
    while len(done) < faults and run.driver.poll() is None:
        rows = run.rows()
        last = max((r["step"] for r in rows if "loss" in r), default=0)
        if loss_rows_after(run, lines) < gap or last >= steps - 12 or not run.workers():
            time.sleep(0.05)
            continue
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        fault = Fault(kind, last, run.newest_committed())
        strike(run, fault, rng)
        recover(run, fault, len(rows))
        done.append(fault)
        print(f"fault {len(done):3d}: {fault.kind:<8} at step {fault.at_step:4d}, committed {fault.committed:4d}, "
              f"resumed {fault.resumed}  ({fault.detail})", flush=True)
        lines, gap = len(run.rows()), rng.randint(3, 10)
    if run.driver.wait() != 0:
        raise RuntimeError(f"the chaos run failed with {run.driver.returncode}; see {run.log}")
    return done


def drain(cluster: Cluster, node_id: str) -> None:
    """What a cloud's spot reclaim does through the autoscaler: drain the node with a deadline."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "spot reclaim (chaos)", int(time.time() * 1000) + DRAIN_DEADLINE_S * 1000)
    if not accepted:
        raise RuntimeError(f"drain refused: {why}")


def final_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss; a step trained twice (lost to a fault, redone) keeps its last, committed value."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def audit(run_dir: Path, num_samples: int, seed: int, steps: int) -> dict:
    """The final checkpoint's ledger against the sampler's stream: missing and repeated sample ids."""
    latest = max(run_dir.glob("step_*/.metadata")).parent
    ledger = SampleLedger.from_bytes(checkpoint.read_extra(latest, LEDGER_FILE))
    expected = Counter(DeterministicSampler(num_samples, seed).samples_at(0, steps * GLOBAL_BATCH).tolist())
    trained = Counter(ledger.stream().tolist())
    return {"ledger_steps_in_order": ledger.steps == list(range(1, steps + 1)),
            "samples_lost": sum((expected - trained).values()), "samples_repeated": sum((trained - expected).values()),
            "stream_exact": ledger.stream().tolist() == DeterministicSampler(num_samples, seed).samples_at(
                0, steps * GLOBAL_BATCH).tolist()}


def new_cluster() -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=52)
    parser.add_argument("--steps", type=int, default=700, help="[train] steps: room for the faults and their gaps")
    parser.add_argument("--seed", type=int, default=0, help="draws every fault's kind, moment and target")
    parser.add_argument("--json", type=Path, help="write the figures and every fault here too")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="archipelago-chaos-"))
    data = work / "data"
    prepare_dataset(str(CORPUS), data, val_percent=10.0, shard_tokens=64 * 1024, workers=1)
    num_samples = TokenDataset(data, "train", SEQ_LEN).num_samples
    started = time.monotonic()
    results = {}
    for name in ("chaos", "straight"):
        job = work / f"{name}.toml"
        job.write_text(JOB.format(name=name, runs=work / "runs", seq_len=SEQ_LEN, data=data, steps=args.steps,
                                  batch=GLOBAL_BATCH, every=EVERY))
        run = Run(new_cluster(), job, work / "runs" / name, work / f"{name}.log")
        try:
            if name == "chaos":
                results["faults"] = chaos(run, args.faults, args.steps, random.Random(args.seed))
            else:
                run.start(resume=False)
                if run.driver.wait() != 0:
                    raise RuntimeError(f"the uninterrupted run failed; see {run.log}")
        finally:
            if run.driver is not None and run.driver.poll() is None:  # the benchmark failed: stop its driver too
                run.driver.kill()
            run.cluster.shutdown()
        results[name] = final_losses(run.run_dir)
    faults: list[Fault] = results["faults"]
    checked = audit(work / "runs" / "chaos", num_samples, read_seed(work / "runs" / "chaos"), args.steps)
    chaos_losses, straight = results["chaos"], results["straight"]
    # A driver killed while its workers commit a checkpoint never receives the rows of that checkpoint's
    # last steps: they were trained and committed (the ledger has them), but metrics.jsonl has no loss.
    compared = sorted(set(straight) & set(chaos_losses))
    worst = max(abs(chaos_losses[s] / straight[s] - 1) for s in compared)
    summary = {
        "faults_injected": len(faults), "faults_survived": sum(f.resumed is not None for f in faults),
        "by_kind": dict(Counter(f.kind for f in faults)),
        "committed_steps_lost": sum(f.committed_steps_lost for f in faults),
        "samples_lost": checked["samples_lost"], "samples_repeated": checked["samples_repeated"],
        "ledger_stream_exact": checked["stream_exact"], "ledger_steps_in_order": checked["ledger_steps_in_order"],
        "steps_compared": len(compared), "steps_without_a_loss_row": sorted(set(straight) - set(chaos_losses)),
        "max_relative_loss_difference": worst, "wall_s": round(time.monotonic() - started),
    }
    goal = (summary["faults_injected"] >= 50 and summary["faults_survived"] == summary["faults_injected"]
            and summary["committed_steps_lost"] == 0 and summary["samples_lost"] == summary["samples_repeated"] == 0
            and checked["stream_exact"] and worst <= 1e-4)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; seed {args.seed}, {args.steps} steps, "
          f"{num_samples} training samples ({args.steps * GLOBAL_BATCH / num_samples:.2f} epochs)")
    for key, value in summary.items():
        print(f"  {key:<30} {value}")
    print(f"goal (>= 50 faults, all survived, 0 committed steps and 0 samples lost or repeated, losses within "
          f"1e-4): {'met' if goal else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "goal_met": goal,
                                         "faults": [asdict(f) for f in faults]}, indent=2))


def read_seed(run_dir: Path) -> int:
    """The [train] seed the run's checkpoints record (what the sampler's order came from)."""
    latest = max(run_dir.glob("step_*/.metadata")).parent
    return checkpoint.read_info(latest).seed


if __name__ == "__main__":
    main()
