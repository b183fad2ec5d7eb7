"""report.html of an elastic run, from files alone (no Ray): a worker lost at step 6, the group shrunk
to one worker and restarted from step 4. Without bill.jsonl the report bills the metrics again,
each step taking its measured time."""

import json
from types import SimpleNamespace

import pytest

from core.config import JobConfig
from orchestrator.accounting.report import RunReport
from orchestrator.accounting.report_html import PLOTS, render_report
from orchestrator.accounting.bill import mfu
from tests.unit.test_bill import FLOPS_PER_TOKEN, START, plan, steps


def window(first: int, last: int, **extra) -> list[dict]:
    rows = steps(first, last)
    rows[-1].update(extra)
    return rows


ROWS = [START, *window(1, 2), *window(3, 4, val_loss=3.5), {"event": "checkpoint", "step": 4}, *window(5, 6),
        {"event": "worker_lost", "time": 1.0e9, "attempt": 1, "step": 6, "ranks": [1], "error": "ActorDiedError"},
        {"event": "resize", "time": 1.0e9, "attempt": 2, "world_size": 1, "previous_world_size": 2, "step": 6},
        {"event": "replan", "time": 1.0e9, "attempt": 2, "world_size": 1, "micro_batch_sizes": [32]},
        {**START, "step": 4, "world_size": 1},
        {"event": "restart", "time": 1.0e9, "attempt": 2, "step": 4, "world_size": 1, "previous_world_size": 2,
         "steps_redone": 2, "recovery_s": 31.5},
        *window(5, 6), *window(7, 8, val_loss=3.0)]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "elastic"
    run.mkdir()
    the_plan = plan()
    the_plan.save(run / "plan.json")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = JobConfig.from_dict({"name": "elastic", "bill": {"targets": [3.2]}}).to_dict()
    RunReport.from_rows(ROWS, plan=the_plan, name="elastic", status="completed", run_dir=str(run),
                        started_at="2026-11-29T12:00:00+00:00", wall_seconds=100.0, checkpoint_path=None,
                        checkpoint_step=None, metrics_path=str(run / "metrics.jsonl"), config=config).save(
        run / "report.json")
    return run


def test_the_report_of_an_elastic_run_bills_the_redone_steps(run_dir):
    report = RunReport.load(run_dir)
    assert [e["event"] for e in report.events] == ["start", "worker_lost", "resize", "replan", "start", "restart"]
    # 6 steps of 0.5 s on 2 workers ($5.98/h), then steps 5–8 again on 1 ($2.99/h): (3 × 5.98 + 2 × 2.99) / 3600;
    # the rest of the invocation's 100 s (start-up, the last checkpoint) on the last group's 1 worker.
    assert report.run_dollars == report.dollars == pytest.approx((23.92 + 95 * 2.99) / 3600)
    assert report.device_hours == pytest.approx((3 * 2 + 2 * 1 + 95 * 1) / 3600)
    # Throughput and MFU are the last group's: one H100 (989.4 TFLOP/s), not the first group's two.
    assert report.world_size == 1 and report.peak_tflops == pytest.approx(989.4)
    assert report.mfu == pytest.approx(mfu(FLOPS_PER_TOKEN, 65536.0, 989.4))
    # Validation 3.5 at step 4 and 3.0 at step 8 (the redone path): 3.2 is 60% of the way, at step 6.4.
    (target,) = report.convergence
    assert target["reached"] and target["step"] == pytest.approx(6.4)
    assert dict(report.summary_rows())["events"] == "2 × start, 1 × worker_lost, 1 × resize, 1 × replan, 1 × restart"


def test_report_html_holds_the_numbers_the_events_and_every_plot(run_dir):
    rendered = render_report([run_dir], run_dir)
    page = rendered.html.read_text()
    report = RunReport.load(run_dir)
    assert f"${report.dollars:.4f}" in page and "0 → 8" in page
    assert "<td>restart</td>" in page and "steps_redone 2" in page and "recovery_s 31.5" in page
    assert "<td>step time (s)</td><td>0.4</td><td>0.5</td><td>+25%</td>" in page  # predicted, measured, error
    assert [p.name for p in rendered.plots] == [f"{name}.png" for name in PLOTS]
    assert page.count("data:image/png;base64,") == len(PLOTS)


def test_comparing_runs_with_different_tokenizers_says_their_losses_do_not_compare(run_dir, tmp_path, capsys):
    import dataclasses
    import shutil

    from orchestrator.cli import main

    other = tmp_path / "bpe"
    shutil.copytree(run_dir, other)
    bpe = dataclasses.replace(RunReport.load(other), name="bpe", run_dir=str(other), tokenizer="hf-json:5c1f9a")
    bpe.save(other / "report.json")
    code = main(["report", str(run_dir), str(other), "--out", str(tmp_path / "both")])
    out = capsys.readouterr().out.replace("\n", " ")
    assert code == 0 and ("careful: their losses are not comparable: 'elastic' was trained on 'bytes' tokens and "
                          "'bpe' on 'hf-json:5c1f9a'") in out
    assert "Careful: their losses are not comparable" in (tmp_path / "both" / "report.html").read_text()
    same = dataclasses.replace(bpe, tokenizer="bytes")
    assert RunReport.load(run_dir).losses_compare_with(same) is None


