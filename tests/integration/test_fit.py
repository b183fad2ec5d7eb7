"""fit() end to end on a Ray cluster: two gloo workers, real DCP checkpoints, and what --resume refuses.

conftest.py's uninterrupted `straight` run serves every test in this module. test_driver_kill resumes
a run killed mid-checkpoint and compares every step with it.
"""

import json

import pytest

from orchestrator import CheckpointError, ConfigError, Orchestrator
from orchestrator.accounting import calibrate
from planning import calibration_fit
from orchestrator.cli import main
from planning.calibration import Calibration
from tests.integration.conftest import SEQ_LEN, job
from workers.checkpoint import read_info

pytestmark = pytest.mark.integration


def losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_fit_trains_checkpoints_and_reports(straight):
    result, run_dir, steps = straight.result, straight.dir, straight.steps
    curve = losses(result.metrics)
    assert sorted(curve) == list(range(1, steps + 1))
    assert curve[steps] < curve[1] - 0.5  # from ~ln(257) towards the byte distribution
    assert result.checkpoint == run_dir / f"step_{steps:08d}"
    assert read_info(result.checkpoint).consumed_samples == steps * 8
    every = straight.config.checkpoint.every_steps
    saved = sorted({*range(every, steps + 1, every), steps})  # every `every` steps, and the last
    assert sorted(p.name for p in run_dir.glob("step_*")) == [f"step_{s:08d}" for s in saved[-2:]]  # keep_last = 2
    report = json.loads((run_dir / "report.json").read_text())
    assert report["final_step"] == steps and report["world_size"] == 2 and report["status"] == "completed"
    assert report["tokens_seen"] == steps * 8 * SEQ_LEN
    assert report["final_val_loss"] == result.report.final_val_loss < 5.0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines if "loss" in row] == list(range(1, steps + 1))
    # The probe measured the CPUs (topology/device_figures.py), and the plan was costed on that figure.
    (basis,) = result.plan.device_bases
    assert (basis.device_model, basis.source) == ("cpu", "measured") and basis.tflops > 0


def test_the_finished_run_calibrates_the_cpus_it_ran_on(straight, tmp_path, capsys):
    """What fit leaves (plan.json, report.json) is what `archipelago calibrate` reads: the CPUs' efficiency is
    the plan's compute at efficiency 1 over the compute the run measured (its step less exposed communication)."""
    out = tmp_path / "calibration.json"  # not <runs_dir>/calibration.json: the module's other fits would read it
    assert main(["calibrate", str(straight.dir), "--out", str(out)]) == 0, capsys.readouterr().out
    run = calibrate.load_run(straight.dir)
    assert run.models == {"cpu": 1.0} and run.step_seconds >= run.measured_compute_seconds > 0
    fitted = Calibration.load(out)
    expected = run.plan.predicted.compute_seconds * run.applied_efficiency["cpu"] / run.measured_compute_seconds
    assert fitted.compute_efficiency["cpu"] == pytest.approx(expected, rel=1e-3)
    # Under the fitted efficiency the run's compute is predicted as it was measured; its exposed communication
    # too when its plan waited on the wire for LINK_SHARE_MIN of the step or more, so that the run fitted its
    # link (that share follows the CPUs' measured speed: on a fast machine the wait is the larger share).
    predicted = run.plan.predicted
    fitted_link = run.link in fitted.links
    waited = predicted.exposed_communication_seconds >= calibration_fit.LINK_SHARE_MIN * predicted.step_seconds
    assert fitted_link == (waited and run.exposed_seconds > 0)
    exposed = run.exposed_seconds if fitted_link else predicted.exposed_communication_seconds
    assert calibration_fit.predict(run, fitted) == pytest.approx(run.measured_compute_seconds + exposed, rel=1e-3)


def test_resume_refuses_a_checkpoint_of_another_model(straight, small_dataset):
    wider = job(small_dataset, straight.dir.parent, "straight", straight.steps + 4, model={"n_embd": 64})
    with pytest.raises(CheckpointError) as info:
        Orchestrator(wider, resume=True).fit()
    assert "checkpoint is from another model (n_embd: checkpoint 32, config 64)" in str(info.value)
    assert f"step_{straight.steps:08d}" in str(info.value)


def test_a_second_run_of_the_same_name_needs_resume_or_overwrite(straight, small_dataset):
    with pytest.raises(ConfigError) as info:
        Orchestrator(job(small_dataset, straight.dir.parent, "straight", straight.steps)).fit()
    assert "already holds a run" in str(info.value) and "--resume" in str(info.value)
    assert (straight.dir / f"step_{straight.steps:08d}").is_dir()  # nothing was deleted


def test_a_worker_group_ray_cannot_place_is_named_with_what_it_needs(cluster):
    """What fit prints while Ray holds a group back, read from Ray's own placement-group table: a group of
    three 1-CPU bundles on a cluster of two CPUs stays pending."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from core.config import JobConfig
    from orchestrator.fit import _placement_wait_note

    group = placement_group([{"CPU": 1.0}] * 3)
    try:
        note = _placement_wait_note(JobConfig())
    finally:
        remove_placement_group(group)
    assert note is not None and note.startswith("waiting for Ray to place 3 workers: they need 3 CPUs where the cluster")
    assert note.endswith("lower [cluster] num_workers (or set [elastic] min_workers).")
    assert _placement_wait_note(JobConfig()) is None  # once it is gone, nothing is pending
