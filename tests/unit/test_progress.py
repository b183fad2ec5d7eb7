"""The driver's progress output: the bill on the progress line, alerts as they fire, any event row."""

import io
import struct
import time
from pathlib import Path

import pytest
from rich.console import Console
from tensorboardX.proto import event_pb2

from core.config import JobConfig
from orchestrator.accounting.live_bill import LiveBill
from orchestrator.accounting.report import RunReport
from orchestrator.progress import ProgressDisplay
from tests.unit.test_bill import START, plan, steps


def console() -> Console:
    return Console(file=io.StringIO(), width=200, force_terminal=False)


def printed(display: ProgressDisplay) -> str:
    return display.console.file.getvalue()


def test_an_event_the_display_does_not_know_is_shown_with_its_fields():
    display = ProgressDisplay(console(), total_steps=20, first_step=0)
    display.update([{"event": "restart", "time": 1795962887.25, "attempt": 2, "step": 8, "world_size": 1,
                     "previous_world_size": 2, "recovery_s": 12.5}, {"event": "hiccup"}])
    out = printed(display)
    assert ("event: restart  time 1.8e+09  attempt 2  step 8  world_size 1  previous_world_size 2  "
            "recovery_s 12.5") in out
    assert "event: hiccup" in out


def test_the_start_line_says_where_training_starts_from():
    display = ProgressDisplay(console(), total_steps=20, first_step=0)
    start = {"event": "start", "step": 0, "world_size": 2, "device": "cpu", "params": 120_000, "pretrained_reader": None}
    display.update([start, {**start, "pretrained_reader": "posix"}, {**start, "step": 8}])
    assert printed(display).splitlines() == ["training from scratch on 2 workers (cpu), 0.12M parameters",
                                             "training from the pretrained weights on 2 workers (cpu), 0.12M parameters",
                                             "training from step 8 on 2 workers (cpu), 0.12M parameters"]


def bill_config(tmp_path, **bill) -> JobConfig:
    return JobConfig.from_dict({"name": "live", "bill": {"tensorboard": False, "prometheus": False, **bill}})


def test_the_progress_line_shows_loss_tokens_mfu_and_dollars(tmp_path):
    # The rows arrive 10 s after fit started: $5.98/h × 10 s = $0.0166.
    bill = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False, started=time.monotonic() - 10.0)
    display = ProgressDisplay(console(), total_steps=20, first_step=0, bill=bill)
    display.update([START, *steps(1, 2)])
    line = printed(display).splitlines()[-1]
    assert line.startswith("step 2/20  loss 3.0000  65,536 tok/s  MFU 2.5%  $0.0166  elapsed")
    assert (tmp_path / "bill.jsonl").read_text().count("\n") == 2


def test_an_alert_is_printed_when_it_fires(tmp_path):
    bill = LiveBill.open(plan(), bill_config(tmp_path, alerts={"mfu_floor": 0.5}), tmp_path, resumed=False,
                         started=time.monotonic())
    display = ProgressDisplay(console(), total_steps=20, first_step=0, bill=bill)
    display.update([START, *steps(1, 2)])  # the first window is warm-up
    display.update(steps(3, 4))
    assert "alert: step 4: MFU 2.5% is below the floor of 50%" in printed(display)


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files, read back record by record (TFRecord framing: length, crc, data, crc)."""
    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_events_hold_the_bill(tmp_path):
    config = JobConfig.from_dict({"name": "tb", "bill": {"prometheus": False}})
    bill = LiveBill.open(plan(), config, tmp_path, resumed=False, started=time.monotonic())
    rows, _ = bill.update([START, *steps(1, 2)])
    bill.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss/train"] == {1: 3.0, 2: 3.0}
    assert scalars["bill/dollars"][2] == pytest.approx(rows[-1]["dollars"], rel=1e-6)
    assert scalars["throughput/mfu"][2] == pytest.approx(0.024640, rel=1e-4)


def test_a_resumed_run_carries_on_from_the_last_bill_line(tmp_path):
    # An hour on two H100s: $5.98.
    first = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False, started=time.monotonic() - 3600.0)
    first.update([START, *steps(1, 2)])
    first.close()
    # Half an hour more after the resume: $2.99.
    second = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=True, started=time.monotonic() - 1800.0)
    rows, _ = second.update([{**START, "step": 2}, *steps(3, 4)])
    assert rows[-1]["dollars"] == pytest.approx(5.98 + 2.99, rel=1e-4)
    assert rows[-1]["elapsed_s"] == pytest.approx(5400.0, abs=1.0)
    fresh = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False, started=time.monotonic())
    assert fresh.meter.dollars == 0.0  # a new run does not inherit (its directory is emptied first anyway)


def test_the_live_bill_and_the_report_count_dollars_from_the_same_instant(tmp_path):
    """fit starts both clocks at once: the dollars of the last step (the curves, the cost of each target) and the
    bill line (the price × the invocation's wall time) agree, start-up included."""
    fit_started = time.monotonic() - 100.0  # dataset checks, Ray's start and planning before the first rows arrive
    rows = [START, *steps(1, 2)]
    LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False, started=fit_started).update(rows)
    report = RunReport.from_rows(rows, plan=plan(), name="live", status="completed", run_dir=str(tmp_path),
                                 started_at="2026-12-03T00:00:00+00:00", wall_seconds=time.monotonic() - fit_started,
                                 checkpoint_path=None, checkpoint_step=None, metrics_path="",
                                 config=bill_config(tmp_path).to_dict())
    assert report.dollars == pytest.approx(5.98 * 100 / 3600, rel=1e-3)
    assert report.run_dollars == pytest.approx(report.dollars, rel=1e-3)


def test_a_plain_log_prints_the_step_line_on_validation_steps_too():
    display = ProgressDisplay(console(), total_steps=20, first_step=0)
    display.update([START, *steps(1, 10, val_loss=2.5)])
    lines = printed(display).splitlines()
    assert lines[-2].startswith("step 10/20  loss 3.0000  65,536 tok/s") and lines[-1] == "step 10: validation loss 2.5000"
