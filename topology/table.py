"""Print a topology for people: a summary, then per node its GPUs, islands, link matrix, MIG slices and NICs.

    print_topology(cluster, Console())
"""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from core.columns import Column, print_fitted
from topology.cluster import ClusterTopology, GpuLink, NodeTopology
from topology.links import PCIE_PATHS, LinkKind

_MATRIX_MAX_GPUS = 16
_CODES = {LinkKind.PCIE_SWITCH: "PIX", LinkKind.PCIE_SWITCHES: "PXB", LinkKind.HOST_BRIDGE: "PHB",
          LinkKind.SAME_SOCKET: "NODE", LinkKind.CROSS_SOCKET: "SYS", LinkKind.HOST_MEMORY: "HOST"}
_LEGEND = ("NV# = # NVLinks (through NVSwitch where the island says so), PIX = one PCIe switch, PXB = several, "
           "PHB = host bridge, NODE = same socket, SYS = across sockets, HOST = no peer-to-peer: via host memory")


def print_topology(cluster: ClusterTopology, console: Console) -> None:
    console.print(summary(cluster), highlight=False)
    for node in cluster.nodes:
        console.print()
        _print_node(cluster, node, console)


def summary(cluster: ClusterTopology) -> str:
    models = Counter(gpu.model or gpu.name or "unnamed GPU (no `nvidia-smi -L` text)" for _, gpu in cluster.gpus())
    slices = sum(len(node.mig_slices) for node in cluster.nodes)
    nvlinked = [island for island in cluster.nvlink_islands if island.size > 1]
    bf16 = sum(gpu.peak_tflops.get("bf16", 0.0) for _, gpu in cluster.gpus() if gpu.usable_whole)
    bf16 += sum(s.peak_tflops.get("bf16", 0.0) for node in cluster.nodes for s in node.mig_slices)
    uncatalogued = sum(1 for _, gpu in cluster.gpus() if not gpu.model)
    gpus = ", ".join(f"{count}× {model}" for model, count in models.most_common()) or "no GPUs"
    missing = f" ({uncatalogued} GPUs not in the device catalog: no peak counted)" if uncatalogued else ""
    return (f"[bold]{len(cluster.nodes)} node{'s' * (len(cluster.nodes) != 1)}[/]: {gpus}; {slices} MIG slices; "
            f"{len(nvlinked)} NVLink islands of 2+ GPUs; peak dense bf16 {bf16 / 1000:,.2f} PFLOP/s{missing}")


def _print_node(cluster: ClusterTopology, node: NodeTopology, console: Console) -> None:
    ray = f", Ray node {node.ray_node_id[:12]}" if node.ray_node_id else ""
    address = f" ({node.address})" if node.address else ""
    console.print(f"[bold]{node.node_id}[/]{address}{ray}: {node.cpu_count} CPUs, "
                  f"{_gib(node.memory_bytes)} GiB, {len(node.numa_nodes)} NUMA nodes, "
                  f"driver {node.driver_version or 'unknown'}, from {node.source}", highlight=False)
    if node.gpus:
        _print_gpus(cluster, node, console)
    for island in cluster.nvlink_islands:
        if node.node_id in island.node_ids and island.size > 1:
            shape = "fully connected" if island.fully_connected else "not fully connected"
            span = f" across {len(island.node_ids)} nodes" if len(island.node_ids) > 1 else ""
            console.print(f"  island {island.island_id}: {island.size} GPUs{span}, {island.interconnect.value}, "
                          f"{shape}, ≥{island.nvlink_count} NVLinks and {island.bandwidth_gb_per_s:g} GB/s "
                          "per pair", highlight=False)
    if 1 < len(node.gpus) <= _MATRIX_MAX_GPUS and node.links:
        console.print(_link_matrix(node))
        console.print(f"  [dim]{_LEGEND}[/]")
    if node.mig_slices:
        _print_mig_slices(node, console)
    if node.nics:
        console.print(_nic_table(node))
    if node.measured:
        _print_measured(node, console)
    for gpu in node.gpus:
        if gpu.error:
            console.print(f"  [red]GPU {gpu.index}:[/] {escape(gpu.error)}", highlight=False)
    for note in node.notes:
        console.print(f"  [yellow]note:[/] {escape(note)}", highlight=False)


_GPU_COLUMNS = (Column("GPU"), Column("model"), Column("GiB", "right"), Column("SMs", "right", drop=2),
                Column("NUMA", drop=4), Column("CPUs", drop=3), Column("island"), Column("bf16 TFLOP/s", "right"),
                Column("state"), Column("UUID", drop=1))


