"""torch.compile with the numbers a run should report: compile seconds, graph breaks, recompiles.

Dynamo's counters are per process, and a worker process compiles one model, so a snapshot of
them is this model's compile record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch._dynamo.utils as dynamo_utils

from core.config import CompileConfig


@dataclass(frozen=True, slots=True)
class CompileStats:
    frames_compiled: int
    recompilations: int
    graph_breaks: int
    compile_seconds: float
    break_reasons: tuple[str, ...]
    """First line of each distinct graph-break reason, for the run's report."""

    def as_metrics(self) -> dict:
        stats = asdict(self)
        stats["break_reasons"] = list(self.break_reasons)
        return stats


def compile_stats() -> CompileStats:
    metrics = dynamo_utils.get_compilation_metrics()
    breaks = dynamo_utils.counters["graph_break"]
    return CompileStats(
        frames_compiled=len(metrics),
        recompilations=sum(1 for m in metrics if m.recompile_reason),
        graph_breaks=sum(breaks.values()),
        compile_seconds=round(sum(m.entire_frame_compile_time_s or 0.0 for m in metrics), 3),
        break_reasons=tuple(reason.splitlines()[0] for reason in breaks),
    )


def compile_options(cfg: CompileConfig, *, fullgraph: bool) -> dict:
    """Keyword arguments for torch.compile / Module.compile ("default" is torch's mode=None)."""
    return {"mode": None if cfg.mode == "default" else cfg.mode, "fullgraph": fullgraph}


def maybe_compile(module: torch.nn.Module, cfg: CompileConfig, *, fullgraph: bool) -> torch.nn.Module:
    """Compiles `module` when asked; fullgraph only where the wrapping allows one graph."""
    return torch.compile(module, **compile_options(cfg, fullgraph=fullgraph)) if cfg.enable else module
