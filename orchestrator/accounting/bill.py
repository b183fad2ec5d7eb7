"""The bill while training runs: per step, wall time, tokens, MFU, exposed communication, dollars.

    meter = BillMeter(Rates.from_plan(plan))
    bill_rows = meter.observe(rows, now=time.monotonic() - started)   # one bill row per step row
    bill_rows[-1]["dollars"], bill_rows[-1]["mfu"], bill_rows[-1]["tokens_per_dollar"]

Workers report a step's loss and their throughput over each log window (`tokens_per_s`); the
driver knows when the rows arrived. From those and the plan (prices and peaks of the devices it
uses) the meter derives each step's cost. Dollars accrue with the wall clock, not with the steps:
start-up of the workers, validation, checkpoints and steps redone after a restart are all billed,
because the devices are held through them. A step's tokens are its own global batch's (an adaptive
batch, [train] batch_size = "adaptive", changes it between steps; each bill row names the batch and the
gradient noise scale it was chosen by). A "start" event row (sent again by every restarted or
resized worker group) sets the world size the rate is scaled by.

`trajectory` folds bill rows after a rewind (a resume or a restart from a checkpoint) into the
committed path: the redone steps replace the lost ones, while the dollars keep counting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.plan import Plan
from planning.compute import ComputeModel
from topology import catalog

PEAK_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "fp32": "fp32"}
"""The peak MFU divides by, per training precision: the dtype the matmuls run in."""


@dataclass(frozen=True, slots=True)
class Rates:
    """What the plan's devices cost and can do: the figures every bill row is computed from."""

    dollars_per_hour: float
    """Price of every device of the plan per hour (its pricing column, MIG slices at their share)."""
    peak_tflops: dict[str, float]
    """Dense peak of all the plan's devices together, per dtype; empty for devices the catalog lacks."""
    nominal_peak: bool
    """True for CPU workers: their peak is ComputeModel's nominal GFLOP/s per core, not a data sheet."""
    world_size: int
    gpu_equivalents: float
    """Whole devices the plan holds: a MIG slice counts its share of the GPU, a CPU worker one."""
    tokens_per_step: int
    seq_len: int
    predicted_step_seconds: float

    @classmethod
    def from_plan(cls, plan: Plan) -> Rates:
        peaks: dict[str, float] = {}
        nominal = not plan.uses_gpus
        if nominal:
            per_core = ComputeModel().cpu_gflops_per_core / 1000
            total = sum(w.cpus for w in plan.workers) * per_core
            peaks = {dtype: total for dtype in PEAK_DTYPE.values()}
        elif all(catalog.device_peak_tflops(w.device_model, "bf16") for w in plan.workers):
            peaks = {dtype: sum(catalog.device_peak_tflops(w.device_model, dtype) or 0.0 for w in plan.workers)
                     for dtype in PEAK_DTYPE.values()}
        predicted = plan.predicted
        return cls(dollars_per_hour=predicted.dollars_per_hour, peak_tflops=peaks, nominal_peak=nominal,
                   world_size=plan.world_size, tokens_per_step=plan.tokens_per_step, seq_len=plan.seq_len,
                   gpu_equivalents=sum(catalog.device_share(w.device_model) for w in plan.workers),
                   predicted_step_seconds=predicted.step_seconds)

    def bf16_tflops(self) -> float:
        """The normalised capacity the run holds: dense bf16 TFLOP/s of all its devices."""
        return self.peak_tflops.get("bf16", 0.0)


def mfu(flops_per_token: float, tokens_per_second: float, peak_tflops: float) -> float | None:
    """Model FLOPs utilisation: the model's training FLOPs per token × tokens/s ÷ the devices' peak."""
    if not flops_per_token or not peak_tflops:
        return None
    return flops_per_token * tokens_per_second / (peak_tflops * 1e12)


