"""RunReport: what a run did, built on the driver from the metrics rows, saved as report.json."""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from orchestrator.atomic import write_text_atomically
from orchestrator.errors import TopologyError
from orchestrator.placement.plan import DeviceKind, Plan
from orchestrator.topology import catalog
from rich.console import Console
from rich.table import Table


@dataclass(kw_only=True, slots=True)
class RunReport:
    name: str
    status: str
    """"completed" when the last step ran."""
    run_dir: str
    started_at: str
    """UTC, ISO 8601."""
    wall_seconds: float
    """This invocation of fit, from its start (dataset preparation and checks included) to the end of training."""
    world_size: int
    device: str
    num_params: int
    start_step: int
    """Step this invocation started from (0, or the resumed checkpoint's step)."""
    final_step: int
    tokens_seen: int
    """Tokens trained on since step 0, resumed runs included."""
    tokens_this_run: int
    tokens_per_second: float
    """Median over the run's metric reports (startup and checkpoints excluded)."""
    predicted_tokens_per_second: float
    """What the planner predicted for this plan (plan.json), to hold the cost model to account."""
    mfu: float | None
    """Model FLOPs utilisation: tokens/s × training FLOPs per token ÷ the devices' dense bf16 peak;
    None for CPU workers and MIG slices, whose peak the catalog does not give."""
    dollars_per_hour: float
    """Price of the plan's devices per hour (the [placement] pricing column)."""
    dollars: float
    """This invocation's bill: dollars_per_hour × wall_seconds (start-up included: it is billed too)."""
    dollars_per_million_tokens: float | None
    """dollars ÷ tokens_this_run, in millions."""
    final_train_loss: float | None
    final_val_loss: float | None
    checkpoint_path: str | None
    checkpoint_step: int | None
    metrics_path: str
    config: dict[str, Any]
    versions: dict[str, str]

    @classmethod
    def from_rows(cls, rows: list[dict], *, plan: Plan, **fields: Any) -> RunReport:
        steps = [r for r in rows if "loss" in r]
        vals = [r["val_loss"] for r in steps if "val_loss" in r]
        start = next((r for r in rows if r.get("event") == "start"), {})
        last_consumed = next((r["consumed_samples"] for r in reversed(steps) if "consumed_samples" in r), 0)
        start_step = start.get("step", 0)
        tokens_this_run = (steps[-1]["step"] - start_step) * plan.tokens_per_step if steps else 0
        tokens_per_second = statistics.median(r["tokens_per_s"] for r in steps) if steps else 0.0
        dollars = plan.predicted.dollars_per_hour * fields["wall_seconds"] / 3600
        return cls(
            world_size=start.get("world_size", 0),
            device=start.get("device", ""),
            num_params=start.get("params", 0),
            start_step=start_step,
            final_step=steps[-1]["step"] if steps else start_step,
            tokens_seen=last_consumed * plan.seq_len,
            tokens_this_run=tokens_this_run,
            tokens_per_second=tokens_per_second,
            predicted_tokens_per_second=plan.predicted.tokens_per_second,
            mfu=_mfu(plan, tokens_per_second, start.get("flops_per_token", 0)),
            dollars_per_hour=plan.predicted.dollars_per_hour,
            dollars=dollars,
            dollars_per_million_tokens=dollars / tokens_this_run * 1e6 if tokens_this_run else None,
            final_train_loss=steps[-1]["loss"] if steps else None,
            final_val_loss=vals[-1] if vals else None,
            versions={"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__},
            **fields,
        )

    def save(self, path: Path) -> None:
        write_text_atomically(path, json.dumps(asdict(self), indent=2))

    def print_summary(self, console: Console) -> None:
        table = Table(title=f"archipelago run {self.name!r}: {self.status}", show_header=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")  # paths are printed whole: users copy them
        loss = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        table.add_row("steps", f"{self.start_step} → {self.final_step}")
        table.add_row("final train loss", loss(self.final_train_loss))
        table.add_row("final validation loss", loss(self.final_val_loss))
        table.add_row("tokens seen", f"{self.tokens_seen:,} ({self.tokens_this_run:,} this run)")
        table.add_row("throughput", f"{self.tokens_per_second:,.0f} tokens/s on {self.world_size} × {self.device} "
                      f"(planner predicted {self.predicted_tokens_per_second:,.0f})")
        if self.mfu is not None:
            table.add_row("MFU", f"{self.mfu:.1%}")
        per_million = "-" if self.dollars_per_million_tokens is None else f"${self.dollars_per_million_tokens:.4f}"
        table.add_row("bill", f"${self.dollars:.4f} at ${self.dollars_per_hour:.2f}/hour; {per_million} per million tokens")
        table.add_row("wall time", f"{self.wall_seconds:.1f} s")
        table.add_row("checkpoint", self.checkpoint_path or "-")
        table.add_row("report", str(Path(self.run_dir) / "report.json"))
        console.print(table)


def _mfu(plan: Plan, tokens_per_second: float, flops_per_token: int) -> float | None:
    if not flops_per_token or any(w.device_kind != DeviceKind.GPU for w in plan.workers):
        return None
    try:
        peak = sum(catalog.by_key(w.device_model).peak_tflops.get("bf16", 0.0) for w in plan.workers) * 1e12
    except TopologyError:  # a GPU the catalog does not know: no honest peak to divide by
        return None
    return tokens_per_second * flops_per_token / peak if peak else None
