"""The driver — `archipelago fit` with its embedded Ray cluster — killed while the workers write a
checkpoint: `--resume` (with [train] steps raised, as to train longer) loads the previous committed
step, never the half-written one, and the run finishes with the lost step committed again, every
step's loss the same as in conftest.py's uninterrupted `straight` run of the same job.

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
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.accounting.report_html import PLOTS, render_report
from tests.conftest import write_job
from tests.integration.conftest import SEQ_LEN, job
from topology import ray_processes
from workers.checkpoint import read_info

pytestmark = pytest.mark.integration
ARCHIPELAGO = [sys.executable, "-m", "orchestrator.cli"]
REPO = Path(__file__).resolve().parents[2]
SLOW_FSYNC = Path(__file__).resolve().parent / "slow_fsync"
FSYNC_DELAY_S = 0.2
"""Each checkpoint fsync of the first run: its step directory lacks .metadata for at least 5 × this."""
STEPS, EVERY = 8, 2
"""The first run's [train] steps (it is killed long before the end) and [checkpoint] every_steps."""
RESUMED_STEPS = 12
"""[train] steps for --resume: raised, as a user who trains longer does."""


def fit(job: Path, *extra: str, fsync_delay_s: float = 0.0, marker: str = "") -> subprocess.Popen:
    """`archipelago fit` in a process of its own; `marker` goes into its environment, which every process it
    starts (Ray's, the workers) inherits: `processes_marked` finds them."""
    # Wide enough that rich prints each path on one line.
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000", "ARCHIPELAGO_TEST_MARKER": marker}
    env.pop("RAY_AUTH_MODE", None)  # as a user's shell has it; Ray sets it in this process when a test starts Ray
    if fsync_delay_s:
        env.update(PYTHONPATH=os.pathsep.join([str(SLOW_FSYNC), str(REPO)]),
                   ARCHIPELAGO_TEST_FSYNC_DELAY_S=str(fsync_delay_s))
    return subprocess.Popen([*ARCHIPELAGO, "fit", str(job), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def processes_marked(marker: str, wait_s: float = 3.0) -> list[str]:
    """The command lines of live processes whose environment holds `marker`, after up to `wait_s` for them to go.
    fit itself waits for its embedded cluster's processes and kills stragglers (topology/ray_processes.py): the
    few seconds are for the killed ones' reaping."""
    needle = f"ARCHIPELAGO_TEST_MARKER={marker}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            with contextlib.suppress(OSError):
                if needle in environ.read_bytes().split(b"\0"):
                    found.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def reported_checkpoint(run_dir: Path) -> int | None:
    """The committed step report.json names. The driver hears of a commit when the workers next send their
    rows (an async save is reported as the next one starts) and polls twice a second: the kill waits for it."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / "report.json").read_text()).get("checkpoint_step")
    return None


def kill_during_a_write(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 300) -> int:
    """Kills the driver and everything under it once a step directory after the first committed one
    exists without its .metadata (and report.json has heard of a commit); returns that step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        committed = {int(p.parent.name.split("_")[1]) for p in run_dir.glob("step_*/.metadata")}
        for step_dir in sorted(run_dir.glob("step_*")):
            step = int(step_dir.name.split("_")[1])
            if (committed and step > max(committed) and not (step_dir / ".metadata").exists()
                    and reported_checkpoint(run_dir) is not None):
                tree = [proc.pid, *(p.pid for p in ray_processes.descendants(proc.pid))]
                for sig in (signal.SIGSTOP, signal.SIGKILL):
                    for pid in tree:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, sig)
                proc.wait()
                return step
        time.sleep(0.002)
    proc.kill()
    pytest.fail(f"no checkpoint write was caught (fit exited with {proc.poll()}):\n{proc.stdout.read()[-3000:]}")


@pytest.fixture(scope="module")
def killed_and_resumed(small_dataset, tmp_path_factory):
    """The first run killed mid-write (the step it was writing), then the output of `fit --resume` with
    RESUMED_STEPS steps."""
    work = tmp_path_factory.mktemp("driver-kill")
    run_dir = work / "runs" / "driver-kill"

    def job_file(steps: int) -> Path:
        """The straight run's job (its losses are the reference), with a checkpoint every EVERY steps, all kept."""
        config = job(small_dataset, work / "runs", "driver-kill", steps,
                     checkpoint={"every_steps": EVERY, "keep_last": 10})
        return write_job(work / f"job-{steps}.toml", config)
    caught = kill_during_a_write(fit(job_file(STEPS), fsync_delay_s=FSYNC_DELAY_S), run_dir)
    time.sleep(1.0)
    committed_after_the_kill = sorted(p.parent.name for p in run_dir.glob("step_*/.metadata"))
    report_after_the_kill = render_report([run_dir], work / "report-after-the-kill")
    marker = f"driver-kill-{os.getpid()}-{time.monotonic_ns()}"
    second = fit(job_file(RESUMED_STEPS), "--resume", marker=marker)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-3000:]
    return run_dir, caught, committed_after_the_kill, out, report_after_the_kill, processes_marked(marker)


