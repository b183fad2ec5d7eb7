"""`archipelago calibrate`: compute efficiency per device model and link rows fitted to finished runs,
checked on the runs left out. Run directories are written here: a plan.json from the planner and a
report.json whose measured step is chosen, as a run of known speed would leave them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from core.config import JobConfig
from core.plan import Plan
from orchestrator.accounting import calibrate
from planning import calibration_fit
from orchestrator.accounting.report import RunReport
from orchestrator.cli import main
from planning.calibration import Calibration
from planning.collectives import LinkClass
from planning.planner import Planner
from topology import machines

TOPOLOGIES = Path(__file__).parents[2] / "examples/topologies"
TINY_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128, "vocab_size": 257}


def plan_on(cluster: str, gpus: int = 1, calibration: Calibration | None = None, batch: int = 64) -> Plan:
    config = JobConfig.from_dict({"name": "t", "model": TINY_MODEL, "cluster": {"use_gpu": True},
                                  "placement": {"min_gpus": gpus, "max_gpus": gpus},
                                  "train": {"global_batch_size": batch, "micro_batch_size": 16}})
    return Planner(machines.cluster(cluster), config, exact_memory=False, calibration=calibration).plan()


def finished(run_dir: Path, plan: Plan, step_s: float, exposed_s: float = 0.0, status: str = "completed") -> Path:
    """A run directory as fit leaves it, with `step_s` measured, `exposed_s` of it waiting on communication."""
    run_dir.mkdir(parents=True)
    plan.save(run_dir / "plan.json")
    report = {f.name: None for f in dataclasses.fields(RunReport)}
    report.update(step_seconds=step_s, exposed_comm_share=exposed_s / step_s, name=run_dir.name, status=status)
    (run_dir / "report.json").write_text(json.dumps(report))
    return run_dir


def test_compute_efficiency_is_fitted_per_model_and_checked_on_the_runs_left_out(tmp_path):
    """Three H200 runs whose compute took 1/1.25 of the prediction (within 2 %), one L4 run at 0.8."""
    h200 = plan_on("1xH200:1")
    l4 = plan_on("4xL4:1")
    runs = [calibrate.load_run(finished(tmp_path / f"h200-{i}", h200, h200.predicted.step_seconds / 1.25 * noise))
            for i, noise in enumerate((0.98, 1.0, 1.02))]
    runs.append(calibrate.load_run(finished(tmp_path / "l4", l4, l4.predicted.step_seconds / 0.8)))
    fitted = calibration_fit.fit(runs, {})
    assert fitted.compute_efficiency["H200-SXM5-141GB"] == pytest.approx(1.25, rel=0.001)
    assert fitted.compute_efficiency["L4"] == pytest.approx(0.8)
    checks = {c.run: c for c in calibration_fit.leave_one_out(runs, {})}
    assert checks["h200-0"].error_before == pytest.approx(0.98 / 1.25 - 1)  # the plan: 22 % long
    assert abs(checks["h200-0"].error_after) < 0.035 and checks["h200-0"].fitted_on == 2  # 0.98 against 1.01
    # No other L4 run: nothing to learn its speed from, so the prediction stays the plan's.
    assert checks["l4"].after_s == checks["l4"].before_s and checks["l4"].fitted_on == 0


def test_a_plan_made_under_a_calibration_is_fitted_from_what_that_calibration_assumed(tmp_path):
    calibrated = plan_on("1xH200:1", calibration=Calibration(compute_efficiency={"H200-SXM5-141GB": 2.0}))
    assert calibrated.device_bases[0].compute_efficiency == 2.0
    plain = plan_on("1xH200:1")
    run = calibrate.load_run(finished(tmp_path / "run", calibrated, plain.predicted.step_seconds / 1.5))
    assert calibration_fit.fit([run], {}).compute_efficiency["H200-SXM5-141GB"] == pytest.approx(1.5, rel=0.01)


def test_a_heterogeneous_run_is_predicted_by_the_split_its_new_efficiencies_give():
    plan = plan_on("8xH100-SXM:1,8xL40S:1", gpus=16, batch=256)
    run = calibration_fit.FinishedRun(name="mixed", plan=plan, step_seconds=1.0, exposed_seconds=0.0)
    shares = run.models
    assert set(shares) == {"H100-SXM5-80GB", "L40S"} and sum(shares.values()) == pytest.approx(1.0)
    twice = Calibration(compute_efficiency={"H100-SXM5-80GB": 2.0, "L40S": 2.0})
    exposed = plan.predicted.exposed_communication_seconds
    assert calibration_fit.predict(run, twice) == pytest.approx(plan.predicted.compute_seconds / 2 + exposed)
    one_faster = Calibration(compute_efficiency={"L40S": 3.0})
    expected = plan.predicted.compute_seconds / (shares["H100-SXM5-80GB"] + 3.0 * shares["L40S"]) + exposed
    assert calibration_fit.predict(run, one_faster) == pytest.approx(expected)


def test_a_link_is_fitted_from_what_the_runs_waited_and_a_sweep_takes_precedence(tmp_path):
    slow = Calibration.load(TOPOLOGIES / "h200x2-sockets.calibration.json")  # NVSwitch forced onto 3.4 GB/s TCP
    plan = plan_on("8xH200:1", gpus=2, calibration=slow)
    predicted = plan.predicted
    assert plan.bottleneck_link_class == "nvswitch" and plan.bottleneck_gb_per_s == pytest.approx(3.4)
    assert predicted.exposed_communication_seconds > 0
    # The run waited twice what was predicted: the link is half as fast as the row said.
    run = calibrate.load_run(finished(tmp_path / "pair", plan, predicted.compute_seconds
                                              + 2 * predicted.exposed_communication_seconds,
                                              2 * predicted.exposed_communication_seconds))
    fitted = calibration_fit.fit([run], {})
    assert fitted.links[LinkClass.NVSWITCH].bus_gb_per_s == pytest.approx(1.7, rel=0.01)
    assert calibration_fit.predict(run, fitted) == pytest.approx(run.step_seconds, rel=0.01)
    sweep = calibrate.load_sweeps([TOPOLOGIES / "h200x2-nvswitch.calibration.json"])
    assert calibration_fit.fit([run], sweep).links[LinkClass.NVSWITCH].bus_gb_per_s == 323.1
    # Over NVSwitch at its default figures the plan barely waits on the wire: what a run then measures
    # as exposed is ranks waiting for each other, and says nothing about the link.
    fast = plan_on("8xH200:1", gpus=2)
    assert fast.predicted.exposed_communication_seconds < calibration_fit.LINK_SHARE_MIN * fast.predicted.step_seconds
    straggled = calibrate.load_run(finished(tmp_path / "fast", fast, 2 * fast.predicted.step_seconds,
                                                    fast.predicted.step_seconds))
    assert calibration_fit.fit([straggled], {}).links == {}


def test_the_command_writes_the_runs_directorys_calibration_and_reports_the_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    h200 = plan_on("1xH200:1")
    dirs = [str(finished(tmp_path / "runs" / f"r{i}", h200, h200.predicted.step_seconds / 1.1)) for i in range(2)]
    Calibration(compute_efficiency={"cpu": 0.9}).save(tmp_path / "runs" / "calibration.json")  # an earlier fit
    assert main(["calibrate", *dirs]) == 0
    out = capsys.readouterr().out
    assert "mean |error|: 9.1% as planned, 0.0% calibrated on the other runs" in out and "warning" not in out
    written = Calibration.load(tmp_path / "runs" / "calibration.json")
    assert written.compute_efficiency == {"cpu": 0.9, "H200-SXM5-141GB": pytest.approx(1.1)}
    assert main(["calibrate", dirs[0], "--dry-run", "--out", str(tmp_path / "other.json")]) == 0
    assert "one run: nothing is left to check" in capsys.readouterr().out and not (tmp_path / "other.json").exists()


def test_a_run_fit_has_not_finished_is_left_out_by_name(capsys, tmp_path):
    """report.json says running while fit trains (and after fit was killed): its medians are of part of the run."""
    h200 = plan_on("1xH200:1")
    done = [str(finished(tmp_path / "runs" / f"done{i}", h200, h200.predicted.step_seconds / 1.1)) for i in range(2)]
    running = str(finished(tmp_path / "runs" / "training", h200, h200.predicted.step_seconds * 3, status="running"))
    assert main(["calibrate", *done, running]) == 0
    out = capsys.readouterr().out
    assert "left out training: fit has not finished it (report.json says running" in out
    fitted = Calibration.load(tmp_path / "runs" / "calibration.json")
    assert fitted.compute_efficiency == {"H200-SXM5-141GB": pytest.approx(1.1)}  # the running run's 1/3 is not in it
    assert main(["calibrate", running, "--dry-run"]) == 2
    assert "no run is left to fit" in capsys.readouterr().out


def test_runs_that_disagree_on_a_figure_they_share_are_warned_of(capsys, tmp_path, monkeypatch):
    """Two H200 runs, one at 3x the figures and one at 1/3: each is plausible, but each predicts the other 9x off."""
    monkeypatch.setenv("COLUMNS", "300")
    h200 = plan_on("1xH200:1")
    dirs = [str(finished(tmp_path / "runs" / name, h200, h200.predicted.step_seconds * factor))
            for name, factor in (("fast", 1 / 3), ("slow", 3))]
    assert main(["calibrate", *dirs, "--dry-run"]) == 0
    assert "warning: calibrated on the others, the runs are still off by 444% on average (over 25%)" in \
        capsys.readouterr().out


def test_a_run_that_cannot_be_calibrated_on_is_one_line(capsys, tmp_path):
    (tmp_path / "half").mkdir()
    assert main(["calibrate", str(tmp_path / "half")]) == 2
    assert "report.json" in capsys.readouterr().out
    old = plan_on("1xH200:1")
    old.device_bases = []
    finished(tmp_path / "old", old, 0.01)
    assert main(["calibrate", str(tmp_path / "old")]) == 2
    assert "records no device figures (planned by an older archipelago)" in capsys.readouterr().out
    assert main(["calibrate", str(tmp_path / "old"), "--sweep", str(tmp_path)]) == 2


def test_a_slow_devices_efficiency_keeps_four_significant_digits(tmp_path):
    """A run at 1/23 of its prediction fits 0.04348 (four significant digits), not 0.0435: four decimals
    would move every later prediction on that device by 0.05 %."""
    h200 = plan_on("1xH200:1")
    run = calibrate.load_run(finished(tmp_path / "slow", h200, h200.predicted.step_seconds * 23))
    assert calibration_fit.fit([run], {}).compute_efficiency["H200-SXM5-141GB"] == pytest.approx(1 / 23, rel=2e-4)


def test_a_slow_links_bandwidth_keeps_four_significant_digits(tmp_path):
    """A run that waited 29x its predicted communication fits the 3.4 GB/s row at 0.1172 GB/s; three
    decimals (0.117) would predict that run's step 0.2 % long."""
    plan = plan_on("8xH200:1", gpus=2, calibration=Calibration.load(TOPOLOGIES / "h200x2-sockets.calibration.json"))
    predicted = plan.predicted
    waited = 29 * predicted.exposed_communication_seconds
    run = calibrate.load_run(finished(tmp_path / "slow", plan, predicted.compute_seconds + waited, waited))
    fitted = calibration_fit.fit([run], {})
    assert fitted.links[LinkClass.NVSWITCH].bus_gb_per_s == pytest.approx(3.4 / 29, rel=5e-4)
    assert calibration_fit.predict(run, fitted) == pytest.approx(run.step_seconds, rel=1e-3)


