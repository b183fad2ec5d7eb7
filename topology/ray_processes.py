"""An embedded Ray cluster's processes, read from /proc, so that a fit ends none of them still running.

ray.shutdown() stops the GCS and the raylet it started; the workers under the raylet (Ray Train's controller,
the training workers) see their raylet gone and exit by themselves. On a loaded 2-core machine one of them was
still alive 10 s after `archipelago fit` had returned (tests/integration/test_driver_kill.py), holding memory,
and on a GPU node it would hold GPU memory the next job plans with. So the session lists its cluster's
processes before it shuts Ray down, waits for them, and kills those left after a grace period. Where there
is no /proc (macOS) nothing is listed and Ray's own shutdown is all there is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    started: int
    """Clock ticks after boot when it started (/proc/PID/stat, field 22): tells a reused pid apart."""
    command: str


def _stat(pid_dir: Path) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process; None once it is gone or a zombie."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # a zombie has exited; its parent has not reaped it yet
            return int(fields[1]), int(fields[19])
    return None


def descendants(root: int) -> list[Process]:
    """Every live process below `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid_dir in PROC.glob("[0-9]*"):
        stat = _stat(pid_dir)
        if stat is not None:
            children.setdefault(stat[0], []).append((int(pid_dir.name), stat[1]))
    found, stack = [], [root]
    while stack:
        for pid, started in children.get(stack.pop(), []):
            with contextlib.suppress(OSError):
                command = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(Process(pid, started, command.strip()))
            stack.append(pid)
    return found


def started_since(before: list[Process], now: list[Process]) -> list[Process]:
    """The processes in `now` that `before` did not hold. A process is its pid and start time: a Ray worker
    renames itself (ray::…) once it runs, so its command line is not the one listed when it started."""
    seen = {(p.pid, p.started) for p in before}
    return [p for p in now if (p.pid, p.started) not in seen]


def is_ray(process: Process) -> bool:
    """Ray's workers name themselves ray::…; its binaries and agents run from the ray package."""
    return "ray::" in process.command or "/ray/" in process.command


def alive(process: Process) -> bool:
    stat = _stat(PROC / str(process.pid))
    return stat is not None and stat[1] == process.started


KILLED_EXIT_S = 5.0
"""How long a killed process is waited for: SIGKILL is delivered asynchronously."""


def end(processes: list[Process], grace_s: float) -> list[Process]:
    """Waits up to `grace_s` for `processes` to exit, then kills those still running and waits for them to be
    gone; returns those it killed."""
    _wait(processes, grace_s)
    left = [p for p in processes if alive(p)]
    for process in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
    _wait(left, KILLED_EXIT_S)
    return left


def _wait(processes: list[Process], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
