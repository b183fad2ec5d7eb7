"""Recovery from a killed worker: archipelago against Ray Train's own restart of the same loop, same run.

    python benchmarks/recovery.py                      # one kill each, a few minutes on 2 cores, CPU only
    python benchmarks/recovery.py --repeats 3 --json recovery.json

Both sides train the same tiny GPT (workers/models/gpt.py) with DDP over gloo on 2 CPU workers of
a local Ray cluster started here, checkpoint every --every steps, and have worker rank 1 killed
(SIGKILL) at step --kill-at. Measured: the time from the kill to the end of the first step the
restarted workers complete.

- archipelago: `Orchestrator.fit()`; the split comes from its restart event (orchestrator/coordinator.py):
  detection (kill → Ray Train's controller reports the failure), startup (→ the new workers' train
  function starts: Ray tears the group down and starts it again, process group included), re-plan,
  setup (model, engine, checkpoint group), restore (DCP load) and first step ("recompile": the first
  step after the restore, compile and warm-up included; eager here).
- plain Ray Train: `TorchTrainer` with a train function that builds the same model, wraps it in DDP,
  checkpoints with `ray.train.report(checkpoint=…)` (torch.save of model and optimizer) and restores
  from `ray.train.get_checkpoint()`; inputs are random tokens (no data pipeline to restore). It has
  no re-plan and no sampler position: it restarts with the same size and restores only the weights.

Lost committed steps: the newest committed checkpoint when the kill happened minus the step the
restarted workers resumed from (the target is 0 for archipelago; the plain loop reports it too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
import ray  # noqa: E402
import torch  # noqa: E402

from core.config import JobConfig  # noqa: E402
from orchestrator import Orchestrator  # noqa: E402
from orchestrator.coordinator import COORDINATOR_NAME  # noqa: E402
from storage.prepare import prepare_dataset  # noqa: E402

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64}
CORPUS = Path(__import__("sysconfig").get_paths()["stdlib"]) / "email"


def job(data_dir: Path, runs_dir: Path, name: str, steps: int, every: int) -> JobConfig:
    return JobConfig.from_dict({
        "name": name, "runs_dir": str(runs_dir), "model": MODEL,
        "data": {"path": str(data_dir), "prepare_from": ""},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 4, "warmup_steps": 0,
                  "log_every": 1, "eval_every": 10_000, "eval_samples": 8},
        "checkpoint": {"every_steps": every, "keep_last": 2},
        "cluster": {"num_workers": 2}, "elastic": {"max_failures": 2}})


# ---- archipelago -----------------------------------------------------------------------------------
def run_archipelago(data_dir: Path, runs_dir: Path, name: str, steps: int, every: int, kill_at: int) -> dict:
    kill: dict = {}

    def watch() -> None:
        coordinator = None
        while not kill:
            try:
                coordinator = coordinator or ray.get_actor(COORDINATOR_NAME.format(name))
                status = ray.get(coordinator.status.remote())
            except ValueError:
                time.sleep(0.05)
                continue
            if status["last_step"] >= kill_at:
                kill["committed"] = newest_committed(runs_dir / name)
                kill["time"] = time.time()
                os.kill(status["workers"][1]["pid"], signal.SIGKILL)
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    result = Orchestrator(job(data_dir, runs_dir, name, steps, every)).fit()
    lost = next(r for r in result.metrics if r.get("event") == "worker_lost")
    restart = next(r for r in result.metrics if r.get("event") == "restart")
    detect = lost["time"] - kill["time"]
    return {"total_s": restart["time"] - kill["time"], "detect_s": detect,
            "startup_s": restart["startup_s"], "replan_s": restart["replan_s"], "setup_s": restart["setup_s"],
            "restore_s": restart["restore_s"], "recompile_s": restart["recompile_s"],
            "lost_committed_steps": kill["committed"] - restart["step"], "steps_redone": restart["steps_redone"]}


def newest_committed(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in run_dir.glob("step_*") if (p / ".metadata").exists()]
    return max(steps, default=0)


# ---- plain Ray Train ---------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class Timeline:
    """Where the plain loop's workers say what they did (the benchmark's only instrument in that loop)."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def all(self) -> list[dict]:
        return list(self.rows)


