"""Draw a topology as a PNG: nodes as boxes, GPUs grouped by NVLink island, link kinds as line styles.

    draw_png(cluster, "cluster.png")        # needs matplotlib

Inside a node, GPUs sit in rows by NUMA node (socket). An NVSwitch island is drawn as a switch
that every GPU of the island joins; direct NVLinks as lines whose width grows with the link
count; GPUs under one PCIe switch joined by a dashed line; MIG slices as small boxes in their GPU.
Paths further apart than one PCIe switch are left out: the socket rows already show them.
"""

from __future__ import annotations

import math
from pathlib import Path

from core.errors import ArchipelagoError
from topology.cluster import ClusterTopology, NodeTopology
from topology.links import LinkKind

MAX_NODES = 24
"""A bigger cluster is drawn as its first MAX_NODES nodes, and the title says how many are left out."""
_GPU_SIZE, _GPU_GAP, _ROW_GAP, _NODE_PAD = 1.2, 0.6, 1.0, 0.5
_ISLAND_COLOURS = ("#dbe9f6", "#fde2c8", "#d9f0d3", "#ecdcf3", "#f9d6d5", "#fff3b0", "#d5f0f0", "#e8e8e8")
_STYLES = {
    LinkKind.NVSWITCH: dict(color="#1f5fa8", linewidth=2.5, linestyle="-"),
    LinkKind.NVLINK: dict(color="#2e8b57", linewidth=1.5, linestyle="-"),
    LinkKind.PCIE_SWITCH: dict(color="#666666", linewidth=1.0, linestyle="--"),
}