class BillMeter:
    """Turns metrics rows into bill rows, one per step row, carrying the totals from row to row."""

    def __init__(self, rates: Rates, *, carried: dict | None = None):
        """carried: the last bill row of an earlier invocation of the same run (a resume): its dollars,
        device-hours, normalised compute and clock go on counting."""
        self.rates = rates
        carried = carried or {}
        self.dollars = carried.get("dollars", 0.0)
        self.device_hours = carried.get("device_hours", 0.0)
        self.bf16_tflops_hours = carried.get("bf16_tflops_hours", 0.0)
        self._clock_offset = carried.get("elapsed_s", 0.0)
        self.elapsed_s = self._clock_offset
        self.world_size = rates.world_size
        self.flops_per_token = 0.0
        self.precision = "bf16"
        self.tokens = carried.get("tokens", 0)

    @property
    def scale(self) -> float:
        """The share of the plan's devices running now (an elastic run on fewer workers pays for fewer)."""
        return self.world_size / self.rates.world_size if self.rates.world_size else 1.0

    def peak_tflops(self) -> float:
        return self.rates.peak_tflops.get(PEAK_DTYPE.get(self.precision, "fp32"), 0.0) * self.scale

    def observe(self, rows: list[dict], now: float | None = None) -> list[dict]:
        """Bill rows for the step rows among `rows`, which arrived together at `now` seconds after the
        meter started (None: no clock, e.g. rebuilding from metrics.jsonl; each step then takes its
        measured step time). Event rows update the meter and yield no bill row."""
        step_seconds = {i: self.step_tokens(r) / r["tokens_per_s"] if r.get("tokens_per_s") else 0.0
                        for i, r in enumerate(rows) if "loss" in r}
        later = sum(step_seconds.values())  # step time of the rows after the current one
        bill = []
        for i, row in enumerate(rows):  # in order: a restart's start row changes the rate of the steps after it
            if row.get("event") == "replan" and "rates" in row:
                # Another set of devices from here on: their price and peak, not the first plan's scaled.
                self.rates = Rates(**row["rates"])
                self.world_size = self.rates.world_size
            elif row.get("event") == "start":
                self.world_size = row.get("world_size", self.world_size) or self.world_size
                self.flops_per_token = row.get("flops_per_token", self.flops_per_token)
                self.precision = row.get("precision", self.precision)
                if "consumed_samples" in row:  # a group started from a checkpoint: the tokens go on from there
                    self.tokens = row["consumed_samples"] * self.rates.seq_len
            elif i in step_seconds:
                step_s = step_seconds[i]
                later -= step_s
                if now is None:
                    arrived = self.elapsed_s + step_s
                else:  # rows of one delivery are backdated by the steps that came after them
                    arrived = max(self.elapsed_s, self._clock_offset + now - later)
                bill.append(self._bill_row(row, step_s, arrived))
        return bill

    def step_tokens(self, row: dict) -> int:
        """Tokens the row's step trained: its global batch's where the worker names it (an adaptive
        batch changes it during the run), else the plan's."""
        batch = row.get("global_batch")
        return batch * self.rates.seq_len if batch else self.rates.tokens_per_step

    def _bill_row(self, row: dict, step_s: float, elapsed_s: float) -> dict:
        seconds = elapsed_s - self.elapsed_s
        self.elapsed_s = elapsed_s
        self.dollars += self.rates.dollars_per_hour * self.scale * seconds / 3600
        self.device_hours += self.rates.gpu_equivalents * self.scale * seconds / 3600
        self.bf16_tflops_hours += self.rates.bf16_tflops() * self.scale * seconds / 3600
        if "consumed_samples" in row:  # exact, and right again after a rewind
            self.tokens = row["consumed_samples"] * self.rates.seq_len
        else:
            self.tokens += self.step_tokens(row)
        tokens_per_s = row.get("tokens_per_s", 0.0)
        out = {"step": row["step"], "elapsed_s": elapsed_s, "step_s": step_s, "loss": row["loss"],
               "tokens": self.tokens, "tokens_per_s": tokens_per_s, "world_size": self.world_size,
               "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_tflops()),
               "dollars": self.dollars, "dollars_per_step": self.rates.dollars_per_hour * self.scale * step_s / 3600,
               "tokens_per_dollar": self.tokens / self.dollars if self.dollars > 0 else None,
               "device_hours": self.device_hours, "bf16_tflops_hours": self.bf16_tflops_hours,
               "predicted_step_s": self.rates.predicted_step_seconds}
        for key in ("val_loss", "global_batch", "noise_scale"):  # the batch each step trained at, and why
            if key in row:
                out[key] = row[key]
        if "consumed_samples" in row:  # the row closing a log window carries the window's extras
            out["window_end"] = True
            for key, share in (("exposed_comm_s", "exposed_comm_share"), ("data_wait_s", "data_wait_share")):
                if key in row and step_s > 0:
                    out[key] = row[key]
                    out[share] = min(1.0, row[key] / step_s)
            for key in ("skipped_steps", "loss_scale"):
                if key in row:
                    out[key] = row[key]
            if isinstance(row.get("compile"), dict):
                out["recompilations"] = row["compile"].get("recompilations", 0)
        elif "data_wait_s" in row and step_s > 0:
            out["data_wait_s"] = row["data_wait_s"]
            out["data_wait_share"] = min(1.0, row["data_wait_s"] / step_s)
        return out


