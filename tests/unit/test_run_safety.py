"""Never lose or fake a run, on the driver alone (no Ray): --overwrite keeps the earlier run until the new one
commits, --resume of a trained run touches nothing, and a run that trained nothing rewrites no report or bill.

The run directories here are real ones (DCP checkpoints, plan.json, report.json, metrics and bill); the training
that Ray would run is replaced where a test needs rows to arrive and then fail."""

from __future__ import annotations

import dataclasses
import io
import json
import os

import pytest
import ray
from rich.console import Console

from core.errors import CheckpointError, ClusterError, DataError
from orchestrator import Orchestrator
from orchestrator.accounting.bill import BillMeter, Rates
from orchestrator.accounting.report import RunReport
from orchestrator.accounting.report_html import PLOTS, render_report
from orchestrator.cli import main
from orchestrator.run_dir import RunDirectory
from tests.checkpoint_support import trained
from tests.conftest import tiny_job, write_job
from tests.engine_support import job_spec
from workers import checkpoint

STEPS = 8


def snapshot(root) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time."""
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, files in os.walk(root) for f in files}


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def printed(console: Console) -> str:
    return console.file.getvalue()


@pytest.fixture
def config(tmp_path, dataset_dir):
    return tiny_job(dataset_dir, tmp_path / "runs", train={"steps": STEPS})


@pytest.fixture
def finished(config) -> RunDirectory:
    return finished_run(config, consumed_samples=STEPS * 8)


def finished_run(config, *, consumed_samples: int) -> RunDirectory:
    """A run as fit leaves it after training STEPS steps, consumed_samples samples: a committed checkpoint
    of the last step, plan.json, metrics, bill and report."""
    run = RunDirectory(config.runs_dir, config.name)
    run.create(overwrite=False)
    spec = job_spec(config)
    model, optimizer = trained(0, config)
    checkpoint.save(run.checkpoints.step(STEPS), model, optimizer,
                    checkpoint.CheckpointInfo.for_spec(spec, STEPS, consumed_samples, 2)).result()
    spec.plan.save(run.plan_path)
    rows = [{"event": "start", "step": 0, "world_size": 2, "device": "cpu", "params": 1, "flops_per_token": 1.0},
            *({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0} for s in range(1, STEPS + 1))]
    rows[-1]["consumed_samples"] = consumed_samples
    run.append_metrics(rows)
    bill = BillMeter(Rates.from_plan(spec.plan)).observe(rows)
    (run.path / "bill.jsonl").write_text("".join(json.dumps(row) + "\n" for row in bill))
    RunReport.from_rows(rows, plan=spec.plan, name=config.name, status="completed", run_dir=str(run.path),
                        started_at="2026-12-01T00:00:00+00:00", wall_seconds=10.0,
                        checkpoint_path=str(run.checkpoints.step(STEPS)), checkpoint_step=STEPS,
                        metrics_path=str(run.metrics_path), config=config.to_dict()).save(run.report_path)
    return run


def test_resume_of_a_trained_run_says_so_exits_0_and_touches_nothing(capsys, tmp_path, config, finished):
    before = snapshot(tmp_path / "runs")
    code = main(["fit", str(write_job(tmp_path / "job.toml", config)), "--resume"])
    out = capsys.readouterr().out.replace("\n", "")
    assert code == 0 and f"run 'tiny' is trained to step {STEPS}" in out and f"[train] steps = {STEPS}: nothing to train" in out
    assert "Raise [train] steps to train further" in out and "tokens/s" not in out  # no empty summary
    assert snapshot(tmp_path / "runs") == before and not ray.is_initialized()


def test_resume_of_an_adaptive_run_that_trained_its_samples_in_fewer_steps_says_so(capsys, tmp_path, dataset_dir):
    """An adaptive batch trains [train] steps × global_batch_size samples, in however many steps its batches
    take: here STEPS + 2 steps' worth in STEPS larger steps."""
    adaptive = tiny_job(dataset_dir, tmp_path / "runs", train={"steps": STEPS + 2, "batch_size": "adaptive",
                                                               "min_batch_size": 8, "max_batch_size": 16})
    finished_run(adaptive, consumed_samples=(STEPS + 2) * 8)
    before = snapshot(tmp_path / "runs")
    code = main(["fit", str(write_job(tmp_path / "job.toml", adaptive)), "--resume"])
    out = capsys.readouterr().out.replace("\n", "")
    assert code == 0 and f"is trained to step {STEPS}" in out, out
    assert f"{(STEPS + 2) * 8} samples, and an adaptive batch trains [train] steps × global_batch_size = {STEPS + 2} × 8" in out
    assert snapshot(tmp_path / "runs") == before and not ray.is_initialized()


def test_overwrite_that_cannot_start_gives_the_earlier_run_back(config, finished):
    before = snapshot(finished.path)
    with pytest.raises(ClusterError, match="cannot connect"):
        Orchestrator(config, address="127.0.0.1:1", overwrite=True, console=quiet()).fit()
    assert snapshot(finished.path) == before and not finished.previous_path.exists()


def test_overwrite_keeps_the_earlier_run_aside_until_the_new_one_commits(config, finished):
    before = snapshot(finished.path)
    run = RunDirectory(config.runs_dir, config.name)
    aside = run.create(overwrite=True)
    assert list(run.path.iterdir()) == [] and {p.replace(str(finished.path), str(run.previous_path))
                                               for p in before} == set(snapshot(run.previous_path))
    aside.restore()
    assert snapshot(run.path) == before and not run.previous_path.exists()
    run.create(overwrite=True).discard()
    assert list(run.path.iterdir()) == [] and not run.previous_path.exists()


