"""`ray job submit` against a head with token authentication, end to end on loopback.

A module fixture starts `ray start --head --block` on 127.0.0.1 with RAY_AUTH_MODE=token, its own
token file, free ports, a temp dir and a temp HOME (the user's ~/.ray is never read or written).
The tests submit an 11-step copy of examples/cpu-tiny.toml through the Jobs API with the token and
watch it train, and show that the same API refuses a request without the token (HTTP 401) or with
a wrong one (HTTP 403). About a minute on two cores, most of it Ray starting processes.

    .venv/bin/python -m pytest tests/integration/test_job_submit.py
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from core.config import JobConfig

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: `ray` and `archipelago`
STEPS = 11  # cpu-tiny trains 300 steps (~3 min); 11 show the same path: a progress line at step 10, then the end


@dataclass(frozen=True)
class Head:
    address: str
    token: str
    root: Path

    def authorized(self) -> JobSubmissionClient:
        return JobSubmissionClient(self.address, headers={"Authorization": f"Bearer {self.token}"})


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free on loopback (held together so that they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def head_environment(root: Path, **auth: str) -> dict[str, str]:
    """The caller's environment minus any Ray address or token, with HOME in our temp dir."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(root / "home"), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               RAY_USAGE_STATS_ENABLED="0", **auth)
    return env


@pytest.fixture(scope="module")
def head():
    # Short path under /tmp: Ray puts unix sockets under its temp dir (108-byte limit).
    root = Path(tempfile.mkdtemp(prefix="arch-auth-", dir="/tmp"))
    (root / "home").mkdir()
    token = secrets.token_hex(32)
    token_file = root / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(7)
    command = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
               f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
               "--num-cpus=4", f"--temp-dir={root / 'ray'}", "--disable-usage-stats"]
    # No drain wait on SIGTERM (a Serve feature; it would hold teardown for its whole timeout).
    env = head_environment(root, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file),
                           RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    with open(root / "head.log", "w") as log:
        # Its own session, so teardown signals exactly this head and what it started.
        process = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_jobs_api(address, token, process, root / "head.log")
        yield Head(address=address, token=token, root=root)
    finally:
        stop_head(process, root)
        shutil.rmtree(root, ignore_errors=True)


def wait_for_jobs_api(address: str, token: str, process: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"ray start exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"}, timeout=2).ok:
                return
        except requests.RequestException:  # not listening yet, or too slow on a loaded machine
            pass
        time.sleep(0.5)
    pytest.fail(f"the Jobs API at {address} did not answer within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def stop_head(process: subprocess.Popen, root: Path) -> None:
    """SIGTERM to our `ray start --block`, which stops the GCS, raylet, dashboard and workers it
    started; then SIGKILL to whatever is left of its process group and of the processes naming our
    temp dir. Not `ray stop`, which stops every Ray process on the machine, other people's too."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in processes_mentioning(str(root)):  # stragglers that left the group; ours name our temp dir
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def short_cpu_tiny(work_dir: Path, runs_dir: Path, dataset_dir: Path) -> Path:
    """examples/cpu-tiny.toml with STEPS steps, a prepared test dataset and runs_dir outside the repo."""
    text = (REPO / "examples" / "cpu-tiny.toml").read_text()
    text = f'runs_dir = "{runs_dir}"\n' + text
    text = re.sub(r'(?m)^steps = \d+', f"steps = {STEPS}", text)
    text = re.sub(r'(?m)^path = ".*"', f'path = "{dataset_dir}"', text)
    text = re.sub(r'(?m)^prepare_from = ".*"', 'prepare_from = ""', text)
    path = work_dir / "job.toml"
    path.write_text(text)
    config = JobConfig.from_toml(path)  # the edits took: a changed example fails here, not in the job
    assert (config.name, config.train.steps, config.runs_dir, config.data.path) == \
        ("cpu-tiny", STEPS, str(runs_dir), str(dataset_dir))
    return path


def submit_when_an_agent_is_up(client: JobSubmissionClient, timeout_s: float = 90, **job) -> str:
    """submit_job, again while the head answers 500 "No available agent to submit job, please try again
    later": the Jobs API listens before the head's dashboard agent has registered (seen on a loaded
    2-core machine), and Ray says to retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def wait_for_job(client: JobSubmissionClient, job_id: str, timeout_s: float = 240) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        time.sleep(0.25)
    client.stop_job(job_id)
    pytest.fail(f"job {job_id} still {status} after {timeout_s:.0f} s:\n{client.get_job_logs(job_id)[-3000:]}")


def test_a_submit_with_the_token_trains_the_job(head, dataset_dir, tmp_path):
    work_dir, runs_dir = tmp_path / "work", tmp_path / "runs"
    work_dir.mkdir()
    short_cpu_tiny(work_dir, runs_dir, dataset_dir)
    client = head.authorized()
    # working_dir travels through the authenticated package upload, as with `ray job submit --working-dir`.
    job_id = submit_when_an_agent_is_up(client, entrypoint="archipelago fit job.toml",
                                        runtime_env={"working_dir": str(work_dir)})
    status = wait_for_job(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    # The driver's progress lines, as the user sees them in `ray job logs`.
    for line in (f"step 10/{STEPS}", f"step {STEPS}: validation loss", f"step {STEPS}: checkpoint committed",
                 "completed"):
        assert line in logs, logs[-3000:]
    run_dir = runs_dir / "cpu-tiny"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, STEPS + 1))
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["status"], report["final_step"], report["world_size"]) == ("completed", STEPS, 2)
    assert (run_dir / f"step_{STEPS:08d}" / ".metadata").is_file()
    assert not (REPO / "runs" / "cpu-tiny" / f"step_{STEPS:08d}").exists()


def test_the_jobs_api_refuses_a_submit_without_the_token(head):
    # The CLI as a user without the token runs it: no RAY_AUTH_* and a HOME with no ~/.ray.
    (head.root / "stranger").mkdir(exist_ok=True)
    env = head_environment(head.root)
    env["HOME"] = str(head.root / "stranger")
    cli = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", head.address, "--", "echo", "intruder"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0
    assert "Authentication required" in cli.stdout + cli.stderr, cli.stdout + cli.stderr
    # The HTTP API itself: no token is 401, a wrong token is 403; nothing is listed or run.
    assert requests.post(f"{head.address}/api/jobs/", json={"entrypoint": "echo intruder"}, timeout=10).status_code == 401
    assert requests.get(f"{head.address}/api/jobs/", timeout=10).status_code == 401
    with pytest.raises(AuthenticationError, match="Authentication failed"):
        JobSubmissionClient(head.address, headers={"Authorization": "Bearer " + secrets.token_hex(32)})
    assert not [job for job in head.authorized().list_jobs() if "intruder" in job.entrypoint]
