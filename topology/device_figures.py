"""A node's measured device figures: the micro-benchmark run once per node and driver, then cached.

    bench = DeviceBench.from_environment()     # what the live probe and `topology --local` use
    figures, notes = bench.figures(node)        # MeasuredDevice per GPU model, and "cpu"

The benchmark (topology/device_bench.py) runs in a child process, a few seconds on a fresh node.
Its figures are kept in <cache dir>/device-figures.json under the host's name, with the driver it
ran under and when; they are measured again when the driver, the host's GPU models or its core count
change (a note says the old figures were dropped), and when they are older than MAX_AGE_S. Several
probes on one host (Ray nodes sharing a machine) take a lock, so one measures and the others read
what it wrote.

Environment: ARCHIPELAGO_CACHE_DIR (default ~/.cache/archipelago), ARCHIPELAGO_DEVICE_BENCH_S
(seconds per figure, default 0.3; 0 turns the benchmark off).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core import codec
from core.atomic import write_text_atomically
from core.errors import TopologyError
from topology.cluster import MeasuredDevice, NodeTopology

CACHE_FILE = "device-figures.json"
FORMAT = "archipelago.device-figures"
VERSION = 3
"""2: CPUs carry fp32_block_tflops; 3: each host's figures carry when they were measured. A cache
written before is measured again."""
MAX_AGE_S = 3600.0
"""Figures older than this are measured again: a shared host's speed drifts. The 2-core CPU VM's demo
was planned at 207.6 ms a step from figures two hours old and measured 155.4 ms (-25 %); measured
afresh, 152.6 against 154.8 ms (benchmarks/RESULTS.md, 2026-12-04). Re-measuring costs a few seconds."""
SECONDS_PER_FIGURE = 0.3
"""Default time spent on each figure: about 2 s of measuring for the CPUs and 3 s for a GPU model."""
TIMEOUT_S = 300.0
"""How long the child may take (torch's import and CUDA's start-up included) before the probe gives up."""

RunChild = Callable[[float, float], dict]
"""(seconds per figure, timeout) → what `python -m topology.device_bench --json` prints, parsed."""


def run_benchmark_process(seconds: float, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "topology.device_bench", "--json", "--seconds", str(seconds)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise TopologyError(f"the device micro-benchmark took longer than {timeout_s:g} s", where="topology probe",
                            fix="lower ARCHIPELAGO_DEVICE_BENCH_S, or set it to 0 to plan on catalog figures") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise TopologyError(f"the device micro-benchmark failed ({last[:200]})", where="topology probe",
                            fix="run `python3 -m topology.device_bench` on the node to see why")
    return json.loads(done.stdout)


@dataclass(slots=True)
class CachedFigures:
    """One host's entry in the cache."""

    measured_at: float
    """When, in seconds since the epoch."""
    devices: list[MeasuredDevice]


