"""Each alert fires on a synthetic series that should raise it, and stays quiet on a healthy one."""

import math

import pytest

from core.config import AlertsConfig
from orchestrator.accounting.alerts import AlertMonitor


def series(count: int = 400, *, dollars_per_step=lambda step: 0.01, val=None, mfu=0.45, skipped=None,
           recompilations=None, loss=lambda step: 3.0, window: int = 10) -> list[dict]:
    """Bill rows: a log window every `window` steps, a validation every 100 steps."""
    rows, dollars = [], 0.0
    for step in range(1, count + 1):
        dollars += dollars_per_step(step)
        row = {"step": step, "dollars": dollars, "loss": loss(step), "tokens_per_s": 1000.0}
        if step % window == 0:
            row.update(window_end=True, mfu=mfu(step) if callable(mfu) else mfu)
            if skipped is not None:
                row["skipped_steps"] = skipped(step)
            if recompilations is not None:
                row["recompilations"] = recompilations(step)
        if step % 100 == 0:
            row["val_loss"] = val(step) if val else 3.0 - step / 1000
        rows.append(row)
    return rows


def fired(rows, *, gpu=True, **config) -> list:
    monitor = AlertMonitor(AlertsConfig(**config), gpu=gpu)
    for i in range(0, len(rows), 10):  # fed in deliveries, as on the driver
        monitor.observe(rows[i:i + 10])
    return monitor.fired


def test_a_healthy_run_raises_nothing():
    assert fired(series(recompilations=lambda s: 2, skipped=lambda s: 0)) == []


def test_cost_per_1k_steps_rising_fires_once_per_episode():
    doubled = series(dollars_per_step=lambda step: 0.01 if step <= 200 else 0.02)
    (alert,) = fired(doubled, cost_window_steps=100, cost_rise_percent=25)
    assert alert.kind == "cost_rise"
    # At step s the last 100 steps cost 0.01·(300 − s) + 0.02·(s − 200)... > 1.25 × $1 first at step 226.
    assert alert.step == 226
    assert "$10 → $12.6" in alert.message and "steps 27–126 vs 127–226" in alert.message
    assert fired(doubled, cost_rise_percent=0) == []
    assert fired(series(dollars_per_step=lambda step: 0.01 * (1 + 0.001 * step))) == []  # +10% per 100 steps


def test_validation_loss_not_improving_for_n_steps():
    stuck = series(count=800, val=lambda step: 2.5 if step == 200 else 2.6)
    (alert,) = fired(stuck, val_patience_steps=300)
    assert alert.kind == "val_plateau" and alert.step == 500
    assert "not improved for 300 steps (best 2.5000 at step 200, now 2.6000)" in alert.message
    assert fired(stuck, val_patience_steps=0) == []


def test_mfu_below_the_floor_on_gpus():
    sagging = series(mfu=lambda step: 0.05 if step == 10 or step > 200 else 0.4)
    (alert,) = fired(sagging, mfu_floor=0.2)  # the first window (compile, warm-up) is not held to it
    assert alert.kind == "mfu_floor" and alert.step == 210 and "MFU 5.0% is below the floor of 20%" in alert.message
    assert fired(sagging, mfu_floor=0.2, gpu=False) == []  # CPU peaks are nominal
    assert fired(sagging, mfu_floor=0.0) == []
    # It re-arms once MFU recovers.
    dips = series(mfu=lambda step: 0.05 if step in (100, 300) else 0.4)
    assert [a.step for a in fired(dips, mfu_floor=0.2)] == [100, 300]


def test_steps_skipped_for_inf_or_nan():
    skipping = series(skipped=lambda step: 0 if step < 150 else 2)
    (alert,) = fired(skipping)
    assert alert.kind == "skipped_steps" and alert.step == 150 and "2 step(s) skipped" in alert.message
    nan = fired(series(loss=lambda step: math.nan if step == 7 else 3.0))
    assert [(a.kind, a.step) for a in nan] == [("skipped_steps", 7)]
    # Weights gone NaN: every later loss is NaN, one alert (not one a step); again if it recovers and falls back.
    diverged = fired(series(loss=lambda step: math.nan if 7 <= step < 300 or step >= 350 else 3.0))
    assert [(a.kind, a.step) for a in diverged] == [("skipped_steps", 7), ("skipped_steps", 350)]
    assert fired(skipping, skipped_steps=False) == []


