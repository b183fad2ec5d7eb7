"""The embedded cluster's processes are found under the fit's process and ended: waited for while they exit,
killed when they outstay the grace period (topology/ray_processes.py), with real processes."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from topology import connect, ray_processes

# A parent that starts a child named like a Ray worker, prints the child's pid, then lives argv[1] seconds;
# both ignore SIGTERM, as a worker busy in teardown would.
TREE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)",
    "ray" + "::TrainController"], stdout=subprocess.PIPE)  # spelt apart: this parent is not named like Ray
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""


@contextlib.contextmanager
def tree(parent_lives_s: float):
    """(the parent's Popen, the child's pid); both killed afterwards."""
    parent = subprocess.Popen([sys.executable, "-c", TREE, str(parent_lives_s)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        yield parent, child
    finally:
        for pid in (parent.pid, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_the_tree_below_a_process_is_found_and_ray_s_workers_told_apart():
    with tree(60) as (parent, child):
        found = {p.pid: p for p in ray_processes.descendants(os.getpid())}
        assert parent.pid in found and child in found
        assert ray_processes.is_ray(found[child]) and not ray_processes.is_ray(found[parent.pid])
        assert [p.pid for p in ray_processes.descendants(parent.pid)] == [child]


def test_processes_that_outstay_the_grace_period_are_killed():
    with tree(60) as (parent, child):
        processes = [p for p in ray_processes.descendants(os.getpid()) if p.pid in (parent.pid, child)]
        started = time.monotonic()
        killed = ray_processes.end(processes, grace_s=0.5)
        assert 0.5 <= time.monotonic() - started < 5
        assert sorted(p.pid for p in killed) == sorted([parent.pid, child])
        parent.wait(timeout=5)
        deadline = time.monotonic() + 5  # the child, orphaned, is reaped by init
        while ray_processes.alive(processes[-1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(ray_processes.alive(p) for p in processes)


def test_a_process_that_exits_within_the_grace_period_is_waited_for_not_killed():
    with tree(0.5) as (parent, child):
        ours = [p for p in ray_processes.descendants(os.getpid()) if p.pid == parent.pid]
        started = time.monotonic()
        assert ray_processes.end(ours, grace_s=30) == []  # its exit leaves a zombie until wait(): not alive
        assert 0.3 < time.monotonic() - started < 10


def test_a_process_that_renamed_itself_is_not_new():
    # A process is its pid and start time: Ray's workers rename themselves (ray::…) once they run, and a process
    # already there before the session must not count as the cluster's because its command line changed.
    before = [ray_processes.Process(4242, 100, "python worker.py"), ray_processes.Process(4243, 101, "sleep 9")]
    now = [ray_processes.Process(4242, 100, "ray::IDLE"), ray_processes.Process(4243, 900, "ray::RayTrainWorker"),
           ray_processes.Process(4300, 950, "raylet")]
    assert [p.pid for p in ray_processes.started_since(before, now)] == [4243, 4300]


def test_an_embedded_session_ends_the_cluster_processes_ray_shutdown_left(monkeypatch):
    """What ray_session adds to ray.shutdown(): a process its embedded cluster started that is still running
    after the shutdown (one was, 10 s later, on a loaded 2-core machine) is ended before the session returns;
    a Ray-named process that was there before the session is not. Ray's start is stood in for by a tree of
    real processes, its shutdown by one that leaves them running."""
    with contextlib.ExitStack() as stack:
        old_parent, old_child = stack.enter_context(tree(60))
        started = []
        monkeypatch.setattr(connect.ray, "init", lambda **options: started.append(stack.enter_context(tree(60))))
        monkeypatch.setattr(connect.ray, "shutdown", lambda: None)
        monkeypatch.setattr(connect, "EMBEDDED_EXIT_S", 0.5)
        with connect.ray_session(""):
            [(parent, child)] = started
            mine = {p.pid: p for p in ray_processes.descendants(os.getpid())}
        assert not ray_processes.alive(mine[child])  # Ray's: killed (a zombie until its parent reaps it)
        assert ray_processes.alive(mine[parent.pid])  # not named like Ray's: left alone
        assert ray_processes.alive(mine[old_child])  # there before the session
