"""The bill of a real run: conftest.py's `straight` fit, then its report, exports and a comparison.

While that run trained, a thread scraped the head node's metrics port for the Prometheus gauge the
driver sets (conftest.py's Scraper).
"""

import json
import shutil
import subprocess

import pytest

from orchestrator.accounting.report_html import PLOTS, render_report
from orchestrator.cli import main
from tests.integration.conftest import BILL_TARGETS
from tests.unit.test_progress import tensorboard_scalars

pytestmark = pytest.mark.integration
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(straight):
    return {"dir": straight.dir, "result": straight.result, "scraped_dollars": straight.scraped_dollars,
            "steps": straight.steps}


def bill_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "bill.jsonl").read_text().splitlines()]


def test_the_report_holds_the_bill_of_the_run(run):
    report, rows = run["result"].report, bill_rows(run["dir"])
    assert [r["step"] for r in rows] == list(range(1, run["steps"] + 1))
    assert report.final_step == run["steps"]
    # Dollars grow with the wall clock; the bill's rate is the plan's: 2 CPU workers × $0.05 per core-hour. One
    # invocation of one worker group: the whole wall time at that rate, the meter's to the last step and the rest.
    assert report.dollars_per_hour == pytest.approx(0.10)
    assert report.run_dollars == report.dollars == pytest.approx(0.10 * report.wall_seconds / 3600)
    assert report.dollars > rows[-1]["dollars"] > 0
    assert all(b["dollars"] >= a["dollars"] for a, b in zip(rows, rows[1:]))
    assert rows[-1]["dollars"] == pytest.approx(0.10 * rows[-1]["elapsed_s"] / 3600)
    assert report.tokens_per_dollar == pytest.approx(report.tokens_this_run / report.dollars)
    # MFU against the nominal CPU peak (2 cores × 0.1 TFLOP/s), from the model's FLOPs per token.
    start = next(r for r in run["result"].metrics if r.get("event") == "start")
    assert report.peak_tflops == pytest.approx(0.2)
    assert report.mfu == pytest.approx(start["flops_per_token"] * report.tokens_per_second / 0.2e12)
    assert report.prediction_error == pytest.approx(report.step_seconds / report.predicted_step_seconds - 1)
    assert [e["event"] for e in report.events] == ["start"]
    targets = {c["target"]: c for c in report.convergence}
    assert sorted(targets) == sorted(BILL_TARGETS)
    assert targets[5.0]["reached"] and targets[5.0]["dollars"] <= rows[-1]["dollars"]
    assert not targets[1.0]["reached"]
    saved = json.loads((run["dir"] / "report.json").read_text())
    assert saved["convergence"] == report.convergence and saved["run_dollars"] == report.run_dollars


def test_prometheus_and_tensorboard_got_the_same_numbers(run):
    last = bill_rows(run["dir"])[-1]
    assert run["scraped_dollars"] and run["scraped_dollars"][-1] == pytest.approx(last["dollars"], rel=1e-6)
    scalars = tensorboard_scalars(run["dir"] / "tensorboard")
    steps = run["steps"]
    assert sorted(scalars["loss/train"]) == list(range(1, steps + 1))
    assert scalars["bill/dollars"][steps] == pytest.approx(last["dollars"], rel=1e-6)
    assert scalars["loss/train"][steps] == pytest.approx(run["result"].report.final_train_loss, rel=1e-6)


def test_archipelago_report_writes_html_and_plots_with_the_runs_numbers(run, capsys):
    assert main(["report", str(run["dir"])]) == 0
    assert f"report.html and {len(PLOTS)} plots" in capsys.readouterr().out
    report = run["result"].report
    page = (run["dir"] / "report.html").read_text()
    assert f"{report.final_train_loss:.4f}" in page and f"{report.final_val_loss:.4f}" in page
    assert f"${report.dollars:.4f}" in page and f"0 → {run['steps']}" in page
    assert page.count("data:image/png;base64,") == len(PLOTS) and "<script" not in page
    for name in PLOTS:
        data = (run["dir"] / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


def test_two_runs_side_by_side(run, tmp_path):
    # A second run that cost half as much for the same curve: its report.json and bill say so.
    twin = tmp_path / "half-price"
    shutil.copytree(run["dir"], twin, ignore=shutil.ignore_patterns("step_*", "tensorboard"))
    saved = json.loads((twin / "report.json").read_text())
    saved.update(name="half-price", dollars=saved["dollars"] / 2, run_dollars=saved["run_dollars"] / 2,
                 convergence=[{**c, "dollars": c["dollars"] and c["dollars"] / 2} for c in saved["convergence"]])
    (twin / "report.json").write_text(json.dumps(saved))
    (twin / "bill.jsonl").write_text("".join(json.dumps({**r, "dollars": r["dollars"] / 2}) + "\n"
                                             for r in bill_rows(run["dir"])))
    rendered = render_report([run["dir"], twin], tmp_path / "compare")
    page = rendered.html.read_text()
    assert "straight vs half-price" in page and "half-price ÷ straight" in page
    assert "<td>bill, whole run ($)</td>" in page and page.count("<td>0.5×</td>") >= 2  # the bill and $ to reach 5.0
    assert "<td>tokens per dollar</td>" in page and "<td>2×</td>" in page
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in rendered.plots)


def test_a_run_directory_without_a_report_is_one_line(run, tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "report.json: cannot read it" in out and "Traceback" not in out


CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(name)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium or Chrome binary on this machine (.ci/run installs "
                                               "Debian's chromium)")
def test_report_html_renders_in_a_headless_browser(run, tmp_path):
    main(["report", str(run["dir"])])
    shot = tmp_path / "report.png"
    # As root (CI) Chromium needs --no-sandbox; with no network here, the background-networking flags
    # keep it from trying Google's hosts at every start.
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,3000",
                    (run["dir"] / "report.html").as_uri()], check=True, timeout=60, capture_output=True)
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 20_000