def test_recompilations_after_the_first_window():
    recompiling = series(recompilations=lambda step: 1 if step < 300 else 3)  # 1 during the first window: expected
    (alert,) = fired(recompiling)
    assert alert.kind == "recompilations" and alert.step == 300
    assert "recompiled 2 time(s) by step 300 (3 in all)" in alert.message
    assert fired(recompiling, recompilations=False) == []


@pytest.mark.parametrize("key, value", [("cost_rise_percent", -1.0), ("mfu_floor", 1.5), ("cost_window_steps", 0),
                                        ("val_patience_steps", -5)])
def test_impossible_thresholds_are_refused(key, value):
    from core.errors import ConfigError
    with pytest.raises(ConfigError, match=rf"\[bill.alerts\] {key}"):
        AlertsConfig(**{key: value})


def test_training_loss_rising_above_its_best_window_fires_once():
    # Falls from 4.0 to 2.0 at step 200, then climbs 0.01 a step. The lowest 50-step mean is 2.125
    # (steps 176-225); a window ending at step e >= 250 averages 2 + 0.01 (e - 224.5), which first
    # exceeds 1.2 x 2.125 = 2.55 at e = 280 (2.555).
    diverging = series(loss=lambda step: 4.0 - step / 100 if step <= 200 else 2.0 + 0.01 * (step - 200))
    (alert,) = fired(diverging, loss_rise_percent=20, loss_window_steps=50)
    assert alert.kind == "loss_rise" and alert.step == 280
    assert "mean 2.5550 over the last 50 steps against 2.1250 for the 50 steps to 225" in alert.message
    assert fired(diverging, loss_rise_percent=0) == []


def test_noisy_but_falling_training_loss_raises_nothing():
    noisy = series(loss=lambda step: 3.0 - step / 400 + 0.5 * math.sin(step * 1.7))
    assert [a.kind for a in fired(noisy)] == []


def test_a_batch_that_grows_with_its_cost_is_not_a_cost_rise():
    """An adaptive batch doubled at step 200 doubles the dollars a step costs: the same dollars a sample,
    so no alert; the same doubling at a fixed batch fires (the test above), and so does a step that
    costs 3x at 2x the batch (+50 % a sample)."""
    grown = series(dollars_per_step=lambda step: 0.01 if step <= 200 else 0.02)
    for row in grown:
        row["global_batch"] = 32 if row["step"] <= 200 else 64
    assert fired(grown, cost_window_steps=100, cost_rise_percent=25) == []
    for row in grown:
        row["dollars"] = 0.01 * min(row["step"], 200) + 0.03 * max(0, row["step"] - 200)
    (alert,) = fired(grown, cost_window_steps=100, cost_rise_percent=25)
    assert alert.kind == "cost_rise" and "per sample: the batch went from" in alert.message


def test_steps_redone_after_a_restart_are_a_cost_rise_at_any_batch():
    """A restart at step 250 back to the checkpoint of step 200 redoes 50 steps: steps 201-300 of the
    committed path cost 150 steps' dollars, against 100 for steps 101-200, whether or not the rows name
    their batch."""
    for batch in (None, 32):
        rows = series(count=300)
        for row in rows:
            row.pop("val_loss", None)
            if batch:
                row["global_batch"] = batch
        redone = [dict(r) for r in rows[200:]]
        for row in redone:
            row["dollars"] += 0.5  # the 50 lost steps' dollars
        (alert,) = fired(rows[:250] + redone, cost_window_steps=100, cost_rise_percent=25)
        assert alert.kind == "cost_rise" and "per sample" not in alert.message
