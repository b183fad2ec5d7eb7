"""The training loop's throughput window: validation and checkpoint saves are not charged to training steps."""

import time

import torch

from workers.loop import MetricsWindow

TOKENS_PER_STEP = 1000


def step(window: MetricsWindow, number: int, seconds: float) -> None:
    time.sleep(seconds)
    window.record(number, 1e-3, torch.tensor(2.0), torch.tensor(1.0))


def test_a_pause_before_the_flush_is_not_charged_to_the_window():
    window = MetricsWindow()
    step(window, 1, 0.05)
    with window.paused():  # a checkpoint save in the middle of a window
        time.sleep(0.5)
    step(window, 2, 0.05)
    rows = window.flush(TOKENS_PER_STEP, consumed_samples=8)
    assert rows[-1]["tokens_per_s"] > 2 * TOKENS_PER_STEP / 0.4 and rows[-1]["consumed_samples"] == 8


def test_a_pause_after_the_flush_is_not_charged_to_the_next_window():
    window = MetricsWindow()
    step(window, 1, 0.05)
    window.flush(TOKENS_PER_STEP, consumed_samples=4)
    with window.paused():  # validation runs after the flush that logged its step
        time.sleep(0.5)
    step(window, 2, 0.05)
    assert window.flush(TOKENS_PER_STEP, consumed_samples=8)[-1]["tokens_per_s"] > TOKENS_PER_STEP / 0.4
