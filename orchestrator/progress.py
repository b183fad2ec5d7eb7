"""Metrics from the workers to the driver, and what the driver shows while training runs.

Rank 0 pushes rows into `MetricsSink` (a tiny actor) without waiting; the driver drains it
twice a second, appends the rows to metrics.jsonl and moves the progress bar. On a terminal the
bar redraws in place; elsewhere (CI logs, `ray job logs`) it prints one line per report. With the
job's plan, the display also keeps the live bill (orchestrator/accounting/live_bill.py): MFU and dollars on
the progress line, alerts as they fire, and bill.jsonl, TensorBoard and Prometheus behind it.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from core.config import JobConfig
from core.plan import Plan
from orchestrator.accounting.live_bill import LiveBill


@ray.remote(num_cpus=0)
class MetricsSink:
    def __init__(self):
        self._rows: list[dict] = []

    def record(self, rows: list[dict]) -> None:
        self._rows.extend(rows)

    def drain(self) -> list[dict]:
        rows, self._rows = self._rows, []
        return rows


class ProgressDisplay:
    def __init__(self, console: Console, total_steps: int, first_step: int, bill: LiveBill | None = None,
                 started: float | None = None):
        """started: the time.monotonic() the elapsed time counts from (now when None)."""
        self.console = console
        self.total_steps = total_steps
        self.started = time.monotonic() if started is None else started
        self.live = console.is_terminal
        self.bill = bill
        self._bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                             TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                             TextColumn("MFU {task.fields[mfu]}"), TextColumn("{task.fields[dollars]}"),
                             TimeElapsedColumn(), console=console, transient=False)
        self._task = self._bar.add_task("train", total=total_steps, completed=first_step, loss="-", tps="-",
                                        mfu="-", dollars="$-")

    @classmethod
    def for_run(cls, console: Console, plan: Plan, config: JobConfig, run_dir: Path, first_step: int, *,
                started: float) -> ProgressDisplay:
        """The display with the live bill of the job `config`, priced as `plan` says; the bill and the elapsed
        time count from `started` (time.monotonic() when fit began), as the report's bill does."""
        bill = LiveBill.open(plan, config, run_dir, resumed=first_step > 0, started=started)
        return cls(console, config.train.steps, first_step, bill, started)

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self._bar.stop()
        if self.bill is not None:
            self.bill.close()

    def update(self, rows: list[dict]) -> None:
        bills = {}
        if self.bill is not None:
            bill_rows, alerts = self.bill.update(rows)
            bills = {id(row): bill for row, bill in zip((r for r in rows if "loss" in r), bill_rows)}
            for alert in alerts:
                self.console.print(f"[bold yellow]alert:[/] step {alert.step}: {escape(alert.message)}",
                                   highlight=False, soft_wrap=True)
        for row in rows:
            if row.get("event"):
                self._event(row)
            elif "loss" in row:
                self._step(row, bills.get(id(row)))

    def _step(self, row: dict, bill: dict | None) -> None:
        loss, tps = f"{row['loss']:.4f}", f"{row['tokens_per_s']:,.0f}"
        mfu = "-" if bill is None or bill["mfu"] is None else f"{bill['mfu']:.1%}"
        dollars = "$-" if bill is None else _money(bill["dollars"])
        self._bar.update(self._task, completed=row["step"], loss=loss, tps=tps, mfu=mfu, dollars=dollars)
        if not self.live and "consumed_samples" in row:  # the last row of a report, validation steps included
            elapsed = time.monotonic() - self.started
            self.console.print(f"step {row['step']}/{self.total_steps}  loss {loss}  {tps} tok/s  MFU {mfu}  "
                               f"{dollars}  elapsed {elapsed:.0f}s", markup=False, highlight=False)
        if "val_loss" in row:
            self.console.print(f"step {row['step']}: validation loss {row['val_loss']:.4f}")

    def _event(self, row: dict) -> None:
        if row["event"] == "start":
            where = (f"from step {row['step']}" if row["step"] else
                     "from the pretrained weights" if row.get("pretrained_reader") else "from scratch")
            device = row.get("device_model") or row["device"]  # every GPU worker's device is "cuda:0"
            self.console.print(f"training {where} on {row['world_size']} workers ({device}), "
                               f"{row['params'] / 1e6:.2f}M parameters")
        elif row["event"] == "checkpoint":
            self.console.print(f"step {row['step']}: checkpoint committed")
        else:  # restart, resize, preempted, …: whatever the elastic driver reports, shown as it is
            fields = "  ".join(f"{key} {_short(value)}" for key, value in row.items() if key != "event")
            self.console.print(f"event: {row['event']}  {fields}", markup=False, highlight=False)


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _money(dollars: float) -> str:
    """Cents where they matter: $0.0166, $12.34, $1,234."""
    return f"${dollars:,.0f}" if dollars >= 100 else f"${dollars:.2f}" if dollars >= 1 else f"${dollars:.4f}"