def test_a_resumed_run_shows_and_compares_what_all_of_it_cost(run_dir, tmp_path):
    """Its last invocation cost $1 for 1M of the run's 4M tokens; the run, over every invocation, $5."""
    import dataclasses

    from orchestrator.accounting.report_html import _comparison

    whole = dataclasses.replace(RunReport.load(run_dir), start_step=6, dollars=1.0, run_dollars=5.0,
                                tokens_this_run=1_000_000, tokens_seen=4_000_000, tokens_per_dollar=1e6)
    rows = dict(whole.summary_rows())
    assert rows["bill"].endswith("(this invocation)")
    assert rows["bill, whole run"] == "$5.0000 over every invocation since step 0, 800,000 tokens per dollar"
    one_go = dataclasses.replace(whole, name="one-go", start_step=0, dollars=2.5, run_dollars=2.5)
    table = _comparison([SimpleNamespace(report=whole), SimpleNamespace(report=one_go)])
    assert "<td>bill, whole run ($)</td><td>5.0000</td><td>2.5000</td><td>0.5×</td>" in table
    assert "<td>tokens per dollar</td><td>800,000</td><td>1,600,000</td><td>2×</td>" in table


def test_an_adaptive_run_is_reported_at_the_batches_it_trained(tmp_path):
    """Two steps at the plan's 32 samples, then a batch_change to 64 and two steps at it, all at
    65,536 tokens/s: the run trained (2 × 32 + 2 × 64) × 1,024 tokens, its steps took 0.5 s and 1.0 s
    (median 0.75 s), and the batch plot draws both batches beside the noise scale that chose them."""
    rows = [START, *[{"step": s, "loss": 3.0, "tokens_per_s": 65536.0, "global_batch": 32, "noise_scale": 60.0}
                     for s in (1, 2)],
            {"event": "batch_change", "step": 2, "from": 32, "to": 64, "noise_scale": 60.0},
            *[{"step": s, "loss": 2.9, "tokens_per_s": 65536.0, "global_batch": 64, "noise_scale": 80.0}
              for s in (3, 4)]]
    rows[-1]["consumed_samples"] = 192
    run = tmp_path / "adaptive"
    run.mkdir()
    the_plan = plan()
    the_plan.save(run / "plan.json")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = RunReport.from_rows(rows, plan=the_plan, name="adaptive", status="completed", run_dir=str(run),
                                 started_at="2026-12-04T12:00:00+00:00", wall_seconds=3.0, checkpoint_path=None,
                                 checkpoint_step=None, metrics_path=str(run / "metrics.jsonl"),
                                 config=JobConfig.from_dict({"name": "adaptive"}).to_dict())
    assert report.tokens_this_run == 192 * 1024 and report.tokens_seen == 192 * 1024
    assert report.step_seconds == pytest.approx(0.75)
    assert report.run_dollars == pytest.approx(5.98 * 3.0 / 3600)  # 0.5 + 0.5 + 1.0 + 1.0 s, no clock
    report.save(run / "report.json")
    rendered = render_report([run], run)
    assert (run / "batch_and_noise.png").stat().st_size > 10_000
    assert "<td>batch_change</td>" in rendered.html.read_text()


def test_a_resumed_invocation_pays_its_own_span_and_the_run_every_invocation(tmp_path):
    """bill.jsonl holds an earlier invocation ($1.00 by 100 s) and this one's steps 5–8 (to $1.40, 140 s on
    the meter); this invocation ran 50 s in all, the 10 s after its last step at the plan's $5.98/h."""
    run = tmp_path / "resumed"
    run.mkdir()
    earlier = [{"step": s, "elapsed_s": 25.0 * s, "dollars": 0.25 * s, "loss": 3.0} for s in range(1, 5)]
    ours = [{"step": s, "elapsed_s": 100.0 + 10 * (s - 4), "dollars": 1.0 + 0.1 * (s - 4), "loss": 3.0}
            for s in range(5, 9)]
    (run / "bill.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier + ours))
    rows = [{**START, "step": 4}, *steps(5, 8)]
    report = RunReport.from_rows(rows, plan=plan(), name="resumed", status="completed", run_dir=str(run),
                                 started_at="2026-12-05T10:00:00+00:00", wall_seconds=50.0, checkpoint_path=None,
                                 checkpoint_step=None, metrics_path=str(run / "metrics.jsonl"),
                                 config=JobConfig.from_dict({"name": "resumed"}).to_dict())
    tail = 5.98 * 10 / 3600
    assert report.dollars == pytest.approx(0.4 + tail)
    assert report.run_dollars == pytest.approx(1.4 + tail)
