"""fit() end to end on a local Ray cluster: two gloo workers, real DCP checkpoints, resume.

Three fits (about 30 s each, mostly Ray worker start-up) serve every test in this module:
an uninterrupted 12-step run, and an 8-step run resumed to 12 steps.
"""

import json

import pytest
import ray

from orchestrator import CheckpointError, ConfigError, Orchestrator
from tests.conftest import tiny_job
from workers.checkpoint import read_info

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(dataset_dir, tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # Constant learning rate, so the schedule does not depend on the total step count.
        straight = Orchestrator(tiny_job(dataset_dir, runs_dir, name="straight", train={"steps": 12})).fit()
        first = Orchestrator(tiny_job(dataset_dir, runs_dir, name="resumed", train={"steps": 8})).fit()
        second = Orchestrator(tiny_job(dataset_dir, runs_dir, name="resumed", train={"steps": 12}), resume=True).fit()
    finally:
        ray.shutdown()
    return {"dir": runs_dir, "straight": straight, "first": first, "second": second}


def losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_fit_trains_checkpoints_and_reports(runs):
    result, run_dir = runs["straight"], runs["dir"] / "straight"
    curve = losses(result.metrics)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.5  # from ~ln(257) towards the byte distribution
    assert result.checkpoint == run_dir / "step_00000012"
    assert read_info(result.checkpoint).consumed_samples == 12 * 8
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_00000008", "step_00000012"]  # keep_last = 2
    report = json.loads((run_dir / "report.json").read_text())
    assert report["final_step"] == 12 and report["world_size"] == 2 and report["status"] == "completed"
    assert report["tokens_seen"] == 12 * 8 * 32
    assert report["final_val_loss"] == result.report.final_val_loss < 5.0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines if "loss" in row] == list(range(1, 13))


def test_resume_continues_exactly_where_an_uninterrupted_run_would_be(runs):
    first, second = runs["first"], runs["second"]
    start = next(r for r in second.metrics if r.get("event") == "start")
    assert start["step"] == 8
    assert sorted(losses(second.metrics)) == [9, 10, 11, 12]
    assert read_info(second.checkpoint).consumed_samples == 12 * 8
    expected, got = losses(runs["straight"].metrics), {**losses(first.metrics), **losses(second.metrics)}
    for step in range(1, 13):  # same weights, optimizer state and samples ⇒ the same losses
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    assert second.report.start_step == 8 and second.report.final_step == 12
    assert second.report.tokens_seen == 12 * 8 * 32 and second.report.tokens_this_run == 4 * 8 * 32


def test_resume_refuses_a_checkpoint_of_another_model(runs, dataset_dir):
    wider = tiny_job(dataset_dir, runs["dir"], name="resumed", train={"steps": 16}, model={"n_embd": 64})
    with pytest.raises(CheckpointError) as info:
        Orchestrator(wider, resume=True).fit()
    assert "checkpoint is from another model (n_embd: checkpoint 32, config 64)" in str(info.value)
    assert "step_00000012" in str(info.value)


def test_a_second_run_of_the_same_name_needs_resume_or_overwrite(runs, dataset_dir):
    with pytest.raises(ConfigError) as info:
        Orchestrator(tiny_job(dataset_dir, runs["dir"], name="straight")).fit()
    assert "already holds a run" in str(info.value) and "--resume" in str(info.value)
    assert (runs["dir"] / "straight" / "step_00000012").is_dir()  # nothing was deleted
