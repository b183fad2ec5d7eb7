"""A process killed (SIGKILL) in the middle of writing a checkpoint, or a disk that fills while it is
written, leaves the previous committed one loadable and the new one uncommitted."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from storage.checkpoint_io import CheckpointStore, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
ELEMENTS = 16 * 2**20  # 4 × 64 MiB of float32, written and fsynced: long enough to be caught mid-write


def state(value: float) -> dict:
    return {f"w{i}": torch.full((ELEMENTS,), value + i) for i in range(4)}


def save_two_steps(root: str, async_save: bool) -> None:
    torch.set_num_threads(1)
    store = CheckpointStore(root)
    save_checkpoint(state(1.0), store.step(1), extra={"archipelago.json": b'{"step": 1}'}).result()
    pending = save_checkpoint(state(2.0), store.step(2), extra={"archipelago.json": b'{"step": 2}'},
                              async_save=async_save)
    pending.result()
    os._exit(0)


def data_bytes_in_flight(step_dir) -> int:
    """Bytes written so far to the step's data files (temporary names until each is complete)."""
    if not step_dir.is_dir():
        return 0
    return sum(p.stat().st_size for p in step_dir.iterdir() if "distcp" in p.name)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill_mid_save_then_load_the_previous_step(tmp_path, async_save):
    saver = multiprocessing.get_context("fork").Process(target=save_two_steps, args=(str(tmp_path), async_save))
    saver.start()
    step2 = tmp_path / "step_00000002"
    deadline = time.monotonic() + 120
    while data_bytes_in_flight(step2) < 8 * 2**20:  # step 2's data is being written
        assert saver.is_alive() and time.monotonic() < deadline, "the save finished before it could be killed"
        time.sleep(0.001)
    os.kill(saver.pid, signal.SIGKILL)
    saver.join()
    assert saver.exitcode == -signal.SIGKILL

    store = CheckpointStore(tmp_path)
    assert step2.is_dir() and not (step2 / ".metadata").exists()  # half written
    assert [s for s, _ in store.committed()] == [1] and store.latest() == store.step(1)
    target = {f"w{i}": torch.zeros(ELEMENTS) for i in range(4)}
    load_checkpoint(target, store.latest())
    assert all(torch.equal(target[f"w{i}"], torch.full((ELEMENTS,), 1.0 + i)) for i in range(4))
    assert store.remove_uncommitted() == [store.step(2)] and not step2.exists()


def in_a_mount_namespace(script: str, root: Path):
    """Runs `script` with `root` (made here) as its argument in a child with its own user and mount namespace, where
    it may mount a filesystem there without privileges; returns the JSON the child printed last."""
    root.mkdir()
    child = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", script,
                            str(root)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


FULL_DISK = r"""
import json, os, subprocess, sys
import torch
from core.errors import CheckpointError
from storage.checkpoint_io import CheckpointStore, is_committed, load_checkpoint, save_checkpoint

root = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", root], check=True)
store, ballast = CheckpointStore(root), os.path.join(root, "ballast")
state = lambda value: {"w": torch.full((40_000,), value), "b": torch.full((3_000,), value)}  # noqa: E731
extra = {"archipelago.json": b'{"step": 0}'}
save_checkpoint(state(1.0), store.step(1), extra=extra).result()
free = lambda: os.statvfs(root).f_bavail * os.statvfs(root).f_frsize  # noqa: E731
rows = []
for async_save in (False, True):
    for left in range(0, 200 * 1024, 4096):  # bytes left free when step 2 is saved: none to more than it needs
        with open(ballast, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free() - left)
        row = {"left": left, "async": async_save}
        try:
            save_checkpoint(state(2.0), store.step(2), extra=extra, async_save=async_save).result()
        except CheckpointError as e:
            row.update(error=e.what, file=os.path.basename(e.where), fix=e.fix)
        row["committed"] = [step for step, _ in store.committed()]
        row["temporary_files"] = [n for n in os.listdir(store.step(2).path) if n.endswith(".tmp")]
        latest = {"w": torch.zeros(40_000), "b": torch.zeros(3_000)}
        load_checkpoint(latest, store.latest())
        row["latest_holds"] = sorted({float(t.unique()) for t in latest.values()})
        store.step(2).remove()
        os.remove(ballast)
        rows.append(row)
print(json.dumps(rows))
"""


def test_a_full_disk_stops_the_save_with_a_checkpoint_error_and_commits_nothing_half(tmp_path):
    """Step 2 saved with 0, 4 KiB, 8 KiB, … free on a 1 MiB tmpfs (mounted in a user and mount
    namespace of the test's child, so it needs no privileges and goes away with the child): the disk
    fills while a data file, archipelago.json or .metadata is written. Every time, either the step is
    committed whole and loads, or the save raises a CheckpointError that says the disk is full and
    names the file, step 2 stays uncommitted without a temporary file on the full disk, and step 1
    loads intact."""
    rows = in_a_mount_namespace(FULL_DISK, tmp_path / "small-disk")
    assert len(rows) == 100
    for row in rows:
        assert row["temporary_files"] == [], row
        if "error" in row:
            assert row["error"].startswith("no space left to write a checkpoint (No space left on device)"), row
            assert "run again with --resume" in row["fix"]
            assert row["committed"] == [1] and row["latest_holds"] == [1.0], row
        else:
            assert row["committed"] == [1, 2] and row["latest_holds"] == [2.0], row
    for async_save in (False, True):
        mode = [row for row in rows if row["async"] == async_save]
        failed_in = {row["file"] for row in mode if "error" in row}
        assert {"archipelago.json", "__0_0.distcp", ".metadata"} <= failed_in, (async_save, failed_in)
        assert "error" not in mode[-1] and "error" in mode[0]  # it fits once enough is free


READ_ONLY = r"""
import json, subprocess, sys
import torch
from core.errors import CheckpointError
from storage.checkpoint_io import CheckpointStore, save_checkpoint
root = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", root], check=True)
store, extra = CheckpointStore(root), {"archipelago.json": b'{"step": 0}'}
save_checkpoint({"w": torch.ones(1000)}, store.step(1), extra=extra).result()
subprocess.run(["mount", "-o", "remount,ro", root], check=True)
try:
    save_checkpoint({"w": torch.ones(1000)}, store.step(2), extra=extra).result()
    print(json.dumps({"saved": True}))
except CheckpointError as e:
    print(json.dumps({"what": e.what, "where": e.where, "fix": e.fix, "committed": [s for s, _ in store.committed()]}))
"""


def test_storage_the_workers_may_not_write_is_a_checkpoint_error_naming_it(tmp_path):
    """A read-only mount (EROFS; a directory without write permission is EACCES, the same way): no retry on other
    workers would write there, so the save says where and what to change instead of raising torch's error."""
    root = tmp_path / "read-only"
    said = in_a_mount_namespace(READ_ONLY, root)
    assert said["what"].startswith("cannot write a checkpoint there (") and "Read-only file system" in said["what"], said
    assert said["where"] == str(root / "step_00000002") and said["committed"] == [1]
    assert "make [checkpoint] storage writable" in said["fix"]
