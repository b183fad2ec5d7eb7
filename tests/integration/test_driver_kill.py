"""The driver — `archipelago fit` with its embedded Ray cluster — killed while the workers write a
checkpoint: `--resume` loads the previous committed step, never the half-written one, and the run
finishes with the lost step committed again.

The first run's processes fsync checkpoint files slowly (slow_fsync/sitecustomize.py, on their
PYTHONPATH): a step directory exists for at least a second before `.metadata`, which is written last,
so the test sees it mid-write however small the model. At that moment it freezes (SIGSTOP) and then
SIGKILLs the driver and every process under it — Ray's raylet and the workers it started — as a
machine losing power would; a plain kill of the driver alone lets Ray's reaper stop the workers with
a second of grace, in which they finish the write.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.checkpoint import read_info

pytestmark = pytest.mark.integration
ARCHIPELAGO = [sys.executable, "-m", "orchestrator.cli"]
REPO = Path(__file__).resolve().parents[2]
SLOW_FSYNC = Path(__file__).resolve().parent / "slow_fsync"
FSYNC_DELAY_S = 0.2
"""Each checkpoint fsync of the first run: its step directory lacks .metadata for at least 5 × this."""
STEPS, EVERY = 8, 2


def write_job(path: Path, dataset_dir: Path, runs_dir: Path) -> Path:
    path.write_text(f"""
name = "driver-kill"
runs_dir = "{runs_dir}"
[model]
n_layer = 1
n_head = 2
n_embd = 32
seq_len = 32
[data]
path = "{dataset_dir}"
prepare_from = ""
[train]
steps = {STEPS}
global_batch_size = 8
micro_batch_size = 2
lr = 1e-3
min_lr = 1e-3
warmup_steps = 0
log_every = 1
eval_every = 1000
eval_samples = 8
[checkpoint]
every_steps = {EVERY}
keep_last = 10
[cluster]
num_workers = 2
""")
    return path


def fit(job: Path, *extra: str, fsync_delay_s: float = 0.0) -> subprocess.Popen:
    # Wide enough that rich prints each path on one line.
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}
    if fsync_delay_s:
        env.update(PYTHONPATH=os.pathsep.join([str(SLOW_FSYNC), str(REPO)]),
                   ARCHIPELAGO_TEST_FSYNC_DELAY_S=str(fsync_delay_s))
    return subprocess.Popen([*ARCHIPELAGO, "fit", str(job), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_during_a_write(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 300) -> int:
    """Kills the driver and everything under it once a step directory after the first committed one
    exists without its .metadata; returns that step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        committed = {int(p.parent.name.split("_")[1]) for p in run_dir.glob("step_*/.metadata")}
        for step_dir in sorted(run_dir.glob("step_*")):
            step = int(step_dir.name.split("_")[1])
            if committed and step > max(committed) and not (step_dir / ".metadata").exists():
                tree = [proc.pid, *descendants(proc.pid)]
                for sig in (signal.SIGSTOP, signal.SIGKILL):
                    for pid in tree:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, sig)
                proc.wait()
                return step
        time.sleep(0.002)
    proc.kill()
    pytest.fail(f"no checkpoint write was caught (fit exited with {proc.poll()}):\n{proc.stdout.read()[-3000:]}")


def test_a_driver_killed_mid_checkpoint_resumes_from_the_previous_committed_step(dataset_dir, tmp_path):
    runs_dir = tmp_path / "runs"
    job = write_job(tmp_path / "job.toml", dataset_dir, runs_dir)
    run_dir = runs_dir / "driver-kill"
    first = fit(job, fsync_delay_s=FSYNC_DELAY_S)
    caught = kill_during_a_write(first, run_dir)
    time.sleep(1.0)
    assert not (run_dir / f"step_{caught:08d}" / ".metadata").exists(), "the write finished: nothing was caught"
    previous = caught - EVERY
    assert (run_dir / f"step_{previous:08d}" / ".metadata").exists()

    second = fit(job, "--resume")
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-3000:]
    assert f"resuming from {run_dir / f'step_{previous:08d}'}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # the killed run's rows after `previous` were rewound
    assert read_info(run_dir / f"step_{caught:08d}").step == caught  # written again, and committed
    assert read_info(run_dir / f"step_{STEPS:08d}").consumed_samples == STEPS * 8