def cpu_plan(model: dict) -> Plan:
    """Two CPU workers of one machine, reducing over loopback, as the CPU demo runs."""
    config = JobConfig.from_dict({"name": "t", "model": model,
                                  "cluster": {"use_gpu": False, "num_workers": 2, "cpus_per_worker": 1},
                                  "train": {"global_batch_size": 32, "micro_batch_size": 16}})
    return Planner(machines.cluster("1xH200:1"), config, exact_memory=False).plan()


def test_a_run_no_plausible_figure_explains_is_left_out_by_name(capsys, tmp_path, monkeypatch):
    """An audit's runs: a GPT and a Llama whose CPU compute took twice the prediction, and a recurrent model
    whose step, bound by per-step latency, took 800x, a fifth of it waiting on stragglers. Fitted with the
    others, it dragged the CPUs' efficiency down and set loopback 770x slower, and nothing said so."""
    monkeypatch.setenv("COLUMNS", "200")
    dirs = []
    for name, model in (("gpt", TINY_MODEL), ("llama", {**TINY_MODEL, "kind": "llama", "n_kv_head": 2})):
        plan = cpu_plan(model)
        dirs.append(str(finished(tmp_path / "runs" / name, plan, plan.predicted.step_seconds * 2)))
    lstm = cpu_plan({"kind": "custom", "factory": "tests.custom_models:lstm", "seq_len": 128, "vocab_size": 257,
                     "width": 4})
    assert lstm.predicted.exposed_communication_seconds >= calibration_fit.LINK_SHARE_MIN * lstm.predicted.step_seconds
    step = lstm.predicted.compute_seconds * 800 / 0.8
    dirs.append(str(finished(tmp_path / "runs" / "lstm", lstm, step, 0.2 * step)))
    assert main(["calibrate", *dirs]) == 0
    out = capsys.readouterr().out
    assert "left out lstm: its compute took" in out and ", 800x as long" in out
    written = Calibration.load(tmp_path / "runs" / "calibration.json")
    assert written.links == {} and written.compute_efficiency == {"cpu": pytest.approx(0.5, rel=0.01)}


