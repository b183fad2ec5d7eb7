"""Secrets stay secret: S3 keys and the Ray auth token appear in nothing the run writes or prints.

`archipelago fit` runs as a user would start it, in a child process: an embedded Ray cluster with
token authentication on (RAY_AUTH_MODE=token, the token in RAY_AUTH_TOKEN), checkpoints in
conftest.py's moto S3 with the keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. Then `archipelago
report` writes the HTML report. Every file of the run directory (metrics, bill, plan.json,
report.json, report.html, TensorBoard events), every checkpoint object in S3, both commands' output
and every file of Ray's session (its logs: driver, controller, workers) is searched for each secret.
A URI that carries keys itself is refused, without echoing them.
"""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from core.errors import CheckpointError
from storage.fs import Location
from tests.integration.conftest import job
from tests.integration.test_driver_kill import write_job

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SECRETS = {"AWS_ACCESS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(), "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
           "RAY_AUTH_TOKEN": secrets.token_hex(24)}


def cli(*args: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def leaks(data: bytes) -> list[str]:
    return [name for name, value in SECRETS.items() if value.encode() in data]


def test_s3_keys_and_the_ray_token_appear_in_no_output_file_or_log(s3_server, small_dataset, tmp_path):
    root, _ = s3_server
    storage = root / "secret-run"
    config = job(small_dataset, tmp_path / "runs", "secrets", 4, checkpoint={"every_steps": 2, "storage": str(storage)})
    # Ray's files under a short directory of their own (its socket paths must stay short), searched after.
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = {**os.environ, **SECRETS, "RAY_AUTH_MODE": "token", "RAY_TMPDIR": str(ray_dir), "PYTHONPATH": str(REPO),
           "COLUMNS": "1000"}
    try:
        printed = cli("fit", str(write_job(tmp_path / "job.toml", config)), env=env)
        printed += cli("report", str(tmp_path / "runs" / "secrets"), env=env)
        assert "step 4: checkpoint committed" in printed and "report.html" in printed
        files = [p for p in [*(tmp_path / "runs").rglob("*"), *ray_dir.rglob("*")] if p.is_file()]
        assert any(p.name == "report.html" for p in files) and any("raylet" in p.name for p in files)
        objects = [i for i in storage.fs.get_file_info(pafs.FileSelector(storage.path, recursive=True))
                   if i.type == pafs.FileType.File]
        assert any(i.base_name == ".metadata" for i in objects)  # the checkpoints went to S3, with the keys
        assert leaks(printed.encode()) == []
        assert {str(p): leaks(p.read_bytes()) for p in files if leaks(p.read_bytes())} == {}
        assert {i.path: leaks(storage.fs.open_input_file(i.path).read()) for i in objects
                if leaks(storage.fs.open_input_file(i.path).read())} == {}
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_uri_with_keys_in_it_is_refused_without_echoing_them():
    key, secret = SECRETS["AWS_ACCESS_KEY_ID"], SECRETS["AWS_SECRET_ACCESS_KEY"]
    with pytest.raises(CheckpointError, match="the URI holds credentials") as info:
        Location.parse(f"s3://{key}:{secret}@bucket/runs?region=us-east-1", error=CheckpointError)
    assert info.value.where == "s3://***@bucket/runs?region=us-east-1" and "AWS_SECRET_ACCESS_KEY" in info.value.fix
    assert leaks(str(info.value).encode()) == []