def test_a_run_killed_without_warning_can_be_reported(killed_and_resumed):
    """fit rewrote report.json at every committed checkpoint: the killed run's report names the last one."""
    _, caught, _, _, rendered, _ = killed_and_resumed
    page = rendered.html.read_text()
    assert "<td>status</td><td>running: written at its last committed checkpoint" in page
    assert len(rendered.plots) == len(PLOTS)
    steps = re.search(r"<td>steps</td><td>0 → (\d+)</td>", page)
    assert steps and EVERY <= int(steps.group(1)) <= caught  # the rows it heard of: up to the step being written
    assert f"step_{caught - EVERY:08d}" in page  # the checkpoint the killed run had committed


def test_a_driver_killed_mid_checkpoint_resumes_from_the_previous_committed_step(killed_and_resumed):
    run_dir, caught, committed_after_the_kill, out, _, _ = killed_and_resumed
    previous = caught - EVERY
    assert f"step_{caught:08d}" not in committed_after_the_kill, "the write finished: nothing was caught"
    assert committed_after_the_kill[-1] == f"step_{previous:08d}"
    assert f"resuming from {run_dir / f'step_{previous:08d}'}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, RESUMED_STEPS + 1))  # the killed run's rows after `previous` were rewound
    assert read_info(run_dir / f"step_{caught:08d}").step == caught  # written again, and committed
    assert read_info(run_dir / f"step_{RESUMED_STEPS:08d}").consumed_samples == RESUMED_STEPS * 8


def test_resume_continues_exactly_where_an_uninterrupted_run_would_be(killed_and_resumed, straight):
    run_dir, caught, _, _, _, _ = killed_and_resumed
    previous = caught - EVERY
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in rows if r.get("event") == "start"]
    assert [(r["step"], r["consumed_samples"]) for r in starts] == [(0, 0), (previous, previous * 8)]  # one per invocation
    expected = {r["step"]: r["loss"] for r in straight.result.metrics if "loss" in r}
    for row in (r for r in rows if "loss" in r):  # same weights, optimizer state and samples ⇒ the same losses
        assert row["loss"] == pytest.approx(expected[row["step"]], rel=1e-5), row["step"]
    report = json.loads((run_dir / "report.json").read_text())  # the resumed invocation's
    assert (report["start_step"], report["final_step"]) == (previous, RESUMED_STEPS)
    assert report["tokens_seen"] == RESUMED_STEPS * 8 * SEQ_LEN
    assert report["tokens_this_run"] == (RESUMED_STEPS - previous) * 8 * SEQ_LEN
    assert report["run_dollars"] > report["dollars"] > 0  # the killed invocation was paid for too


def test_the_embedded_cluster_starts_without_ray_alarming_about_its_token_authentication(killed_and_resumed):
    out = killed_and_resumed[3]
    assert "Token authentication" not in out, out[-3000:]


def test_no_ray_process_outlives_fit(killed_and_resumed):
    """The resumed fit started its embedded Ray cluster (GCS, raylet, the controller, the workers); when it exits,
    every one of them is gone."""
    assert killed_and_resumed[-1] == []


def test_sigterm_stops_the_workers_and_keeps_the_rows_of_every_committed_step(small_dataset, tmp_path_factory):
    """A scheduler's SIGTERM ends fit as Ctrl-C does: Ray Train's controller aborts the workers before Ray shuts
    down, the rows they sent reach metrics.jsonl (every step up to the last committed one), the report says
    interrupted, the --resume line is printed, and no Ray process is left."""
    work = tmp_path_factory.mktemp("sigterm")
    run_dir = work / "runs" / "sigterm"
    config = job(small_dataset, work / "runs", "sigterm", 400, checkpoint={"every_steps": EVERY, "keep_last": 2})
    path = write_job(work / "job.toml", config)
    marker = f"sigterm-{os.getpid()}-{time.monotonic_ns()}"
    proc = fit(path, marker=marker)
    deadline = time.monotonic() + 300
    while (reported_checkpoint(run_dir) or 0) < 2 * EVERY and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out[-3000:]
    assert f"interrupted; `archipelago fit {path} --resume` continues from the last committed checkpoint" in out
    committed = max(int(p.parent.name.split("_")[1]) for p in run_dir.glob("step_*/.metadata"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"] for r in rows if "loss" in r}
    assert set(range(1, committed + 1)) <= steps, (committed, sorted(steps))
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["checkpoint_step"] == committed
    assert processes_marked(marker) == []