def trajectory(bill_rows: list[dict]) -> list[dict]:
    """The committed path: when a step comes again (a restart or a resume from a checkpoint), the rows
    from that step on are replaced by the redone ones; their dollars, which were spent, stay counted
    in the later rows."""
    path: list[dict] = []
    for row in bill_rows:
        while path and path[-1]["step"] >= row["step"]:
            path.pop()
        path.append(row)
    return path


# ---- convergence ---------------------------------------------------------------------------------
_COUNTED = ("step", "dollars", "device_hours", "tokens")
"""What a target's cost is given in."""
MIN_EVALUATIONS_TO_PROJECT = 3
"""Evaluations a projection of the cost of a target needs; the fit takes the later half once there are twice as many."""
PROJECTION_HORIZON = 100.0
"""A projection further than this many times the dollars spent so far is not made: a power law fitted to a
few evaluations (start-up and restarts jump the dollars between them) says nothing that far out."""

@dataclass(frozen=True, slots=True)
class TargetCost:
    target: float
    """A validation loss from [bill] targets."""
    reached: bool
    step: float | None
    dollars: float | None
    device_hours: float | None
    tokens: float | None
    projected: bool = False
    """True when not reached yet and the numbers come from the power-law fit of the loss curve."""


def cost_to_reach(bill_rows: list[dict], targets: list[float]) -> list[TargetCost]:
    """Dollars, device-hours, tokens and step at which the validation loss first reached each target,
    interpolated linearly in loss between the two evaluations that bracket it; for the first target
    not reached, a projection from the loss curve so far (`project`)."""
    evals = [r for r in trajectory(bill_rows) if r.get("val_loss") is not None]
    costs, projected_one = [], False
    for target in sorted(targets, reverse=True):
        cost = _interpolate(evals, target)
        if cost is None and not projected_one:
            projected_one = True
            cost = project(evals, target)
        costs.append(cost or TargetCost(target=target, reached=False, step=None, dollars=None, device_hours=None,
                                        tokens=None))
    return costs


def _interpolate(evals: list[dict], target: float) -> TargetCost | None:
    for i, row in enumerate(evals):
        if row["val_loss"] <= target:
            if i == 0:  # reached by the first evaluation: nothing earlier to interpolate from
                values = {k: row[k] for k in _COUNTED}
            else:
                before = evals[i - 1]
                f = (before["val_loss"] - target) / (before["val_loss"] - row["val_loss"])
                values = {k: before[k] + f * (row[k] - before[k]) for k in _COUNTED}
            return TargetCost(target=target, reached=True, **values)
    return None


def project(evals: list[dict], target: float) -> TargetCost | None:
    """The cost of reaching `target` if the validation loss keeps following a power law in dollars,
    loss = a · dollars^b, fitted (least squares in log–log) to the later half of the evaluations, from
    MIN_EVALUATIONS_TO_PROJECT on (two points always make a line, and two noisy evaluations make any
    line), its slope drawn through the last evaluation, so that a target that evaluation missed is
    never projected to be reached before it. Optimistic near the loss floor, which a power law without
    one cannot see; None while the fitted loss is not falling, or beyond PROJECTION_HORIZON."""
    points = [(math.log(r["dollars"]), math.log(r["val_loss"]), r) for r in evals
              if r["dollars"] > 0 and r["val_loss"] > 0]
    if len(points) < MIN_EVALUATIONS_TO_PROJECT:
        return None
    points = points[len(points) // 2:] if len(points) >= 2 * MIN_EVALUATIONS_TO_PROJECT else points
    mean_x = sum(p[0] for p in points) / len(points)
    mean_y = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mean_x) ** 2 for p in points)
    if sxx == 0:
        return None
    slope = sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / sxx
    if slope >= 0:
        return None
    first, last = points[0][2], points[-1][2]
    dollars = last["dollars"] * math.exp((math.log(target) - math.log(last["val_loss"])) / slope)
    if dollars > PROJECTION_HORIZON * last["dollars"]:
        return None
    # Steps, tokens and device-hours go on growing with the dollars at the rate between the fitted evaluations.
    spent = last["dollars"] - first["dollars"]
    per_dollar = {k: (last[k] - first[k]) / spent for k in ("step", "device_hours", "tokens")}
    values = {k: last[k] + (dollars - last["dollars"]) * rate for k, rate in per_dollar.items()}
    return TargetCost(target=target, reached=False, dollars=dollars, projected=True, **values)
