"""The cost model taught by finished runs, as arithmetic on their plans and measured steps: the
compute efficiency of each device model, each link class's bandwidth, and each run predicted again
under a calibration fitted without it. orchestrator/accounting/calibrate.py reads the runs from their
folders (`archipelago calibrate`); benchmarks/device_probe.py builds them from steps it timed on a GPU
machine without Ray.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from core.plan import Plan
from planning.calibration import Calibration
from planning.collectives import DEFAULT_CALIBRATION, LinkCalibration, LinkClass

LINK_SHARE_MIN = 0.05
"""A run tells about its link only when its plan had it wait at least this share of the step on the
wire: below, what DDP's timers call exposed is mostly ranks waiting for a slower rank (on the CPU
demo, a core another process took), and the ratio would scale the link by noise."""


@dataclass(frozen=True, slots=True)
class FinishedRun:
    name: str
    plan: Plan
    step_seconds: float
    """Measured: the median step of the run (report.json)."""
    exposed_seconds: float
    """Measured: the median share of a step spent waiting on gradient communication, times the step."""

    @property
    def measured_compute_seconds(self) -> float:
        return self.step_seconds - self.exposed_seconds

    @property
    def models(self) -> dict[str, float]:
        """Each device model's share of the step's samples."""
        plan, shares = self.plan, {}
        model_of = {basis.device_model: basis.model for basis in plan.device_bases}
        replicas = {w.data_parallel_rank: w for w in plan.workers}
        for worker in replicas.values():
            model = model_of[worker.device_model]
            shares[model] = shares.get(model, 0.0) + worker.micro_batch_size * plan.grad_accum_steps
        return {model: samples / plan.global_batch_size for model, samples in shares.items()}

    @property
    def applied_efficiency(self) -> dict[str, float]:
        return {basis.model: basis.compute_efficiency for basis in self.plan.device_bases}

    @property
    def link(self) -> LinkClass | None:
        """The link class its reduction waited on; None for one replica."""
        value = self.plan.bottleneck_link_class
        reduced = self.plan.predicted.exposed_communication_seconds > 0 and self.plan.bottleneck_gb_per_s > 0
        return LinkClass(value) if reduced and value in LinkClass.__members__.values() else None


@dataclass(frozen=True, slots=True)
class Check:
    """One run predicted again under a calibration fitted without it."""

    run: str
    devices: str
    measured_s: float
    before_s: float
    """What its plan predicted."""
    after_s: float
    """What the calibration fitted on the other runs predicts."""
    fitted_on: int
    """How many other runs told the calibration about this run's devices or link (0: after = before)."""

    @property
    def error_before(self) -> float:
        return self.measured_s / self.before_s - 1

    @property
    def error_after(self) -> float:
        return self.measured_s / self.after_s - 1


def fit(runs: list[FinishedRun], sweeps: dict[LinkClass, LinkCalibration]) -> Calibration:
    """Compute efficiency per device model from the runs that ran on one model; link rows from the
    sweeps, and from the runs for the link classes no sweep measured."""
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if len(run.models) == 1 and run.measured_compute_seconds > 0:
            (model,) = run.models
            unscaled = run.plan.predicted.compute_seconds * run.applied_efficiency[model]
            ratios.setdefault(model, []).append(unscaled / run.measured_compute_seconds)
    links = dict(sweeps)
    bandwidths: dict[LinkClass, list[tuple[float, float]]] = {}
    for run in runs:
        waits = run.plan.predicted.exposed_communication_seconds >= LINK_SHARE_MIN * run.plan.predicted.step_seconds
        if run.link is not None and run.link not in sweeps and run.exposed_seconds > 0 and waits:
            scale = run.plan.predicted.exposed_communication_seconds / run.exposed_seconds
            bandwidths.setdefault(run.link, []).append((run.plan.bottleneck_gb_per_s * scale,
                                                        run.plan.bottleneck_alpha_us))
    for link, rows in bandwidths.items():
        links[link] = LinkCalibration(alpha_us=round(statistics.mean(a for _, a in rows), 2),
                                      bus_gb_per_s=_significant(_geometric_mean([b for b, _ in rows])),
                                      ddp_compute_slowdown=DEFAULT_CALIBRATION[link].ddp_compute_slowdown)
    return Calibration(links=links, compute_efficiency={m: _significant(_geometric_mean(r)) for m, r in ratios.items()})


def _significant(value: float) -> float:
    """Four significant digits, not a fixed number of decimals: a slow CPU's efficiency of 0.02535 or a
    loopback link's 0.01099 GB/s would lose 0.2 % to three or four decimals, and every later prediction
    with them."""
    return float(f"{value:.4g}")


def predict(run: FinishedRun, calibration: Calibration) -> float:
    """The run's step under `calibration`, from its plan's own compute and exposed communication."""
    predicted, applied = run.plan.predicted, run.applied_efficiency
    new = {model: calibration.compute_efficiency.get(model, applied[model]) for model in run.models}
    speedup = sum(share * new[model] / applied[model] for model, share in run.models.items())
    exposed = predicted.exposed_communication_seconds
    row = calibration.links.get(run.link) if run.link is not None else None
    if row is not None and row.bus_gb_per_s > 0:
        exposed *= run.plan.bottleneck_gb_per_s / row.bus_gb_per_s
    return predicted.compute_seconds / speedup + exposed


def leave_one_out(runs: list[FinishedRun], sweeps: dict[LinkClass, LinkCalibration]) -> list[Check]:
    checks = []
    for i, run in enumerate(runs):
        others = runs[:i] + runs[i + 1:]
        informed = sum(1 for other in others if (len(other.models) == 1 and set(other.models) <= set(run.models))
                       or (run.link is not None and other.link == run.link))
        devices = ", ".join(f"{m} {share:.0%}" if len(run.models) > 1 else m for m, share in run.models.items())
        checks.append(Check(run=run.name, devices=devices, measured_s=run.step_seconds,
                            before_s=run.plan.predicted.step_seconds,
                            after_s=predict(run, fit(others, sweeps)), fitted_on=informed))
    return checks


def merged(existing: Calibration, fitted: Calibration) -> Calibration:
    """The file's earlier rows and efficiencies, with the fitted ones over them."""
    return Calibration(links={**existing.links, **fitted.links},
                       compute_efficiency={**existing.compute_efficiency, **fitted.compute_efficiency})


def _geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))
