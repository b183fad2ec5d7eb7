"""RunReport: what a run did and what it cost, built on the driver from the metrics rows, saved as report.json.

    report = RunReport.from_rows(rows, plan=plan, name=..., run_dir=..., wall_seconds=..., config=...)
    report = RunReport.load("runs/cpu-tiny")          # report.json as fit saved it
    report.print_summary(console)

The per-step bill (dollars, MFU, tokens per dollar, exposed communication) comes from
<run>/bill.jsonl, which the driver wrote while the run trained (orchestrator/accounting/live_bill.py); a run
directory without one is billed again from metrics.jsonl, each step taking its measured time.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from rich.console import Console
from rich.table import Table

from core.atomic import read_text, write_text_atomically
from core.config import AlertsConfig, BillConfig
from core.errors import ArchipelagoError
from core.plan import Plan
from orchestrator.accounting.alerts import AlertMonitor
from orchestrator.accounting.bill import (MIN_EVALUATIONS_TO_PROJECT, PROJECTION_HORIZON, BillMeter, Rates, cost_to_reach,
                                          mfu)
from orchestrator.accounting.exporters import read_jsonl
from orchestrator.accounting.live_bill import BILL_FILE

STATUSES = {
    "completed": "trained to [train] steps",
    "interrupted": "stopped by Ctrl-C or a signal; `archipelago fit CONFIG --resume` continues from its last "
                   "committed checkpoint",
    "failed": "stopped by the error fit printed; fix it and `archipelago fit CONFIG --resume`",
    "running": "written at its last committed checkpoint while fit trained: if fit is not running any more, it was "
               "killed after that checkpoint (`archipelago fit CONFIG --resume` continues from it)",
}
"""What a report's status says about the run."""


