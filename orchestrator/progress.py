"""Metrics from the workers to the driver, and what the driver shows while training runs.

Rank 0 pushes rows into `MetricsSink` (a tiny actor) without waiting; the driver drains it
twice a second, appends the rows to metrics.jsonl and moves the progress bar. On a terminal the
bar redraws in place; elsewhere (CI logs, `ray job logs`) it prints one line per report.
"""

from __future__ import annotations

import time

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


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
    def __init__(self, console: Console, total_steps: int, first_step: int):
        self.console = console
        self.total_steps = total_steps
        self.started = time.monotonic()
        self.live = console.is_terminal
        self._bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                             TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                             TimeElapsedColumn(), console=console, transient=False)
        self._task = self._bar.add_task("train", total=total_steps, completed=first_step, loss="-", tps="-")

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self._bar.stop()

    def update(self, rows: list[dict]) -> None:
        for row in rows:
            if row.get("event"):
                self._event(row)
            elif "loss" in row:
                self._step(row)

    def _step(self, row: dict) -> None:
        loss, tps = f"{row['loss']:.4f}", f"{row['tokens_per_s']:,.0f}"
        self._bar.update(self._task, completed=row["step"], loss=loss, tps=tps)
        if "val_loss" in row:
            self.console.print(f"step {row['step']}: validation loss {row['val_loss']:.4f}")
        elif not self.live and "consumed_samples" in row:  # the last row of a report
            elapsed = time.monotonic() - self.started
            self.console.print(f"step {row['step']}/{self.total_steps}  loss {loss}  {tps} tok/s  "
                               f"elapsed {elapsed:.0f}s")

    def _event(self, row: dict) -> None:
        if row["event"] == "start":
            where = f"from step {row['step']}" if row["step"] else "from scratch"
            self.console.print(f"training {where} on {row['world_size']} workers ({row['device']}), "
                               f"{row['params'] / 1e6:.2f}M parameters")
        elif row["event"] == "checkpoint":
            self.console.print(f"step {row['step']}: checkpoint committed")
