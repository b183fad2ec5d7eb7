"""Slows each fsync of a checkpoint's files and directory (a path with /step_ in it) by
ARCHIPELAGO_TEST_FSYNC_DELAY_S seconds, in every Python process started with this directory on
PYTHONPATH: test_driver_kill's `archipelago fit` and the Ray processes it starts, which inherit it.

A checkpoint's `.metadata` appears only after at least five such fsyncs since its step directory was
made (archipelago.json, the directory, each rank's data file, the directory, `.metadata`'s temporary
file), so however small the model, the step directory exists without `.metadata` for at least five
delays: the test catches the write on any machine, not only when a big model makes it slow.
"""

import os

DELAY_S = float(os.environ.get("ARCHIPELAGO_TEST_FSYNC_DELAY_S", "0"))

if DELAY_S > 0:
    import time

    _fsync = os.fsync

    def _slow_fsync(fd) -> None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        except OSError:
            target = ""
        if "/step_" in target:
            time.sleep(DELAY_S)
        _fsync(fd)

    os.fsync = _slow_fsync