@dataclass(kw_only=True, slots=True)
class RunReport:
    name: str
    status: str
    """One of STATUSES: "completed" when the last step ran."""
    run_dir: str
    started_at: str
    """UTC, ISO 8601."""
    wall_seconds: float
    """This invocation of fit, from its start (dataset preparation and checks included) to the end of training."""
    world_size: int
    """The last worker group's (an elastic run's groups may differ)."""
    device: str
    num_params: int
    start_step: int
    """Step this invocation started from (0, or the resumed checkpoint's step)."""
    final_step: int
    tokens_seen: int
    """Tokens trained on since step 0, resumed runs included."""
    tokens_this_run: int
    tokens_per_second: float
    """Median over the last worker group's metric reports (startup and checkpoints excluded)."""
    predicted_tokens_per_second: float
    """What the planner predicted for this plan (plan.json), to hold the cost model to account."""
    step_seconds: float
    """Median measured time of one optimizer step (tokens per step ÷ the window's tokens/s)."""
    predicted_step_seconds: float
    prediction_error: float | None
    """step_seconds ÷ predicted_step_seconds − 1: +0.25 means steps took 25% longer than the cost model said."""
    mfu: float | None
    """Model FLOPs utilisation: tokens/s × training FLOPs per token ÷ the dense peak of the devices used,
    in the run's precision (bf16, fp16, fp8, fp32); MIG slices count their share of the GPU. None for
    devices the catalog lacks."""
    peak_tflops: float
    """The peak MFU divides by, all devices together."""
    peak_basis: str
    """Where that peak comes from, in words (a data sheet, or the nominal CPU figure)."""
    exposed_comm_share: float | None
    """Median share of a step spent waiting for gradient communication (DDP's timers, sampled once per log window)."""
    data_wait_share: float | None
    """Median share of a step spent waiting for input; None when the workers do not report it."""
    dollars_per_hour: float
    """Price of the plan's devices per hour (the [placement] pricing column)."""
    dollars: float
    """This invocation's bill over its wall_seconds (start-up included: it is billed too), at the rate of the
    worker group running at each moment (bill.jsonl), the time after its last step at the last group's."""
    dollars_per_million_tokens: float | None
    """dollars ÷ tokens_this_run, in millions."""
    tokens_per_dollar: float | None
    """tokens_this_run ÷ dollars."""
    run_dollars: float
    """Dollars of every invocation of the run (steps redone included), to the end of this one (earlier ones
    to their last step): what the run has cost. bill.jsonl's, to the last step, is the scale of the curves
    and of `convergence`."""
    device_hours: float
    """Device-hours over the same span: GPU-hours on GPUs (a MIG slice counts its share of the card),
    worker-hours on CPUs."""
    bf16_tflops_hours: float
    """The same span in the normalised unit: dense bf16 TFLOP/s of peak held for an hour."""
    dollars_per_bf16_tflops_hour: float | None
    convergence: list[dict]
    """Per [bill] target: the dollars, device-hours, tokens and step at which the validation loss first
    reached it (interpolated), or for the first one not reached a projection (`projected`: true)."""
    alerts: list[dict]
    """Every alert the run raised: kind, step, message."""
    events: list[dict]
    """Every metrics row with an "event" other than "checkpoint" (start, restart, resize, …), as sent."""
    final_train_loss: float | None
    final_val_loss: float | None
    checkpoint_path: str | None
    checkpoint_step: int | None
    metrics_path: str
    config: dict[str, Any]
    versions: dict[str, str]
    tokenizer: str = ""
    """The dataset's tokenizer identity: losses per token of runs with different tokenizers do not compare
    ("" in reports written before it was recorded)."""

    @classmethod
    def from_rows(cls, rows: list[dict], *, plan: Plan, **fields: Any) -> RunReport:
        steps = [r for r in rows if "loss" in r]
        vals = [r["val_loss"] for r in steps if "val_loss" in r]
        starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
        # Throughput, step time and MFU are the last worker group's (`plan` is the plan it ran): the groups
        # of an elastic run differ in size and speed.
        start = rows[starts[-1]] if starts else {}
        group_steps = [r for r in rows[starts[-1]:] if "loss" in r] if starts else steps
        last_consumed = next((r["consumed_samples"] for r in reversed(steps) if "consumed_samples" in r), 0)
        start_step = rows[starts[0]].get("step", 0) if starts else 0
        committed = {r["step"]: r for r in steps}.values()  # a step redone after a rewind counts once
        tokens_this_run = sum(r.get("global_batch") or plan.global_batch_size for r in committed) * plan.seq_len
        tokens_per_second = statistics.median(r["tokens_per_s"] for r in group_steps) if group_steps else 0.0
        rates = Rates.from_plan(plan)
        bill_rows = _bill_rows(Path(fields["run_dir"]), rows, rates)
        this_run = bill_rows[-len(steps):] if steps else []
        bill = _BillSummary.of(rates, start)
        spent = _Spent.of(bill_rows, len(this_run), fields["wall_seconds"], rates, bill.scale)
        step_seconds = _median_step_seconds(group_steps, plan, tokens_per_second)
        predicted = plan.predicted.step_seconds
        bill_config = _bill_config(fields["config"])
        return cls(
            world_size=start.get("world_size", 0),
            device=start.get("device_model") or start.get("device", ""),  # "cuda:0" names no GPU
            num_params=start.get("params", 0),
            start_step=start_step,
            final_step=steps[-1]["step"] if steps else start_step,
            tokens_seen=last_consumed * plan.seq_len,
            tokens_this_run=tokens_this_run,
            tokens_per_second=tokens_per_second,
            predicted_tokens_per_second=plan.predicted.tokens_per_second,
            step_seconds=step_seconds,
            predicted_step_seconds=predicted,
            prediction_error=step_seconds / predicted - 1 if predicted and step_seconds else None,
            mfu=mfu(start.get("flops_per_token", 0), tokens_per_second, bill.peak_tflops),
            peak_tflops=bill.peak_tflops,
            peak_basis=bill.peak_basis,
            exposed_comm_share=_median(this_run, "exposed_comm_share"),
            data_wait_share=_median(this_run, "data_wait_share"),
            dollars_per_hour=plan.predicted.dollars_per_hour,
            dollars=spent.dollars,
            dollars_per_million_tokens=spent.dollars / tokens_this_run * 1e6 if tokens_this_run else None,
            tokens_per_dollar=tokens_this_run / spent.dollars if spent.dollars else None,
            run_dollars=spent.run_dollars,
            device_hours=spent.device_hours,
            bf16_tflops_hours=spent.bf16_tflops_hours,
            dollars_per_bf16_tflops_hour=(plan.predicted.dollars_per_hour / rates.bf16_tflops()
                                          if rates.bf16_tflops() else None),
            convergence=[asdict(c) for c in cost_to_reach(bill_rows, bill_config.targets)],
            alerts=[a.to_dict() for a in _replay_alerts(bill_rows, bill_config.alerts, plan)],
            events=[r for r in rows if r.get("event") not in (None, "checkpoint")],
            final_train_loss=steps[-1]["loss"] if steps else None,
            final_val_loss=vals[-1] if vals else None,
            versions={"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__},
            **fields,
        )

    def save(self, path: Path) -> None:
        write_text_atomically(path, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: str | Path) -> RunReport:
        path = Path(run_dir) / "report.json"
        fix = "point at a run directory (runs/<name>) of a run that finished; `archipelago fit` writes report.json"
        try:
            data = json.loads(read_text(path, error=ArchipelagoError, fix=fix))
        except json.JSONDecodeError as e:
            raise ArchipelagoError(f"not JSON ({e})", where=str(path), fix="train the run again") from None
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ArchipelagoError(f"lacks {', '.join(missing[:3])}: written by an older archipelago",
                                   where=str(path), fix="train the run again (`archipelago fit CONFIG --overwrite`)")
        return cls(**{k: v for k, v in data.items() if k in names})

    def print_summary(self, console: Console) -> None:
        table = Table(title=f"archipelago run {self.name!r}: {self.status}", show_header=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")  # paths are printed whole: users copy them
        for label, value in self.summary_rows():
            table.add_row(label, value)
        console.print(table)

    def losses_compare_with(self, other: RunReport) -> str | None:
        """None when this run's losses can be set beside `other`'s; otherwise why not, in a sentence."""
        mine, theirs = self.tokenizer_identity, other.tokenizer_identity
        if mine == theirs:
            return None
        return (f"their losses are not comparable: {self.name!r} was trained on {mine!r} tokens and {other.name!r} on "
                f"{theirs!r}, and a loss per token depends on what a token is")

    @property
    def run_tokens_per_dollar(self) -> float | None:
        """Every token the run trained on (tokens_seen) per dollar of every invocation (run_dollars)."""
        return self.tokens_seen / self.run_dollars if self.run_dollars else None

    @property
    def run_dollars_per_million_tokens(self) -> float | None:
        return self.run_dollars / self.tokens_seen * 1e6 if self.tokens_seen else None

    @property
    def tokenizer_identity(self) -> str:
        """The dataset's tokenizer, or for an older report the one its config named."""
        return self.tokenizer or (self.config.get("data") or {}).get("tokenizer", "bytes")

    def summary_rows(self) -> list[tuple[str, str]]:
        """(label, value) lines of the summary, shared by the terminal table and report.html."""
        loss = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        rows = [("steps", f"{self.start_step} → {self.final_step}"),
                ("final train loss", loss(self.final_train_loss)),
                ("final validation loss", loss(self.final_val_loss)),
                ("tokens seen", f"{self.tokens_seen:,} ({self.tokens_this_run:,} this run)"),
                ("throughput", f"{self.tokens_per_second:,.0f} tokens/s on {self.world_size} × {self.device} "
                               f"(planner predicted {self.predicted_tokens_per_second:,.0f})"),
                ("step time", f"{self.step_seconds * 1000:,.1f} ms measured, "
                              f"{self.predicted_step_seconds * 1000:,.1f} ms predicted "
                              f"({_signed(self.prediction_error)} error)")]
        if self.mfu is not None:
            rows.append(("MFU", f"{self.mfu:.1%} of {self.peak_tflops:,.4g} TFLOP/s ({self.peak_basis})"))
        waits = [f"{name} {share:.0%}" for name, share in (("exposed communication", self.exposed_comm_share),
                                                           ("data wait", self.data_wait_share)) if share is not None]
        if waits:
            rows.append(("waiting", ", ".join(waits) + " of a step"))
        per_million = "-" if self.dollars_per_million_tokens is None else f"${self.dollars_per_million_tokens:.4f}"
        per_dollar = "" if self.tokens_per_dollar is None else f", {self.tokens_per_dollar:,.0f} tokens per dollar"
        rows.append(("bill", f"${self.dollars:.4f} at ${self.dollars_per_hour:.2f}/hour; {per_million} per million "
                             f"tokens{per_dollar}" + (" (this invocation)" if self.start_step else "")))
        if self.start_step:  # a resumed run: what all of it cost
            whole = "" if self.run_tokens_per_dollar is None else f", {self.run_tokens_per_dollar:,.0f} tokens per dollar"
            rows.append(("bill, whole run", f"${self.run_dollars:.4f} over every invocation since step 0{whole}"))
        if self.bf16_tflops_hours:
            unit = ("" if self.dollars_per_bf16_tflops_hour is None
                    else f" at ${self.dollars_per_bf16_tflops_hour:.4g} each")
            kind = "nominal CPU" if "nominal" in self.peak_basis else "bf16"
            rows.append(("compute bought", f"{self.device_hours:,.4g} device-hours = {self.bf16_tflops_hours:,.4g} "
                                           f"{kind} TFLOP/s·h{unit}"))
        projecting = any(c["projected"] for c in self.convergence)
        rows.extend((f"target {c['target']:g}", _target_line(c, projecting)) for c in self.convergence)
        if self.events:
            counts = Counter(e["event"] for e in self.events)
            rows.append(("events", ", ".join(f"{n} × {name}" for name, n in counts.items())))
        if self.alerts:
            rows.append(("alerts", "; ".join(f"step {a['step']}: {a['message']}" for a in self.alerts[:3])
                         + (f"; … {len(self.alerts) - 3} more" if len(self.alerts) > 3 else "")))
        rows += [("wall time", f"{self.wall_seconds:.1f} s"),
                 ("checkpoint", self.checkpoint_path or "-"),
                 ("report", str(Path(self.run_dir) / "report.json"))]
        return rows


@dataclass(frozen=True, slots=True)
class _Spent:
    """What was paid: the meter's figures (bill.jsonl, which counts to each invocation's last step at the rate
    of the group then running), and the rest of this invocation after its last step (the last checkpoint,
    the workers' exit) at the last group's rate."""

    dollars: float
    """This invocation's."""
    run_dollars: float
    device_hours: float
    bf16_tflops_hours: float

    @classmethod
    def of(cls, bill_rows: list[dict], rows_this_run: int, wall_seconds: float, rates: Rates, scale: float) -> _Spent:
        """rows_this_run: how many of bill_rows (the last ones) this invocation billed; rates × scale: the last
        group's."""
        last = bill_rows[-1] if bill_rows else {}
        # The meter's totals when this invocation began: the row before its own (none for a first invocation),
        # or, when it billed no step, where they still stand.
        before = bill_rows[-rows_this_run - 1] if len(bill_rows) > rows_this_run else {}
        before = before if rows_this_run else last
        metered_s = last.get("elapsed_s", 0.0) - before.get("elapsed_s", 0.0)
        metered_dollars = last.get("dollars", 0.0) - before.get("dollars", 0.0)
        tail_h = max(0.0, wall_seconds - metered_s) / 3600 * scale  # hours of the whole plan's devices
        return cls(dollars=metered_dollars + rates.dollars_per_hour * tail_h,
                   run_dollars=last.get("dollars", 0.0) + rates.dollars_per_hour * tail_h,
                   device_hours=last.get("device_hours", 0.0) + rates.gpu_equivalents * tail_h,
                   bf16_tflops_hours=last.get("bf16_tflops_hours", 0.0) + rates.bf16_tflops() * tail_h)


@dataclass(frozen=True, slots=True)
class _BillSummary:
    """The peak MFU divides by and the device share of the last worker group, from its start row."""

    peak_tflops: float
    peak_basis: str
    scale: float
    """The share of the plan's devices the last worker group holds (BillMeter.scale)."""

    @classmethod
    def of(cls, rates: Rates, start: dict) -> _BillSummary:
        meter = BillMeter(rates)
        meter.observe([start] if start else [])
        basis = ("nominal CPU peak, 0.1 TFLOP/s per core" if rates.nominal_peak
                 else f"dense {meter.precision} peak from the device catalog")
        return cls(peak_tflops=meter.peak_tflops(), peak_basis=basis, scale=meter.scale)


def _bill_rows(run_dir: Path, rows: list[dict], rates: Rates) -> list[dict]:
    """bill.jsonl as the driver wrote it; without one, the rows billed again with measured step times."""
    path = run_dir / BILL_FILE
    if path.is_file():
        return read_jsonl(path)
    return BillMeter(rates).observe(rows)


def _bill_config(config: dict) -> BillConfig:
    bill = config.get("bill") or {}
    alerts = AlertsConfig(**bill.get("alerts", {}))
    return BillConfig(targets=list(bill.get("targets", [])), alerts=alerts)


def _replay_alerts(bill_rows: list[dict], config: AlertsConfig, plan: Plan) -> list:
    monitor = AlertMonitor(config, gpu=plan.uses_gpus)
    monitor.observe(bill_rows)
    return monitor.fired


def _median_step_seconds(steps: list[dict], plan: Plan, tokens_per_second: float) -> float:
    """The plan's tokens at the median throughput; once an adaptive batch changed the tokens a step
    trains, the median of each step's own time."""
    batches = {r.get("global_batch") or plan.global_batch_size for r in steps}
    if batches in ({plan.global_batch_size}, set()):
        return plan.tokens_per_step / tokens_per_second if tokens_per_second else 0.0
    times = [r["global_batch"] * plan.seq_len / r["tokens_per_s"] for r in steps
             if r.get("global_batch") and r.get("tokens_per_s")]
    return statistics.median(times) if times else 0.0


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _signed(share: float | None) -> str:
    return "-" if share is None else f"{share:+.0%}"


def _target_line(cost: dict, projecting: bool) -> str:
    if cost["dollars"] is None:
        return ("not reached (the next target's projection is above)" if projecting
                else f"not reached; no projection (fewer than {MIN_EVALUATIONS_TO_PROJECT} evaluations, the "
                     f"validation loss is not falling, or the fit puts it beyond {PROJECTION_HORIZON:g}× what was spent)")
    verb = "projected to be reached" if cost["projected"] else "reached"
    return (f"{verb} at step {cost['step']:,.0f}: ${cost['dollars']:.4g}, {cost['device_hours']:,.4g} device-hours, "
            f"{cost['tokens']:,.0f} tokens")