@dataclass(slots=True)
class DeviceBench:
    seconds_per_figure: float = SECONDS_PER_FIGURE
    """0: measure nothing (the planner uses the catalog's figures)."""
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "archipelago")
    timeout_s: float = TIMEOUT_S
    run_child: RunChild = run_benchmark_process
    """Tests put a fake here; the probe runs the real child process."""
    clock: Callable[[], float] = time.time
    """Now, in seconds since the epoch (tests move it)."""
    max_age_s: float = MAX_AGE_S

    @classmethod
    def from_environment(cls) -> DeviceBench:
        seconds = os.environ.get("ARCHIPELAGO_DEVICE_BENCH_S", "")
        cache = os.environ.get("ARCHIPELAGO_CACHE_DIR", "")
        bench = cls()
        if cache:
            bench.cache_dir = Path(cache)
        if seconds:
            try:
                bench.seconds_per_figure = max(0.0, float(seconds))
            except ValueError:
                raise TopologyError(f"ARCHIPELAGO_DEVICE_BENCH_S={seconds!r} is not a number", where="environment",
                                    fix="give seconds per figure, e.g. 0.3, or 0 to turn the benchmark off") from None
        return bench

    def figures(self, node: NodeTopology) -> tuple[list[MeasuredDevice], list[str]]:
        """The node's figures, from the cache when they were measured under its driver, for its GPU
        models and core count; measured now otherwise. A failure is a note, never an error: the
        planner then uses the catalog."""
        if self.seconds_per_figure <= 0:
            return [], ["device micro-benchmark off (ARCHIPELAGO_DEVICE_BENCH_S=0): planned on catalog figures"]
        notes: list[str] = []
        try:
            with self._locked():
                cached = self._read().get(node.hostname)
                if cached is not None and self._recent(cached, notes) and _fits(cached.devices, node, notes):
                    return cached.devices, notes
                measured = self._measure(node, notes)
                self._write(node.hostname, measured)
        except TopologyError as e:
            return [], [f"device figures not measured: {e.what} ({e.fix}); planned on catalog figures"]
        except (OSError, ValueError) as e:  # the cache directory, or a child that printed something else than JSON
            return [], [f"device figures not measured: {e}; planned on catalog figures"]
        return measured, notes

    def _measure(self, node: NodeTopology, notes: list[str]) -> list[MeasuredDevice]:
        result = self.run_child(self.seconds_per_figure, self.timeout_s)
        devices = codec.decode(list[MeasuredDevice], result.get("devices"), "device micro-benchmark")
        for device in devices:
            if device.name != "cpu":
                device.driver_version = node.driver_version
        notes.extend(result.get("notes", []))
        return devices

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cache_dir / (CACHE_FILE + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _recent(self, cached: CachedFigures, notes: list[str]) -> bool:
        age_s = self.clock() - cached.measured_at
        if 0 <= age_s <= self.max_age_s:
            return True
        when = (f"measured {age_s / 60:.0f} min ago (more than {self.max_age_s / 60:.0f} min: a host's speed "
                "drifts)" if age_s > 0 else "dated after now (the clock was set back)")
        notes.append(f"dropped device figures {when}; measured again")
        return False

    def _read(self) -> dict[str, CachedFigures]:
        """Figures by host name; an unreadable cache counts as empty (it is measured again)."""
        path = self.cache_dir / CACHE_FILE
        try:
            data = json.loads(path.read_text())
            fields = codec.check_header(data, format=FORMAT, version=VERSION, noun="device figure cache",
                                        command="the topology probe", error=TopologyError, where=str(path))
            return codec.decode(dict[str, CachedFigures], fields.get("hosts"), f"{path}: hosts")
        except (OSError, ValueError, TopologyError):
            return {}

    def _write(self, hostname: str, devices: list[MeasuredDevice]) -> None:
        hosts = self._read()
        hosts[hostname] = CachedFigures(measured_at=self.clock(), devices=devices)
        document = {"format": FORMAT, "version": VERSION,
                    "hosts": {host: asdict(figures) for host, figures in hosts.items()}}
        write_text_atomically(self.cache_dir / CACHE_FILE, json.dumps(document, indent=1) + "\n")


def _fits(cached: list[MeasuredDevice], node: NodeTopology, notes: list[str]) -> bool:
    """Whether cached figures still describe the node: measured under its driver, for every GPU model it
    has now, with its cores. A stale set is dropped with a note saying why."""
    gpus = [d for d in cached if d.name != "cpu"]
    stale = sorted({d.driver_version for d in gpus if d.driver_version != node.driver_version})
    if stale:
        notes.append(f"dropped device figures measured under driver {', '.join(stale)}: the driver is now "
                     f"{node.driver_version or 'unknown'}; measured again")
        return False
    names = {gpu.name for gpu in node.gpus if gpu.name and not gpu.mig_enabled and not gpu.error}
    cores = next((d.cores for d in cached if d.name == "cpu"), 0)
    return names <= {d.name for d in gpus} and cores == len(os.sched_getaffinity(0))
