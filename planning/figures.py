"""Where the planner's figures for each GPU come from: the job's [devices] tables, the probe's
measurements, or the device catalog, in that order.

    figures = FigureBook(topology, config.devices)
    figure = figures.of(node, gpu, dtype="bf16")    # a Figure, or None for a GPU nothing describes
    figures.unknown                                 # {name: GPU count} of the GPUs nothing describes
    figures.notes                                   # measurements dropped as stale, tables matching no GPU

A measurement describes every GPU of its model in the cluster, on whatever node it was taken: one
probed node's figures plan the same model's nodes imported from nvidia-smi text too, memory
included (the text has none). A measurement from another driver than a node's own is stale for
that node; it is dropped with a note and the catalog answers instead.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from enum import StrEnum

from core.config import DeviceSpec
from topology import catalog
from topology.cluster import ClusterTopology, Gpu, MeasuredDevice, NodeTopology

MEASURED_MATMUL_SHARE_OF_PEAK = 780.0 / 989.4
"""What the probe's 8192³ bf16 product reaches of the dense peak on the GPU the compute model's
utilisation anchors were measured on: 769–798 TFLOP/s on an H200 (the workplace's KINDS.md, two
machines, 2026-10/11) of 989.4. A measured rate divided by it is the peak the anchors are a share
of, so a measured H200 plans as its catalog entry does and a slower or faster GPU in proportion."""
MEASURED_COPY_SHARE_OF_NOMINAL = 4300.0 / 4800.0
"""The same for memory: a device-to-device copy moved ~4.3 TB/s on an H200 (KINDS.md) of its 4.8 nominal."""


class Source(StrEnum):
    DECLARED = "declared"
    """A [devices."NAME"] table of the job config."""
    MEASURED = "measured"
    """The topology probe's micro-benchmark (NodeTopology.measured)."""
    CATALOG = "catalog"
    """topology/catalog.py: the vendor's data sheet."""
    NOMINAL = "nominal"
    """CPU slots without a measurement: a nominal rate per core (compute.ComputeModel)."""


@dataclass(frozen=True, slots=True)
class Figure:
    source: Source
    peak_tflops: float
    """The peak the compute model's utilisation is a share of, at the job's dtype (a measured rate
    scaled by MEASURED_MATMUL_SHARE_OF_PEAK)."""
    stated_tflops: float
    """What the source says: the declared or catalog peak, or the measured product rate."""
    memory_bytes: int | None
    """Replaces the map's memory: a declared figure, or a probed GPU's of the same name for a GPU the
    map has none for; None keeps the map's."""
    memory_bytes_per_s: float | None
    """Nominal-equivalent memory bandwidth; None where the source gives none."""


class FigureBook:
    def __init__(self, topology: ClusterTopology, declared: dict[str, DeviceSpec]):
        self._declared = {name.strip().lower(): spec for name, spec in declared.items()}
        self._measured: dict[str, list[tuple[NodeTopology, MeasuredDevice]]] = defaultdict(list)
        self._memory: dict[str, int] = {}
        self.unknown: Counter[str] = Counter()
        self.notes: list[str] = []
        self.prices: dict[str, float] = {}
        """Declared prices by the planner's model key (catalog key, else the name)."""
        self._stale: set[tuple[str, str]] = set()
        """(node, driver) pairs whose stale figures a note already names."""
        for node in topology.nodes:
            for device in node.measured:
                self._measured[device.name].append((node, device))
        for _, gpu in topology.gpus():
            if gpu.memory_bytes and gpu.name:
                self._memory[gpu.name] = max(self._memory.get(gpu.name, 0), gpu.memory_bytes)
        names = {name.lower() for _, gpu in topology.gpus() for name in (gpu.name, gpu.model) if name}
        for name in declared:
            if name.strip().lower() not in names:
                self.notes.append(f'[devices."{name}"] matches no GPU of the cluster (GPUs are named as '
                                  "`nvidia-smi -L` prints them, or by their catalog key)")

    def of(self, node: NodeTopology, gpu: Gpu, *, dtype: str) -> Figure | None:
        figure = self._declared_figure(gpu) or self._measured_figure(node, gpu, dtype) or _catalog_figure(gpu, dtype)
        if figure is None and not gpu.error:
            self.unknown[gpu.name] += 1
        return figure

    def _declared_figure(self, gpu: Gpu) -> Figure | None:
        names = [name.lower() for name in (gpu.name, gpu.model) if name]
        spec = next((self._declared[name] for name in names if name in self._declared), None)
        if spec is None:
            return None
        self.prices[gpu.model or gpu.name] = spec.price
        return Figure(source=Source.DECLARED, peak_tflops=spec.bf16_tflops, stated_tflops=spec.bf16_tflops,
                      memory_bytes=int(spec.memory_gib * 2**30),
                      memory_bytes_per_s=spec.memory_gb_per_s * 1e9 if spec.memory_gb_per_s else None)

    def _measured_figure(self, node: NodeTopology, gpu: Gpu, dtype: str) -> Figure | None:
        """The node's own measurement of the model, else another node's taken under the same driver
        (or any, for a node whose driver is unknown: an nvidia-smi text)."""
        candidates = sorted(self._measured.get(gpu.name, []), key=lambda pair: pair[0] is not node)
        for source_node, device in candidates:
            rate = device.bf16_tflops if dtype == "bf16" else device.fp32_tflops
            if not rate:
                continue
            if node.driver_version and device.driver_version != node.driver_version:
                self._note_stale(node, device)
                continue
            bandwidth = (device.memory_gb_per_s * 1e9 / MEASURED_COPY_SHARE_OF_NOMINAL
                         if device.memory_gb_per_s else None)
            return Figure(source=Source.MEASURED, peak_tflops=rate / MEASURED_MATMUL_SHARE_OF_PEAK, stated_tflops=rate,
                          memory_bytes=None if gpu.memory_bytes else self._memory.get(gpu.name),
                          memory_bytes_per_s=bandwidth)
        return None

    def _note_stale(self, node: NodeTopology, device: MeasuredDevice) -> None:
        if (node.node_id, device.driver_version) in self._stale:
            return
        self._stale.add((node.node_id, device.driver_version))
        driver = device.driver_version or "unknown"
        self.notes.append(f"dropped the {device.name} figures measured under driver {driver} for {node.node_id}, "
                          f"which runs driver {node.driver_version}: probe it again (`archipelago topology --local "
                          "--json`) to plan it on measured figures")


def _catalog_figure(gpu: Gpu, dtype: str) -> Figure | None:
    model = catalog.find(gpu.model) if gpu.model else (catalog.lookup(gpu.name) if gpu.name else None)
    peaks = gpu.peak_tflops or (model.peak_tflops if model else {})
    peak = catalog.peak_at(peaks, dtype)
    if not peak:
        return None
    return Figure(source=Source.CATALOG, peak_tflops=peak, stated_tflops=peak,
                  memory_bytes=model.memory_mib * 2**20 if model and not gpu.memory_bytes else None,
                  memory_bytes_per_s=model.memory_gb_per_s * 1e9 if model else None)
