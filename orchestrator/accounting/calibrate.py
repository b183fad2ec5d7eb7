"""Teach the cost model from finished runs: how fast each device model's compute ran against its
prediction, and what each link class's reduction cost, with the prediction error on runs left out.

    archipelago calibrate runs/a runs/b runs/c          # writes runs/calibration.json (fit and plan read it)
    archipelago calibrate runs/a --sweep out/multigpu    # with a benchmarks/multigpu.py sweep's link rows

    runs, left_out = load_runs(dirs)                     # planning.calibration_fit.FinishedRun; (name, why)
    runs, implausible = calibration_fit.plausible(runs, sweeps)   # and those no plausible figure explains
    calibration = calibration_fit.fit(runs, sweeps)      # a planning.calibration.Calibration
    check = calibration_fit.leave_one_out(runs, sweeps)  # per run: the plan's error, and the error after

What a run gives (its plan.json, and the medians its report.json took from its bill rows): the step
measured, the exposed communication measured (DDP's timers), and what the plan predicted of each
with the figures and calibration it recorded (Plan.device_bases, Plan.bottleneck_*). Compute
efficiency of a device model is the geometric mean, over the runs that ran on that model alone, of
its predicted compute at efficiency 1 over the compute measured (step less exposed communication).
A link class's bandwidth is the geometric mean, over its runs whose plans waited on the wire for 5 % of
the step or more, of the costed bandwidth scaled by exposed communication predicted over measured; a
sweep's row (alpha and bus bandwidth from an all-reduce sweep) takes precedence. A run whose compute or
exposed communication took over 30 times what its plan's figures give, or under a tenth, is left out of
both (calibration_fit.SLOWER_AT_MOST, FASTER_AT_MOST), and so is a run fit has not finished. A run is
predicted again by scaling its plan's own compute and exposed communication: a heterogeneous plan's
compute by the rate its devices' new efficiencies give its split (a re-balanced split), its
communication by the bandwidth ratio (exact where nothing of it hid behind backward).
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import ConfigError
from core.plan import Plan
from orchestrator.accounting.report import RunReport
from planning.calibration_fit import FinishedRun
from planning.collectives import LinkCalibration, LinkClass, parse_calibration

SWEEP_FILES = ("multigpu.json", "calibration.json")
"""What benchmarks/multigpu.py writes into its --out folder: the sweep's calibration is in either."""


class UnfinishedRunError(ConfigError):
    """A run fit has not finished: its report.json is the one written at each checkpoint while it trains."""


def load_runs(dirs: list[str | Path]) -> tuple[list[FinishedRun], list[tuple[str, str]]]:
    """The finished runs among `dirs`, and (name, why) for each one left out because fit had not finished it."""
    runs, left_out = [], []
    for run_dir in map(Path, dirs):
        try:
            runs.append(load_run(run_dir))
        except UnfinishedRunError as e:
            left_out.append((run_dir.name, f"{e.what} — {e.fix}"))
    return runs, left_out


def load_run(run_dir: str | Path) -> FinishedRun:
    """A finished run from its folder: plan.json and the medians report.json took from its bill rows."""
    run_dir = Path(run_dir)
    report = RunReport.load(run_dir)
    # Written while fit trains: its medians are of part of the run, and fit may still be adding to them. An
    # interrupted or failed run's report is final (fit ended it), of the windows it trained.
    if report.status == "running":
        raise UnfinishedRunError("fit has not finished it (report.json says running: written at each checkpoint)",
                                 where=str(run_dir), fix="calibrate it once fit ends; if fit was killed, "
                                                         "`archipelago fit CONFIG --resume` finishes it")
    plan = Plan.load(run_dir / "plan.json")
    if not plan.device_bases:
        raise ConfigError("its plan.json records no device figures (planned by an older archipelago)",
                          where=str(run_dir), fix="train it again, or leave it out of the calibration")
    if report.step_seconds <= 0:
        raise ConfigError("no step was timed (report.json has no step time)", where=str(run_dir),
                          fix="calibrate on runs that trained at least one log window")
    share = report.exposed_comm_share or 0.0
    return FinishedRun(name=run_dir.name, plan=plan, step_seconds=report.step_seconds,
                       exposed_seconds=share * report.step_seconds)


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