def test_a_link_far_slower_than_its_figure_is_left_out_for_a_sweep_to_measure(tmp_path):
    plan = plan_on("8xH200:1", gpus=2, calibration=Calibration.load(TOPOLOGIES / "h200x2-sockets.calibration.json"))
    predicted = plan.predicted
    waited = 100 * predicted.exposed_communication_seconds
    run = calibrate.load_run(finished(tmp_path / "pair", plan, predicted.compute_seconds + waited, waited))
    kept, left_out = calibration_fit.plausible([run], {})
    assert kept == [] and left_out[0][0] == "pair"
    assert "100x as long (a fit learns from 1/10 to 30x)" in left_out[0][1] and "--sweep" in left_out[0][1]
    # A sweep measured the link: the run tells nothing of it, and its compute is as predicted.
    sweep = calibrate.load_sweeps([TOPOLOGIES / "h200x2-nvswitch.calibration.json"])
    assert calibration_fit.plausible([run], sweep) == ([run], [])


def test_a_run_far_faster_than_its_figures_is_left_out_rather_than_written_unreadable(capsys, tmp_path):
    """12x the H200's figures: a wrong figure, not a speed. Fitted alone, it wrote an efficiency of 12, which
    every later fit and plan then refused to read (a calibration file holds at most MAX_EFFICIENCY)."""
    h200 = plan_on("1xH200:1")
    fast = str(finished(tmp_path / "runs" / "fast", h200, h200.predicted.step_seconds / 12))
    ok = str(finished(tmp_path / "runs" / "ok", h200, h200.predicted.step_seconds))
    assert main(["calibrate", fast, ok]) == 0
    assert "left out fast: its compute took" in capsys.readouterr().out
    assert Calibration.load(tmp_path / "runs" / "calibration.json").compute_efficiency == {
        "H200-SXM5-141GB": pytest.approx(1.0)}
