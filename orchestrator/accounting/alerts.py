"""Alerts on the bill rows: a run that costs more per step, stops learning, unlearns, idles its
GPUs, skips steps or recompiles.

    monitor = AlertMonitor(config.bill.alerts, gpu=plan.uses_gpus)
    for alert in monitor.observe(bill_rows):      # the new ones only
        print(alert.message)
    monitor.fired                                 # every alert so far, for the report

The driver feeds the bill rows as they arrive and prints what fires; the report replays the whole
series through a fresh monitor, so it lists the same alerts. A condition that persists fires once
and fires again only after it has cleared, a run of non-finite losses included (skipped steps and
recompilations fire for every window that adds some: each is new damage).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from core.config import AlertsConfig


@dataclass(frozen=True, slots=True)
class Alert:
    kind: str
    """cost_rise, val_plateau, loss_rise, mfu_floor, skipped_steps or recompilations."""
    step: int
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


class AlertMonitor:
    def __init__(self, config: AlertsConfig, *, gpu: bool):
        self.config = config
        self.gpu = gpu
        self.fired: list[Alert] = []
        self._armed = {"cost_rise": True, "mfu_floor": True, "loss_rise": True, "skipped_steps": True}
        self._dollars_at: dict[int, tuple[float, int]] = {}
        """Step -> (dollars, work of the committed path up to it: samples, or steps where the rows name no batch)."""
        self._first_step: int | None = None
        self._best_val: tuple[float, int] | None = None
        self._plateau_reported_for: tuple[float, int] | None = None
        self._losses: deque[float] = deque(maxlen=config.loss_window_steps)
        self._best_loss_mean: tuple[float, int] | None = None
        self._windows = 0
        self._skipped: int | None = None
        self._recompilations: int | None = None

    def observe(self, bill_rows: list[dict]) -> list[Alert]:
        new: list[Alert] = []
        for row in bill_rows:
            for check in (self._cost_rise, self._val_plateau, self._loss_rise, self._mfu_floor, self._skipped_steps,
                          self._recompiled):
                alert = check(row)
                if alert is not None:
                    new.append(alert)
        self.fired.extend(new)
        return new

    def _edge(self, kind: str, firing: bool, row: dict, message: str) -> Alert | None:
        """An alert when `firing` turns true; re-armed once it turns false."""
        if firing and self._armed[kind]:
            self._armed[kind] = False
            return Alert(kind, row["step"], message)
        if not firing:
            self._armed[kind] = True
        return None

    def _cost_rise(self, row: dict) -> Alert | None:
        step, window = row["step"], self.config.cost_window_steps
        if self._first_step is None:
            self._first_step = step
        # A redone step keeps the dollars of its latest run, and the work of the committed path up to it:
        # samples where the rows name their batch (a step of an adaptive batch grown 2x is worth twice
        # the dollars, not a rise), else steps.
        before_it = self._dollars_at.get(step - 1)
        work = (before_it[1] if before_it else 0) + (row.get("global_batch") or 1)
        self._dollars_at[step] = (row["dollars"], work)
        if len(self._dollars_at) > 4 * window:  # a million-step run keeps two windows, not every step
            self._dollars_at = {s: d for s, d in self._dollars_at.items() if s >= step - 2 * window}
        if not self.config.cost_rise_percent or step - 2 * window < self._first_step:
            return None
        then, mid = self._dollars_at.get(step - 2 * window), self._dollars_at.get(step - window)
        if then is None or mid is None:
            return None
        before, now = mid[0] - then[0], row["dollars"] - mid[0]
        work_before, work_now = mid[1] - then[1], work - mid[1]
        rise = (now / work_now / (before / work_before) - 1) * 100 if before > 0 and work_now > 0 else 0.0
        batch = "" if work_before == work_now else \
            f", per sample: the batch went from {work_before / window:,.4g} to {work_now / window:,.4g} samples"
        return self._edge("cost_rise", rise > self.config.cost_rise_percent, row,
                          f"cost per 1k steps rose {rise:.0f}% over the last {window} steps: "
                          f"${before / window * 1000:,.4g} → ${now / window * 1000:,.4g} "
                          f"(steps {step - 2 * window + 1}–{step - window} vs {step - window + 1}–{step}{batch})")

    def _val_plateau(self, row: dict) -> Alert | None:
        val = row.get("val_loss")
        patience = self.config.val_patience_steps
        if val is None or not patience:
            return None
        if self._best_val is None or val < self._best_val[0]:
            self._best_val = (val, row["step"])
            return None
        best, best_step = self._best_val
        if row["step"] - best_step < patience or self._plateau_reported_for == self._best_val:
            return None
        self._plateau_reported_for = self._best_val
        return Alert("val_plateau", row["step"], f"validation loss has not improved for {row['step'] - best_step:,} "
                     f"steps (best {best:.4f} at step {best_step}, now {val:.4f})")

    def _loss_rise(self, row: dict) -> Alert | None:
        if not self.config.loss_rise_percent or not math.isfinite(row["loss"]):  # non-finite: skipped_steps says so
            return None
        self._losses.append(row["loss"])
        if len(self._losses) < self._losses.maxlen:
            return None
        mean = sum(self._losses) / len(self._losses)
        if self._best_loss_mean is None or mean < self._best_loss_mean[0]:
            self._best_loss_mean = (mean, row["step"])
        best, best_step = self._best_loss_mean
        rise = (mean / best - 1) * 100
        return self._edge("loss_rise", rise > self.config.loss_rise_percent, row,
                          f"training loss rose {rise:.0f}% above its best: mean {mean:.4f} over the last "
                          f"{len(self._losses)} steps against {best:.4f} for the {len(self._losses)} steps to "
                          f"{best_step}; the run may be diverging (learning rate, precision, a kernel)")

    def _mfu_floor(self, row: dict) -> Alert | None:
        if not row.get("window_end"):
            return None
        self._windows += 1
        floor, value = self.config.mfu_floor, row.get("mfu")
        # The first window holds compilation and warm-up; CPU peaks are nominal, not held to a floor.
        if not floor or not self.gpu or value is None or self._windows == 1:
            return None
        return self._edge("mfu_floor", value < floor, row,
                          f"MFU {value:.1%} is below the floor of {floor:.0%} (tokens/s {row['tokens_per_s']:,.0f})")

    def _skipped_steps(self, row: dict) -> Alert | None:
        if not self.config.skipped_steps:
            return None
        finite = math.isfinite(row["loss"])
        # Non-finite losses in a row (weights gone NaN) are one alert, and again only after a finite one.
        alert = self._edge("skipped_steps", not finite, row, f"step {row['step']} reported a loss of {row['loss']}")
        if not finite:
            return alert
        count = row.get("skipped_steps")
        if count is None:
            return None
        before, self._skipped = self._skipped or 0, count
        if count <= before:
            return None
        scale = f"; loss scale now {row['loss_scale']:g}" if "loss_scale" in row else ""
        return Alert("skipped_steps", row["step"], f"{count - before} step(s) skipped for inf/NaN gradients by "
                     f"step {row['step']} ({count} in all){scale}")

    def _recompiled(self, row: dict) -> Alert | None:
        count = row.get("recompilations")
        if not self.config.recompilations or count is None:
            return None
        before, self._recompilations = self._recompilations, count
        if before is None or count <= before:  # the first window's compilations are the expected ones
            return None
        return Alert("recompilations", row["step"], f"torch.compile recompiled {count - before} time(s) by step "
                     f"{row['step']} ({count} in all): shapes or guards change during training")