def _print_gpus(cluster: ClusterTopology, node: NodeTopology, console: Console) -> None:
    rows = []
    for gpu in node.gpus:
        island = cluster.island_of(gpu.uuid)
        state = "[red]error[/]" if gpu.error else "MIG" if gpu.mig_enabled else "ok"
        rows.append([str(gpu.index), gpu.model or gpu.name or "?", f"{gpu.memory_bytes / 2**30:.0f}",
                     str(gpu.sm_count or "?"), "?" if gpu.numa_node is None else str(gpu.numa_node),
                     gpu.cpu_affinity or "?", island.island_id if island else "-", _bf16(gpu.peak_tflops), state,
                     gpu.uuid])
    print_fitted(console, _GPU_COLUMNS, rows, box=None, pad_edge=False, padding=(0, 2, 0, 2))


def _link_matrix(node: NodeTopology) -> Table:
    by_pair: dict[frozenset[str], GpuLink] = {frozenset((link.gpu_a, link.gpu_b)): link for link in node.links}
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 2))
    table.add_column("")
    for gpu in node.gpus:
        table.add_column(f"GPU{gpu.index}", justify="center")
    for row in node.gpus:
        cells = []
        for column in node.gpus:
            link = by_pair.get(frozenset((row.uuid, column.uuid)))
            cells.append("X" if row is column else "-" if link is None else
                         f"NV{link.nvlink_count}" if link.kind.is_nvlink else _CODES[link.kind])
        table.add_row(f"GPU{row.index}", *cells)
    return table


_MIG_COLUMNS = (Column("MIG slice", drop=1), Column("on GPU"), Column("profile"), Column("GiB", "right"),
                Column("SMs", "right", drop=3), Column("SM share", "right", drop=2), Column("bf16 TFLOP/s", "right"))


def _print_mig_slices(node: NodeTopology, console: Console) -> None:
    index_of = {gpu.uuid: gpu.index for gpu in node.gpus}
    rows = [[mig.uuid, str(index_of[mig.parent_uuid]), mig.profile, f"{mig.memory_bytes / 2**30:.1f}",
             str(mig.sm_count or "?"), f"{mig.sm_share:.3f}", _bf16(mig.peak_tflops)] for mig in node.mig_slices]
    print_fitted(console, _MIG_COLUMNS, rows, box=None, pad_edge=False, padding=(0, 2, 0, 2))


def _nic_table(node: NodeTopology) -> Table:
    index_of = {gpu.uuid: gpu.index for gpu in node.gpus}
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 2))
    for column in ("NIC", "kind", "Gbit/s", "NUMA", "state", "nearest GPUs"):
        table.add_column(column)
    for nic in node.nics:
        nearest = min(nic.gpu_paths.values(), key=PCIE_PATHS.index, default=None)
        gpus = ",".join(str(index_of[uuid]) for uuid, path in nic.gpu_paths.items() if path == nearest)
        table.add_row(nic.name, nic.kind.value, f"{nic.speed_gbit_per_s:g}" if nic.speed_gbit_per_s else "?",
                      "?" if nic.numa_node is None else str(nic.numa_node), "up" if nic.up else "down",
                      f"{gpus} ({_CODES[nearest]})" if nearest else "-")
    return table


_MEASURED = ((Column("device"), "name"), (Column("bf16 TFLOP/s", "right"), "bf16_tflops"),
             (Column("fp8", "right", drop=4), "fp8_tflops"), (Column("fp32", "right", drop=7), "fp32_tflops"),
             (Column("fp32 block", "right", drop=6), "fp32_block_tflops"), (Column("memory GB/s", "right"), "memory_gb_per_s"),
             (Column("host→device", "right", drop=5), "host_to_device_gb_per_s"),
             (Column("device→host", "right", drop=3), "device_to_host_gb_per_s"), (Column("peer", "right", drop=2), "peer_gb_per_s"))
"""The micro-benchmark's figures, each column with the order it is left out in on a narrow terminal."""


def _print_measured(node: NodeTopology, console: Console) -> None:
    """The micro-benchmark's figures: per GPU, or per core for the CPUs (0 shown as -)."""
    rows = []
    for device in node.measured:
        name = f"cpu (per core of {device.cores})" if device.name == "cpu" else device.name
        cells = [f"{getattr(device, key):.4g}" if getattr(device, key) else "-" for _, key in _MEASURED[1:]]
        rows.append([name, *cells, f"driver {device.driver_version}" if device.driver_version else "-"])
    columns = [column for column, _ in _MEASURED] + [Column("under", drop=1)]
    print_fitted(console, columns, rows, box=None, pad_edge=False, padding=(0, 2, 0, 2), title="measured",
                 title_justify="left")


def _bf16(peak_tflops: dict[str, float]) -> str:
    return f"{peak_tflops['bf16']:g}" if "bf16" in peak_tflops else "-"


def _gib(size_bytes: int) -> str:
    return f"{size_bytes / 2**30:,.0f}" if size_bytes else "?"
