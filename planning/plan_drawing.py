"""Draw a plan as a PNG: its workers on the cluster map, and its predicted step beside a naive plan's.

    draw_plan_png(plan, topology, "plan.png", naive=naive)      # needs matplotlib

Top: one box per node (the first MAX_NODES), a cell per GPU or MIG slice, coloured by device
model when a worker runs there and grey when the plan leaves it idle; each used cell shows the
worker's rank and micro-batch. Bottom: predicted step time, compute and exposed communication
stacked, for the plan and the naive plan. Like `archipelago topology --png`, matplotlib is
imported only here, and its absence is a one-line error.
"""

from __future__ import annotations

import math
from pathlib import Path

from core.errors import ArchipelagoError
from core.plan import Plan
from topology.cluster import ClusterTopology

MAX_NODES = 24
_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#9d755d")


def draw_plan_png(plan: Plan, topology: ClusterTopology, path: str | Path, *, naive: Plan | None = None) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise ArchipelagoError("drawing needs matplotlib, which is not installed", where="--png",
                               fix="pip install matplotlib, or save --json and read the table instead") from None
    by_uuid = {w.device_uuid: w for w in plan.workers if w.device_uuid}
    cpu_workers: dict[str, list] = {}
    for w in plan.workers:
        if w.device_uuid is None:
            cpu_workers.setdefault(w.node_id, []).append(w)
    models = sorted({w.device_model for w in plan.workers})
    colour = {model: _COLOURS[i % len(_COLOURS)] for i, model in enumerate(models)}
    nodes = topology.nodes[:MAX_NODES]
    cells = [_cells(node, by_uuid, cpu_workers) for node in nodes]
    width = max((len(c) for c in cells), default=1)
    columns = max(1, min(4, math.ceil(math.sqrt(len(nodes)))))
    rows = math.ceil(len(nodes) / columns) or 1
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, columns * (width * 0.55 + 1)), 2.2 * rows + 3),
                                         gridspec_kw={"height_ratios": [max(1, rows) * 2, 1.4]})
    for k, (node, node_cells) in enumerate(zip(nodes, cells)):
        x0, y0 = (k % columns) * (width * 0.55 + 1), -(k // columns) * 2.2
        top.add_patch(Rectangle((x0 - 0.1, y0 - 0.1), len(node_cells) * 0.55 + 0.1, 1.0, fill=False))
        top.text(x0, y0 + 1.05, node.node_id, fontsize=7, weight="bold")
        for j, (label, worker) in enumerate(node_cells):
            face = colour[worker.device_model] if worker else "#dddddd"
            top.add_patch(Rectangle((x0 + j * 0.55, y0), 0.45, 0.8, facecolor=face, edgecolor="black", linewidth=0.4))
            text = f"r{worker.rank}\nm{worker.micro_batch_size}" if worker else label
            top.text(x0 + j * 0.55 + 0.225, y0 + 0.4, text, fontsize=5, ha="center", va="center")
    left_out = len(topology.nodes) - len(nodes)
    top.set_title(f"plan '{plan.job_name}': {plan.world_size} workers" +
                  (f" (first {len(nodes)} of {len(topology.nodes)} nodes drawn)" if left_out else ""))
    top.legend(handles=[Patch(color=colour[m], label=m) for m in models] + [Patch(color="#dddddd", label="idle")],
               loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=min(4, len(models) + 1), fontsize=7,
               frameon=False)
    top.set_aspect("equal")
    top.axis("off")
    top.autoscale_view()
    _draw_steps(bottom, plan, naive)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def _cells(node, by_uuid: dict, cpu_workers: dict) -> list[tuple[str, object]]:
    """(label, worker or None) for each device of the node, whole GPUs then MIG slices; CPU workers."""
    if not node.gpus:
        return [("cpu", w) for w in cpu_workers.get(node.node_id, [])] or [("cpu", None)]
    cells = [(f"GPU{gpu.index}", by_uuid.get(gpu.uuid)) for gpu in node.gpus if not gpu.mig_enabled]
    cells += [(mig.profile, by_uuid.get(mig.uuid)) for mig in node.mig_slices]
    return cells


def _draw_steps(axes, plan: Plan, naive: Plan | None) -> None:
    plans = [("planned", plan)] + ([("naive", naive)] if naive else [])
    names = [name for name, _ in plans]
    compute = [p.predicted.compute_seconds for _, p in plans]
    exposed = [p.predicted.exposed_communication_seconds for _, p in plans]
    axes.barh(names, compute, color="#4c78a8", label="compute")
    axes.barh(names, exposed, left=compute, color="#e45756", label="exposed communication")
    for i, (_, p) in enumerate(plans):
        axes.text(p.predicted.step_seconds, i, f"  {p.predicted.step_seconds:.3g} s, "
                  f"${p.predicted.dollars_per_million_tokens:.3g}/M tok", va="center", fontsize=7)
    axes.set_xlabel("predicted seconds per step")
    axes.set_xlim(0, 1.45 * max(p.predicted.step_seconds for _, p in plans))  # room for the labels
    axes.invert_yaxis()
    axes.legend(fontsize=7, loc="upper right")