def plain_train_loop(config: dict) -> None:
    import tempfile as tmp

    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from core.config import ModelConfig
    from workers.models.gpt import GPT

    entered = time.time()
    timeline, rank = config["timeline"], ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    restore_start = time.time()
    found = ray.train.get_checkpoint()
    if found:
        with found.as_directory() as directory:
            state = torch.load(Path(directory) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    restored = time.time()
    ddp = DistributedDataParallel(model)
    if rank == 0:
        timeline.add.remote({"event": "start", "step": step, "pid": os.getpid(), "entered": entered,
                             "restore_start": restore_start, "restored": restored})
    if rank == 1:
        timeline.add.remote({"event": "rank1", "pid": os.getpid()})
    while step < config["steps"]:
        generator = torch.Generator().manual_seed(step * 2 + rank)
        tokens = torch.randint(0, MODEL.get("vocab_size", 257), (4, MODEL["seq_len"] + 1), generator=generator)
        ddp(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0:
            timeline.add.remote({"event": "step", "step": step, "time": time.time()})
        checkpoint = None
        if step % config["every"] == 0:
            with tmp.TemporaryDirectory() as directory:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                               Path(directory) / "state.pt")
                    checkpoint = ray.train.Checkpoint.from_directory(directory)
                ray.train.report({"step": step}, checkpoint=checkpoint)
            if rank == 0:
                timeline.add.remote({"event": "committed", "step": step, "time": time.time()})
        dist.barrier()


def run_plain(storage: Path, steps: int, every: int, kill_at: int) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig, UserCallback
    from ray.train.torch import TorchConfig, TorchTrainer

    timeline = Timeline.remote()

    class Detected(UserCallback):
        def __init__(self, timeline):
            self.timeline = timeline

        def after_exception(self, run_context, worker_exceptions) -> None:
            self.timeline.add.remote({"event": "detected", "time": time.time()})

    kill: dict = {}

    def watch() -> None:
        while not kill:
            rows = ray.get(timeline.all.remote())
            steps_done = [r["step"] for r in rows if r["event"] == "step"]
            pids = [r["pid"] for r in rows if r["event"] == "rank1"]
            if steps_done and steps_done[-1] >= kill_at and pids:
                kill["committed"] = max([r["step"] for r in rows if r["event"] == "committed"], default=0)
                kill["time"] = time.time()
                os.kill(pids[-1], signal.SIGKILL)
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    trainer = TorchTrainer(plain_train_loop, train_loop_config={"timeline": timeline, "steps": steps, "every": every},
                           torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="plain", storage_path=str(storage),
                                                failure_config=FailureConfig(max_failures=2),
                                                callbacks=[Detected(timeline)]))
    trainer.fit()
    rows = ray.get(timeline.all.remote())
    detected = next(r["time"] for r in rows if r["event"] == "detected" and r["time"] >= kill["time"])
    start = [r for r in rows if r["event"] == "start"][1]  # the restarted group's
    first = next(r for r in rows if r["event"] == "step" and r["time"] > start["restored"])
    return {"total_s": first["time"] - kill["time"], "detect_s": detected - kill["time"],
            "startup_s": start["entered"] - detected, "replan_s": 0.0,
            "setup_s": start["restore_start"] - start["entered"], "restore_s": start["restored"] - start["restore_start"],
            "recompile_s": first["time"] - start["restored"],
            "lost_committed_steps": kill["committed"] - start["step"], "steps_redone": None}


# ---- report ----------------------------------------------------------------------------------------------
PARTS = ("detect_s", "startup_s", "replan_s", "setup_s", "restore_s", "recompile_s", "total_s")


def summarise(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in (*PARTS, "lost_committed_steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="kills per side (medians are reported)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=12, help="kill rank 1 once this step is done")
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="archipelago-recovery-"))
    data_dir = work / "data"
    prepare_dataset(str(CORPUS), data_dir, val_percent=10.0, shard_tokens=64 * 1024)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ours, plain = [], []
    try:
        for i in range(args.repeats):
            ours.append(run_archipelago(data_dir, work / "runs", f"recovery-{i}", args.steps, args.every, args.kill_at))
            plain.append(run_plain(work / f"plain-{i}", args.steps, args.every, args.kill_at))
    finally:
        ray.shutdown()
    a, p = summarise(ours), summarise(plain)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only; a local Ray "
          f"cluster (ray.init num_cpus=2) with 2 gloo workers; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"model {MODEL}, global batch 8, checkpoint every {args.every} steps, rank 1 SIGKILLed after step "
          f"{args.kill_at}; medians of {args.repeats} kill(s) per side\n")
    print(f"{'seconds':<12}" + "".join(f"{k.removesuffix('_s'):>11}" for k in PARTS) + f"{'lost steps':>12}")
    for label, s in (("archipelago", a), ("plain Ray", p)):
        print(f"{label:<12}" + "".join(f"{s[k]:>11.2f}" for k in PARTS) + f"{s['lost_committed_steps']:>12.0f}")
    met = a["total_s"] <= p["total_s"] and all(r["lost_committed_steps"] == 0 for r in ours)
    print(f"\ntarget (archipelago kill → first new step no slower than plain Ray Train's, 0 lost committed "
          f"steps): {'met' if met else 'NOT met'} ({a['total_s']:.2f} s vs {p['total_s']:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps({"archipelago": ours, "plain": plain, "target_met": met}, indent=2))


if __name__ == "__main__":
    main()
