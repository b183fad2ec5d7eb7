"""A process killed (SIGKILL) in the middle of writing a checkpoint leaves the previous committed one loadable."""

import multiprocessing
import os
import signal
import time

import pytest
import torch

from storage.checkpoint_io import CheckpointStore, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.integration
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
