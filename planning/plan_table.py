"""Print a plan for people: its workers (grouped when there are many), and its predictions beside a naive plan's.

    print_plan(plan, naive, console)
"""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.markup import escape

from core.columns import Column, print_fitted
from core.plan import AllReduce, DataParallel, Objective, Plan

WORKER_ROWS_MAX = 32
"""Plans with more workers print one row per (node kind, device, micro-batch) group instead."""


def print_plan(plan: Plan, naive: Plan | None, console: Console, *, naive_reason: str = "") -> None:
    console.print(_headline(plan), highlight=False)
    console.print(f"  mesh {mesh_text(plan)}", highlight=False)
    _print_models(plan, console)
    _print_workers(plan, console)
    _print_comparison(plan, naive, console)
    if naive is None:
        console.print(f"  [dim]naive plan: {escape(naive_reason or 'none')}[/]", highlight=False)
    for note in plan.notes:
        console.print(f"  [yellow]note:[/] {escape(note)}", highlight=False)
    if naive is not None:
        for note in naive.notes:
            console.print(f"  [dim]naive: {escape(note)}[/]", highlight=False)


def _headline(plan: Plan) -> str:
    # Beside tensor parallelism the data-parallel side runs on FSDP2 (ddp as replicas of one shard), which
    # has no DDP comm hook or buckets.
    on_mesh = plan.tensor_parallel_size > 1
    strategy = plan.data_parallel.value
    if on_mesh and plan.data_parallel == DataParallel.DDP:
        strategy += " as FSDP2 replicas"
    if on_mesh:
        strategy += f", tensor parallel {plan.tensor_parallel_size}"
    buckets = "" if on_mesh else ", ".join(f"{kind} {size / 2**20:.0f} MiB" for kind, size in plan.ddp_bucket_bytes.items())
    workers = f"{plan.world_size} worker{'s' * (plan.world_size != 1)}"
    reduction = {AllReduce.NONE: "no gradient reduction",
                 AllReduce.ALL_GATHER: f"all-gather of compressed gradients over {plan.backend}"}.get(
        plan.allreduce, f"{plan.allreduce.value} all-reduce over {plan.backend}")
    if plan.comm_hook and plan.allreduce != AllReduce.NONE and plan.data_parallel == DataParallel.DDP and not on_mesh:
        reduction += f" (comm hook {plan.comm_hook})"
    return (f"[bold]plan '{escape(plan.job_name)}'[/] ({plan.objective.value}): {workers}, "
            f"{strategy}, {reduction}, global batch {plan.global_batch_size} = "
            f"{_micro_batches(plan)} × {plan.grad_accum_steps} accumulation" + (f"; buckets {buckets}" if buckets else ""))


def significant(value: float) -> str:
    """Three significant figures below 100, so a small step, price or job stays readable ("0.00183", not
    "0.00"); two decimals from 100 on ("1,234.50")."""
    return f"{value:,.2f}" if abs(value) >= 100 else f"{value:#.3g}"


def mesh_text(plan: Plan) -> str:
    """The device mesh in one line: "dp_replicate 2 × dp_shard 4 × tp 2 (16 ranks, tp innermost)"."""
    dims = " × ".join(f"{name} {size}" for name, size in zip(plan.mesh_dim_names, plan.mesh_shape))
    return f"{dims} ({plan.world_size} rank{'s' * (plan.world_size != 1)}, row-major: the last dimension's ranks are consecutive)"


def _micro_batches(plan: Plan) -> str:
    """The replicas' micro-batches whose sum times the accumulation is the global batch: "(16 + 16)", or for many
    replicas grouped by size, "(12 × 32 + 4 × 16)"."""
    sizes = plan.replica_micro_batch_sizes()
    if len(sizes) <= 8:
        return f"({' + '.join(map(str, sizes))})"
    groups = sorted(Counter(sizes).items(), reverse=True)
    return f"({' + '.join(f'{count} × {size}' for size, count in groups)})"


_WORKER_COLUMNS = (Column("rank", "right"), Column("island or node"), Column("device"),
                   Column("micro-batch", "right"), Column("peak GiB", "right"), Column("device UUID", drop=1))
_NIC_COLUMN = Column("NCCL NICs", drop=2)
"""Shown where the plan sets workers' NICs; kept over the UUIDs, as it is what the plan chose."""
_GROUP_COLUMNS = (Column("workers", "right"), Column("nodes", "right"), Column("device"),
                  Column("micro-batch", "right"), Column("peak GiB", "right"), Column("compute s", "right", drop=1))
_TABLE = {"box": None, "pad_edge": False, "padding": (0, 1, 0, 1)}