def draw_png(cluster: ClusterTopology, path: str | Path) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        raise ArchipelagoError("drawing needs matplotlib, which is not installed", where="--png",
                               fix="pip install matplotlib, or save --json and print the table instead") from None
    nodes = cluster.nodes[:MAX_NODES]
    columns = max(1, min(4, math.ceil(math.sqrt(len(nodes)))))
    layouts = [_layout(node) for node in nodes]
    cell_w = max((w for w, _, _ in layouts), default=4.0) + 2 * _NODE_PAD + 1.0
    cell_h = max((h for _, h, _ in layouts), default=2.0) + 2 * _NODE_PAD + 1.0
    rows = math.ceil(len(nodes) / columns) or 1
    figure, axes = plt.subplots(figsize=(max(6.0, columns * cell_w * 0.9), max(3.0, rows * cell_h * 0.9)))
    island_colour = {island.island_id: _ISLAND_COLOURS[i % len(_ISLAND_COLOURS)]
                     for i, island in enumerate(i for i in cluster.nvlink_islands if i.size > 1)}
    for k, (node, (width, height, spots)) in enumerate(zip(nodes, layouts)):
        x0, y0 = (k % columns) * cell_w, -(k // columns) * cell_h
        _draw_node(axes, cluster, node, (x0, y0, width, height), spots, island_colour)
    left_out = len(cluster.nodes) - len(nodes)
    title = f"{len(cluster.nodes)} nodes" + (f" (first {len(nodes)} drawn, {left_out} left out)" if left_out else "")
    axes.set_title(title)
    axes.legend(handles=[Line2D([], [], **style, label=kind.value.replace("_", " ")) for kind, style in _STYLES.items()],
                loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=len(_STYLES), fontsize=8, frameon=False)
    axes.set_aspect("equal")
    axes.axis("off")
    axes.autoscale_view()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def _layout(node: NodeTopology) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """(width, height, GPU UUID → lower-left corner) with one row of GPUs per NUMA node."""
    rows: dict[int, list] = {}
    for gpu in node.gpus:
        rows.setdefault(gpu.numa_node if gpu.numa_node is not None else -1, []).append(gpu)
    spots, step = {}, _GPU_SIZE + _GPU_GAP
    for r, numa in enumerate(sorted(rows)):
        for c, gpu in enumerate(rows[numa]):
            spots[gpu.uuid] = (c * step, -r * (_GPU_SIZE + _ROW_GAP))
    width = max((len(row) for row in rows.values()), default=1) * step - _GPU_GAP
    height = max(1, len(rows)) * (_GPU_SIZE + _ROW_GAP) - _ROW_GAP + _NODE_PAD
    return width, height, spots


def _draw_node(axes, cluster: ClusterTopology, node: NodeTopology, box: tuple[float, float, float, float],
               spots: dict[str, tuple[float, float]], island_colour: dict[str, str]) -> None:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    x0, top, width, height = box
    axes.add_patch(FancyBboxPatch((x0, top - height - _NODE_PAD), width + 2 * _NODE_PAD, height + _NODE_PAD,
                                  boxstyle="round,pad=0.1", facecolor="white", edgecolor="black"))
    axes.text(x0, top + 0.15, f"{node.node_id}  ({len(node.gpus)} GPUs, {len(node.nics)} NICs)", fontsize=8,
              weight="bold")
    origin = (x0 + _NODE_PAD, top - _NODE_PAD - _GPU_SIZE)
    centre = {uuid: (origin[0] + x + _GPU_SIZE / 2, origin[1] + y + _GPU_SIZE / 2) for uuid, (x, y) in spots.items()}
    for island in cluster.nvlink_islands:
        members = [uuid for uuid in island.gpu_uuids if uuid in centre]
        if len(island.gpu_uuids) > 1 and island.interconnect == LinkKind.NVSWITCH and members:
            hub = (sum(centre[u][0] for u in members) / len(members), origin[1] + _GPU_SIZE + 0.3)
            for uuid in members:
                axes.plot(*zip(hub, centre[uuid]), zorder=1, **_STYLES[LinkKind.NVSWITCH])
            axes.plot(*hub, marker="s", markersize=7, color=_STYLES[LinkKind.NVSWITCH]["color"], zorder=3)
    for link in node.links:
        style = _STYLES.get(link.kind)
        if link.kind == LinkKind.NVLINK:
            style = {**style, "linewidth": 0.8 + 0.4 * link.nvlink_count}
        if style and link.kind != LinkKind.NVSWITCH:
            (xa, ya), (xb, yb) = centre[link.gpu_a], centre[link.gpu_b]
            neighbours = math.dist((xa, ya), (xb, yb)) < 1.5 * (_GPU_SIZE + max(_GPU_GAP, _ROW_GAP))
            # Bend links that would pass straight through the GPUs between their ends.
            axes.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="-", shrinkA=0, shrinkB=0, zorder=1,
                                           connectionstyle=f"arc3,rad={0 if neighbours else 0.25}",
                                           color=style["color"], linewidth=style["linewidth"],
                                           linestyle=style["linestyle"]))
    for gpu in node.gpus:
        island = cluster.island_of(gpu.uuid)
        colour = island_colour.get(island.island_id, "white") if island else "#f0f0f0"
        x, y = centre[gpu.uuid][0] - _GPU_SIZE / 2, centre[gpu.uuid][1] - _GPU_SIZE / 2
        axes.add_patch(Rectangle((x, y), _GPU_SIZE, _GPU_SIZE, facecolor=colour, zorder=2,
                                 edgecolor="red" if gpu.error else "black"))
        axes.text(x + 0.05, y + _GPU_SIZE - 0.2, f"GPU{gpu.index}", fontsize=6, zorder=4)
        axes.text(x + 0.05, y + 0.08, gpu.model or gpu.name or "?", fontsize=4, zorder=4)
        slices = sum(1 for s in node.mig_slices if s.parent_uuid == gpu.uuid)
        for k in range(slices):
            axes.add_patch(Rectangle((x + 0.06 + (k % 4) * 0.22, y + 0.3 + (k // 4) * 0.22), 0.18, 0.18,
                                     facecolor="#c9a0dc", edgecolor="black", linewidth=0.4, zorder=3))
