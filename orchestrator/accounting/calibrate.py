"""Teach the cost model from finished runs: how fast each device model's compute ran against its
prediction, and what each link class's reduction cost, with the prediction error on runs left out.

    archipelago calibrate runs/a runs/b runs/c          # writes runs/calibration.json (fit and plan read it)
    archipelago calibrate runs/a --sweep out/multigpu    # with a benchmarks/multigpu.py sweep's link rows

    runs = [FinishedRun.load(d) for d in dirs]
    calibration = fit(runs, sweeps)                      # a planning.calibration.Calibration
    check = leave_one_out(runs, sweeps)                  # per run: the plan's error, and the error after

What a run gives (its plan.json, and the medians its report.json took from its bill rows): the step
measured, the exposed communication measured (DDP's timers), and what the plan predicted of each
with the figures and calibration it recorded (Plan.device_bases, Plan.bottleneck_*). Compute
efficiency of a device model is the geometric mean, over the runs that ran on that model alone, of
its predicted compute at efficiency 1 over the compute measured (step less exposed communication).
A link class's bandwidth is the geometric mean, over its runs whose plans waited on the wire for 5 % of
the step or more, of the costed bandwidth scaled by exposed communication predicted over measured; a
sweep's row (alpha and bus bandwidth from an all-reduce sweep) takes precedence. A run is predicted again by scaling its plan's own compute and
exposed communication: a heterogeneous plan's compute by the rate its devices' new efficiencies give
its split (a re-balanced split), its communication by the bandwidth ratio (exact where nothing of it
hid behind backward).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from core.errors import ConfigError
from core.plan import Plan
from orchestrator.accounting.report import RunReport
from planning.calibration import Calibration
from planning.collectives import DEFAULT_CALIBRATION, LinkCalibration, LinkClass, parse_calibration

SWEEP_FILES = ("multigpu.json", "calibration.json")
"""What benchmarks/multigpu.py writes into its --out folder: the sweep's calibration is in either."""
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

    @classmethod
    def load(cls, run_dir: str | Path) -> FinishedRun:
        run_dir = Path(run_dir)
        report = RunReport.load(run_dir)
        plan = Plan.load(run_dir / "plan.json")
        if not plan.device_bases:
            raise ConfigError("its plan.json records no device figures (planned by an older archipelago)",
                              where=str(run_dir), fix="train it again, or leave it out of the calibration")
        if report.step_seconds <= 0:
            raise ConfigError("no step was timed (report.json has no step time)", where=str(run_dir),
                              fix="calibrate on runs that trained at least one log window")
        share = report.exposed_comm_share or 0.0
        return cls(name=run_dir.name, plan=plan, step_seconds=report.step_seconds,
                   exposed_seconds=share * report.step_seconds)

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
                                      bus_gb_per_s=round(_geometric_mean([b for b, _ in rows]), 3),
                                      ddp_compute_slowdown=DEFAULT_CALIBRATION[link].ddp_compute_slowdown)
    return Calibration(links=links, compute_efficiency={m: round(_geometric_mean(r), 4) for m, r in ratios.items()})


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


def load_sweeps(paths: list[str | Path]) -> dict[LinkClass, LinkCalibration]:
    """Link rows from benchmarks/multigpu.py outputs: its --out folder, multigpu.json, or calibration.json."""
    rows: dict[LinkClass, LinkCalibration] = {}
    for path in map(Path, paths):
        file = next((path / name for name in SWEEP_FILES if (path / name).is_file()), path)
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read a sweep from it ({e})", where=str(file),
                              fix="pass benchmarks/multigpu.py's --out folder, its multigpu.json or calibration.json")
        table = data.get("calibration", data) if file.name == "multigpu.json" else data
        if not table:
            raise ConfigError("holds no calibration row (the sweep needs two GPUs or more)", where=str(file),
                              fix="run `python3 benchmarks/multigpu.py --only sweep --out DIR` on the machine")
        rows.update(parse_calibration(table, where=str(file)))
    return rows


def merged(existing: Calibration, fitted: Calibration) -> Calibration:
    """The file's earlier rows and efficiencies, with the fitted ones over them."""
    return Calibration(links={**existing.links, **fitted.links},
                       compute_efficiency={**existing.compute_efficiency, **fitted.compute_efficiency})


def _geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))