def _print_workers(plan: Plan, console: Console) -> None:
    if plan.world_size > WORKER_ROWS_MAX:
        print_fitted(console, _GROUP_COLUMNS, _worker_groups(plan), **_TABLE)
        return
    nics = any(w.environment for w in plan.workers)
    rows = []
    for w in plan.workers:
        nic_names = " ".join(f"{key.removeprefix('NCCL_')}{value}" for key, value in w.environment.items())
        rows.append([str(w.rank), w.island_id or w.node_id, w.device_model, str(w.micro_batch_size),
                     f"{w.predicted_peak_memory_bytes / 2**30:.2f}", w.device_uuid or "-", *((nic_names or "-",) * nics)])
    print_fitted(console, (*_WORKER_COLUMNS, *((_NIC_COLUMN,) * nics)), rows, **_TABLE)


def _worker_groups(plan: Plan) -> list[list[str]]:
    """One row per (device, micro-batch) group, largest micro-batch first."""
    groups = Counter((w.device_model, w.micro_batch_size) for w in plan.workers)
    rows = []
    for (model, micro_batch), count in sorted(groups.items(), key=lambda item: (-item[0][1], item[0][0])):
        members = [w for w in plan.workers if w.device_model == model and w.micro_batch_size == micro_batch]
        rows.append([f"{count:,}", f"{len({w.node_id for w in members}):,}", model, str(micro_batch),
                     f"{max(w.predicted_peak_memory_bytes for w in members) / 2**30:.2f}",
                     significant(max(w.predicted_compute_seconds for w in members))])
    return rows


_MODEL_COLUMNS = (Column("device"), Column("workers", "right"), Column("figures", drop=1),
                  Column("TFLOP/s", "right", drop=2), Column("micro-batch"), Column("share of samples", "right"),
                  Column("compute s", "right", drop=3))


def _print_models(plan: Plan, console: Console) -> None:
    """Per device model: its workers, where its figures come from, its micro-batches, and the share of
    each step's samples it trains on (with its predicted compute a step)."""
    bases = {basis.device_model: basis for basis in plan.device_bases}
    replicas = {w.data_parallel_rank: w for w in plan.workers}  # a tensor-parallel group trains as one replica
    rows = []
    for model in dict.fromkeys(w.device_model for w in plan.workers):
        members = [w for w in plan.workers if w.device_model == model]
        samples = sum(w.micro_batch_size for w in replicas.values() if w.device_model == model) * plan.grad_accum_steps
        basis = bases.get(model)
        figures = "-" if basis is None else basis.source + (
            f", calibrated ×{basis.compute_efficiency:.3g}" if basis.compute_efficiency != 1 else "")
        rows.append([model, f"{len(members):,}", figures, f"{basis.tflops:,.4g}" if basis else "-",
                     "/".join(map(str, sorted({w.micro_batch_size for w in members}, reverse=True))),
                     f"{samples / plan.global_batch_size:.1%}",
                     significant(max(w.predicted_compute_seconds for w in members))])
    print_fitted(console, _MODEL_COLUMNS, rows, **_TABLE, title="devices", title_justify="left")


_WHOLE = "{:,.0f}".format
_ROWS = (("step s", "step_seconds", significant), ("compute s", "compute_seconds", significant),
         ("exposed comm s", "exposed_communication_seconds", significant),
         ("all comm s", "communication_seconds", significant), ("tokens/s", "tokens_per_second", _WHOLE),
         ("$/hour", "dollars_per_hour", significant), ("$/step", "dollars_per_step", significant),
         ("$/M tokens", "dollars_per_million_tokens", significant), ("job hours", "job_hours", significant),
         ("job $", "job_dollars", significant))
_GOODPUT_ROWS = (("batch efficiency", "statistical_efficiency", "{:.3f}".format),
                 ("goodput tokens/s", "goodput_tokens_per_second", _WHOLE))
"""Shown under the goodput objectives: what the plan's global batch is worth at the noise scale."""
_TARGET_ROW = ("$ to target", "dollars_to_target", significant)
"""Shown where the plan was made with [placement] tokens_to_target."""


_COMPARISON_COLUMNS = (Column(""), Column("planned", "right"), Column("naive (Ray PACK, uniform)", "right"),
                       Column("naive / planned", "right", drop=1))


def _print_comparison(plan: Plan, naive: Plan | None, console: Console) -> None:
    rows = [["workers", str(plan.world_size), str(naive.world_size) if naive else "-", ""],
            ["global batch", str(plan.global_batch_size), str(naive.global_batch_size) if naive else "-", ""]]
    predictions = _ROWS
    if plan.objective in (Objective.GOODPUT, Objective.CHEAPEST_TO_TARGET):
        predictions += _GOODPUT_ROWS
    if plan.predicted.dollars_to_target > 0:
        predictions += (_TARGET_ROW,)
    for label, name, form in predictions:
        mine = getattr(plan.predicted, name)
        theirs = getattr(naive.predicted, name) if naive else None
        rows.append([label, form(mine), form(theirs) if theirs is not None else "-", _ratio(mine, theirs)])
    print_fitted(console, _COMPARISON_COLUMNS, rows, box=None, pad_edge=False, padding=(0, 2, 0, 2),
                 title="predicted per step", title_justify="left")


def _ratio(mine: float, theirs: float | None) -> str:
    if theirs is None or mine <= 0:
        return "-"
    return f"{theirs / mine:.2f}×"
