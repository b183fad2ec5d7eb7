"""The driver's progress output: the bill on the progress line, alerts as they fire, any event row."""

import io
import struct
from pathlib import Path

import pytest
from rich.console import Console
from tensorboardX.proto import event_pb2

from core.config import JobConfig
from orchestrator.accounting.live_bill import LiveBill
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


def bill_config(tmp_path, **bill) -> JobConfig:
    return JobConfig.from_dict({"name": "live", "bill": {"tensorboard": False, "prometheus": False, **bill}})


def test_the_progress_line_shows_loss_tokens_mfu_and_dollars(tmp_path):
    bill = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False)
    bill.started -= 10.0  # the rows arrive 10 s after the launch: $5.98/h × 10 s = $0.0166
    display = ProgressDisplay(console(), total_steps=20, first_step=0, bill=bill)
    display.update([START, *steps(1, 2)])
    line = printed(display).splitlines()[-1]
    assert line.startswith("step 2/20  loss 3.0000  65,536 tok/s  MFU 2.5%  $0.0166  elapsed")
    assert (tmp_path / "bill.jsonl").read_text().count("\n") == 2


def test_an_alert_is_printed_when_it_fires(tmp_path):
    bill = LiveBill.open(plan(), bill_config(tmp_path, alerts={"mfu_floor": 0.5}), tmp_path, resumed=False)
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
    bill = LiveBill.open(plan(), config, tmp_path, resumed=False)
    rows, _ = bill.update([START, *steps(1, 2)])
    bill.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss/train"] == {1: 3.0, 2: 3.0}
    assert scalars["bill/dollars"][2] == pytest.approx(rows[-1]["dollars"], rel=1e-6)
    assert scalars["throughput/mfu"][2] == pytest.approx(0.024640, rel=1e-4)


def test_a_resumed_run_carries_on_from_the_last_bill_line(tmp_path):
    first = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False)
    first.started -= 3600.0  # an hour on two H100s: $5.98
    first.update([START, *steps(1, 2)])
    first.close()
    second = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=True)
    second.started -= 1800.0  # half an hour more after the resume: $2.99
    rows, _ = second.update([{**START, "step": 2}, *steps(3, 4)])
    assert rows[-1]["dollars"] == pytest.approx(5.98 + 2.99, rel=1e-4)
    assert rows[-1]["elapsed_s"] == pytest.approx(5400.0, abs=1.0)
    fresh = LiveBill.open(plan(), bill_config(tmp_path), tmp_path, resumed=False)
    assert fresh.meter.dollars == 0.0  # a new run does not inherit (its directory is emptied first anyway)