def test_a_replacement_stopped_without_a_word_leaves_the_earlier_run_aside_and_a_later_overwrite_keeps_it(
        config, finished):
    run = RunDirectory(config.runs_dir, config.name)
    run.create(overwrite=True)  # then the driver was killed before the new run committed
    (run.path / "plan.json").write_text("{}")
    kept = snapshot(run.previous_path)
    with pytest.raises(Exception, match=f"{run.previous_path} holds the run an interrupted --overwrite set aside"):
        run.checkpoint_to_resume()
    again = run.create(overwrite=True)
    assert snapshot(run.previous_path) == kept and list(run.path.iterdir()) == []
    assert run.create(overwrite=False) is None and snapshot(run.previous_path) == kept  # no --overwrite: left alone
    again.restore()
    assert run.checkpoint_to_resume() == (run.checkpoints.step(STEPS).local_path, [])


def ctrl_c_after(config, monkeypatch, steps: int, *, committed: bool) -> Orchestrator:
    """A fit whose workers train `steps` steps (and commit the last one's checkpoint, when `committed`)
    before Ctrl-C reaches the driver; the Orchestrator after it left."""
    def trains_then_ctrl_c(self, *args):
        spec = job_spec(self.config)
        spec.plan.save(self.run.plan_path)
        if committed:
            checkpoint.save(self.run.checkpoints.step(steps), *trained(0, self.config),
                            checkpoint.CheckpointInfo.for_spec(spec, steps, steps * 8, 2)).result()
        rows = [{"event": "start", "step": 0, "world_size": 2, "device": "cpu", "params": 1, "flops_per_token": 1.0},
                *({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0, "consumed_samples": 8 * s}
                  for s in range(1, steps + 1))]
        self.run.append_metrics(rows)  # as fit's _collect does with what the workers send
        self._rows += rows
        raise KeyboardInterrupt
    monkeypatch.setattr(Orchestrator, "_train_on_ray", trains_then_ctrl_c)
    orchestrator = Orchestrator(config, console=quiet())
    with pytest.raises(KeyboardInterrupt):
        orchestrator.fit()
    return orchestrator


def test_an_interrupted_run_writes_its_report_marked_interrupted_and_report_reads_it(config, monkeypatch):
    orchestrator = ctrl_c_after(config, monkeypatch, 4, committed=False)
    report = RunReport.load(orchestrator.run.path)
    assert (report.status, report.final_step, report.final_train_loss) == ("interrupted", 4, pytest.approx(4.6))
    rendered = render_report([orchestrator.run.path], orchestrator.run.path)
    assert "<td>status</td><td>interrupted: stopped by Ctrl-C" in rendered.html.read_text()
    assert len(rendered.plots) == len(PLOTS)


def test_a_run_stopped_after_its_last_checkpoint_is_reported_completed(config, monkeypatch):
    """Ctrl-C while the workers shut down, after the last step's checkpoint committed: nothing is missing."""
    orchestrator = ctrl_c_after(config, monkeypatch, STEPS, committed=True)
    assert RunReport.load(orchestrator.run.path).status == "completed"


def test_a_resume_that_trains_nothing_rewrites_no_report_and_no_bill(config, finished, monkeypatch):
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=STEPS + 4))

    def fails_before_a_step(self, *args):
        raise DataError("a worker found a bad shard", where="data/x/train-00000.tokens", fix="prepare it again")
    monkeypatch.setattr(Orchestrator, "_train_on_ray", fails_before_a_step)
    before = {p: open(p, "rb").read() for p in (finished.report_path, finished.path / "bill.jsonl")}
    with pytest.raises(DataError):
        Orchestrator(longer, resume=True, console=quiet()).fit()
    assert {p: open(p, "rb").read() for p in before} == before



def decaying(config, steps: int):
    train = dataclasses.replace(config.train, steps=steps, lr=2e-3, min_lr=2e-4, warmup_steps=2)
    return dataclasses.replace(config, train=train)


def test_a_resume_with_more_steps_continues_the_learning_rate_the_checkpoint_recorded(config):
    """Six steps of an 8-step cosine are committed; the config now says 12. The workers get a schedule whose
    next rate is the 8-step one's at step 6, not the jump back up a 12-step cosine would make."""
    eight, twelve = decaying(config, 8), decaying(config, 12)
    run = RunDirectory(config.runs_dir, config.name)
    run.create(overwrite=False)
    model, optimizer = trained(0, config)
    checkpoint.save(run.checkpoints.step(6), model, optimizer,
                    checkpoint.CheckpointInfo.for_spec(job_spec(eight), 6, 48, 2)).result()
    recorded = checkpoint.read_info(run.checkpoints.step(6)).lr_schedule
    assert recorded == job_spec(eight).lr_schedule
    console = quiet()
    orchestrator = Orchestrator(twelve, resume=True, console=console)
    start = orchestrator._open_run(orchestrator._resume_point(orchestrator._dataset()))
    assert start.step == 6 and start.lr_schedule.lr_at(6) == recorded.lr_at(6) < job_spec(twelve).lr_schedule.lr_at(6)
    assert start.lr_schedule.lr_at(11) > start.lr_schedule.lr_at(12) == pytest.approx(2e-4)
    assert f"[train] steps 8 → 12: the learning rate goes on from {recorded.lr_at(6):.3g} at step 6" in printed(console)


def test_a_resume_with_another_global_batch_is_refused(config, finished):
    doubled = dataclasses.replace(config, train=dataclasses.replace(config.train, global_batch_size=16))
    with pytest.raises(CheckpointError, match="global_batch_size = 8 samples, the config has 16"):
        Orchestrator(doubled, resume=True, console=quiet()).fit()
