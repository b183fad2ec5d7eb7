"""The cost model taught by finished runs, as arithmetic on their plans and measured steps: the
compute efficiency of each device model, each link class's bandwidth, and each run predicted again
under a calibration fitted without it. orchestrator/accounting/calibrate.py reads the runs from their
folders (`archipelago calibrate`); benchmarks/device_probe.py builds them from steps it timed on a GPU
machine without Ray. A run whose step only a figure far from its plan's would explain is left out first
(`plausible`): it measured something the cost model does not price, not the device's or the link's speed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from core.plan import Plan
from planning.calibration import MAX_EFFICIENCY, Calibration
from planning.collectives import DEFAULT_CALIBRATION, LinkCalibration, LinkClass

LINK_SHARE_MIN = 0.05
"""A run tells about its link only when its plan had it wait at least this share of the step on the
wire: below, what DDP's timers call exposed is mostly ranks waiting for a slower rank (on the CPU
demo, a core another process took), and the ratio would scale the link by noise."""
SLOWER_AT_MOST = 30.0
"""A run whose compute or exposed communication took more than this many times what its plan's figures
give is left out of the fit, and so no fitted figure lands further below them. The slowest steps of a
model the cost model prices ran 1/11 of the CPUs' figure (test_fit's one-block, 32-wide GPT at
micro-batch 2 on a busy two-core machine; its fits have read 1/25 too): still a speed calibrate learns.
A GRU 16 wide ran 1/57, 4 wide 1/128 and an audit's 1/800: steps bound by per-step latency the cost model
does not price. Fitted, such a run moves every other plan on its device or link as far (the audit's set
loopback from 2 to 0.0026 GB/s, and every later CPU plan then waited on the wire)."""
FASTER_AT_MOST = MAX_EFFICIENCY
"""The same above the figures, tighter: what the cost model leaves out (per-op latency, small matrices,
ranks waiting for each other) only adds time, so a step far faster than its figures means a wrong figure,
or communication that hid behind backward, not a speed to learn. It is what a calibration file may hold."""

LARGE_CHECK_ERROR = 0.25
"""A mean error after calibration above this, over the runs left out that the others told about, is
warned of: the runs disagree on a figure they share (models the cost model prices unlike each other on one
device, a machine busy for some runs), and the fitted figure predicts none of them. A CPU GPT, Llama and
256-wide GRU, on a busy two-core machine, were each predicted within 19 % (mean 9 %) by the others' fit;
the H200's plan-check rows within 5 %."""


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
    def compute_at_figures_seconds(self) -> float:
        """Its plan's compute with every device at its own figures (efficiency 1), whatever calibration
        the plan was made under (its devices together for a heterogeneous run, as `predict` splits it)."""
        applied = self.applied_efficiency
        return self.plan.predicted.compute_seconds / sum(share / applied[m] for m, share in self.models.items())

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


def plausible(runs: list[FinishedRun], sweeps: dict[LinkClass, LinkCalibration]
              ) -> tuple[list[FinishedRun], list[tuple[str, str]]]:
    """The runs a calibration may learn from, and (name, why) for each one left out: its compute, or the
    communication it told its link by, is further from its plan's figures than SLOWER_AT_MOST or
    FASTER_AT_MOST allow. The fit's figures are geometric means of the runs', so they stay in range too."""
    kept, left_out = [], []
    for run in runs:
        why = _implausible(run, sweeps)
        if why is None:
            kept.append(run)
        else:
            left_out.append((run.name, why))
    return kept, left_out


def _implausible(run: FinishedRun, sweeps: dict[LinkClass, LinkCalibration]) -> str | None:
    measured, at_figures = run.measured_compute_seconds, run.compute_at_figures_seconds
    models = ", ".join(run.models)
    if measured > 0 and not _in_range(at_figures / measured):
        return (f"its compute took {measured * 1e3:,.3g} ms a step against {at_figures * 1e3:,.3g} ms predicted at the "
                f"{models} figures, {_times(measured / at_figures)}: something the cost model does not price bound "
                f"the step (a recurrent or tiny model's per-step latency, a busy machine), and a figure fitted to it "
                f"would move every plan on {models} as far")
    scale = _link_scale(run, sweeps)
    if scale is not None and not _in_range(scale):
        predicted = run.plan.predicted.exposed_communication_seconds
        return (f"it waited {run.exposed_seconds * 1e3:,.3g} ms a step on gradient communication against "
                f"{predicted * 1e3:,.3g} ms predicted at its plan's {run.link.value} figure of "
                f"{run.plan.bottleneck_gb_per_s:.3g} GB/s, {_times(1 / scale)}: more likely ranks waiting for each "
                f"other than the link's speed; measure the link with `python3 benchmarks/multigpu.py --only sweep "
                f"--out DIR` and pass --sweep DIR")
    return None


def _in_range(speed: float) -> bool:
    """Whether a run `speed` times as fast as its plan's figures is one to learn from."""
    return 1 / SLOWER_AT_MOST <= speed <= FASTER_AT_MOST


def _times(slowdown: float) -> str:
    took = f"{slowdown:,.3g}x as long" if slowdown >= 1 else f"1/{1 / slowdown:,.3g} as long"
    return f"{took} (a fit learns from 1/{FASTER_AT_MOST:g} to {SLOWER_AT_MOST:g}x)"


def _link_scale(run: FinishedRun, sweeps: dict[LinkClass, LinkCalibration]) -> float | None:
    """How much faster than its plan's figure the run's link reduced: its exposed communication predicted over
    measured; None when the run tells nothing of its link (see LINK_SHARE_MIN), or a sweep measured it."""
    predicted = run.plan.predicted
    waits = predicted.exposed_communication_seconds >= LINK_SHARE_MIN * predicted.step_seconds
    if run.link is None or run.link in sweeps or run.exposed_seconds <= 0 or not waits:
        return None
    return predicted.exposed_communication_seconds / run.exposed_seconds


def fit(runs: list[FinishedRun], sweeps: dict[LinkClass, LinkCalibration]) -> Calibration:
    """Compute efficiency per device model from the runs that ran on one model; link rows from the
    sweeps, and from the runs for the link classes no sweep measured. `plausible` says which runs to give it."""
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if len(run.models) == 1 and run.measured_compute_seconds > 0:
            (model,) = run.models
            ratios.setdefault(model, []).append(run.compute_at_figures_seconds / run.measured_compute_seconds)
    links = dict(sweeps)
    bandwidths: dict[LinkClass, list[tuple[float, float]]] = {}
    for run in runs:
        scale = _link_scale(run, sweeps)
        if scale is not None:
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
