"""What a training step costs: collective times (alpha–beta), compute time, and dollars.

    collectives = CollectiveCostModel()              # or Calibration.load("calibration.json").collectives()
    hop = collectives.hop(LinkClass.INFINIBAND, nominal_gb_per_s=50)
    seconds, latency = collectives.ring_allreduce(2**30, ranks=16, hop=hop)
    collectives.gradient_reduction(2**30, ranks=16, world_hop=hop).seconds()     # the fastest algorithm
    ComputeModel.compiled().gpu_seconds_per_sample(989.4, 4.8e12, job.step_shape)   # job: costing.PlanningJob
    PriceTable().dollars_per_hour("H100-SXM5-80GB", spot=False)
    PriceTable.for_job(config)                 # defaults, then [bill] prices_file, then [placement] prices
    PriceTable().dollars_per_bf16_tflops_hour("MI300X", spot=True)   # the unit that compares vendors

Collectives follow the alpha–beta model: a collective of n bytes over p ranks takes
(steps × alpha) + (bytes each rank moves / beta). Ring all-reduce: 2(p−1) steps moving
2(p−1)/p · n; NCCL's (double binary) tree: 2⌈log2 p⌉ steps moving 2n; reduce-scatter and
all-gather: p−1 steps moving (p−1)/p · n; hierarchical: reduce-scatter inside each island,
all-reduce of the 1/k shards across islands (k such reductions share each node's NICs, so
each gets 1/k of them), all-gather inside each island. A ring runs at its slowest hop.

Each hop's alpha and beta come from a calibration table per link class: beta is the link's
nominal bandwidth (from the topology) times an efficiency, or a measured bus bandwidth that
replaces it. The defaults are planning figures (nccl-tests busbw on common machines: NVSwitch
H100 ~370–480 GB/s of 450 nominal, 400G InfiniBand ~46–48 of 50 GB/s); a calibration file
(planning/calibration.py) puts measured rows in their place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from core.errors import ConfigError
from core.plan import AllReduce


class LinkClass(StrEnum):
    """What the bottleneck hop of a collective runs over: a calibration table's row."""

    NVSWITCH = "nvswitch"
    NVLINK = "nvlink"
    PCIE = "pcie"
    HOST_MEMORY = "host_memory"
    """Staged through host memory: MIG slices, GPUs without peer-to-peer."""
    INFINIBAND = "infiniband"
    ROCE = "roce"
    ETHERNET = "ethernet"
    """TCP sockets between nodes."""
    LOOPBACK = "loopback"
    """gloo between CPU worker processes of one node."""


@dataclass(frozen=True, slots=True)
class LinkCalibration:
    alpha_us: float
    """Latency of one step of a ring or tree on this link, software included."""
    efficiency: float = 1.0
    """Achieved bus bandwidth as a share of the link's nominal bandwidth."""
    bus_gb_per_s: float = 0.0
    """A measured bus bandwidth (nccl-tests busbw); when above 0 it replaces nominal × efficiency."""
    ddp_compute_slowdown: float = 0.0
    """Share by which a DDP micro-step that reduces its gradients over this link runs longer than
    the same micro-step alone on one GPU. Not a wait on the wire (that is costed apart): the kernels
    themselves run slower beside the collective. A bandwidth sweep cannot see it, so a row read from
    a calibration file that leaves it out keeps its link class's figure (DEFAULT_CALIBRATION); a row
    built in Python gets 0 unless it says otherwise."""


NVLINK_DDP_COMPUTE_SLOWDOWN = 0.08
"""Measured on two H200s over NVSwitch, GPT-2 124M and 1.3B under DDPOptimizer: the step ran 6.7–9.6 %
longer than one GPU's, with 98–99 % of the all-reduce hidden, and 7–9 % for every comm hook,
top-k's 5 MB included (benchmarks/RESULTS.md, "Why two GPUs cost 7 % more"). A profile of the 124M
step puts it in the kernels: a split-K weight-gradient GEMM 4.8 -> 6.6 ms beside the all-reduce,
the graph's fused kernels +1 ms once DDPOptimizer cuts it at bucket boundaries. NVLink without a
switch moves data the same way (kernels on both GPUs), so it is assumed to cost the same:
unmeasured. Over TCP between the same two GPUs the step ran within its hook's own compute of a
one-rank DDP run's (0 in that calibration row)."""


DEFAULT_CALIBRATION: dict[LinkClass, LinkCalibration] = {
    LinkClass.NVSWITCH: LinkCalibration(alpha_us=6.0, efficiency=0.85,
                                        ddp_compute_slowdown=NVLINK_DDP_COMPUTE_SLOWDOWN),
    LinkClass.NVLINK: LinkCalibration(alpha_us=6.0, efficiency=0.80, ddp_compute_slowdown=NVLINK_DDP_COMPUTE_SLOWDOWN),
    LinkClass.PCIE: LinkCalibration(alpha_us=10.0, efficiency=0.75),
    LinkClass.HOST_MEMORY: LinkCalibration(alpha_us=25.0, efficiency=0.60),
    LinkClass.INFINIBAND: LinkCalibration(alpha_us=10.0, efficiency=0.94),
    LinkClass.ROCE: LinkCalibration(alpha_us=15.0, efficiency=0.85),
    LinkClass.ETHERNET: LinkCalibration(alpha_us=60.0, efficiency=0.60),
    LinkClass.LOOPBACK: LinkCalibration(alpha_us=40.0, bus_gb_per_s=2.0),
}


@dataclass(frozen=True, slots=True)
class Hop:
    """One calibrated hop: the link class, alpha in seconds and beta in bytes per second."""

    link_class: LinkClass
    alpha_s: float
    bytes_per_s: float

    def slower(self, other: Hop) -> Hop:
        """The hop a ring over both runs at: the lower bandwidth, the higher latency."""
        return Hop(self.link_class if self.bytes_per_s <= other.bytes_per_s else other.link_class,
                   max(self.alpha_s, other.alpha_s), min(self.bytes_per_s, other.bytes_per_s))


@dataclass(frozen=True, slots=True)
class Reduction:
    """How a gradient all-reduce runs: the algorithm, its bandwidth time for all the bytes, and the
    latency it pays again for every bucket."""

    algorithm: AllReduce
    bandwidth_seconds: float
    latency_s: float

    def seconds(self, buckets: int = 1) -> float:
        return self.bandwidth_seconds + buckets * self.latency_s


@dataclass(frozen=True, slots=True)
class Bucketing:
    """DDP buckets for one reduction: their size, count, total time and what the step waits for."""

    bucket_bytes: int
    buckets: int
    seconds: float
    exposed_seconds: float


class CollectiveCostModel:
    def __init__(self, calibration: dict[LinkClass, LinkCalibration] | None = None):
        self.calibration = {**DEFAULT_CALIBRATION, **(calibration or {})}

    def hop(self, link_class: LinkClass, nominal_gb_per_s: float = 0.0) -> Hop:
        row = self.calibration[link_class]
        gb_per_s = row.bus_gb_per_s if row.bus_gb_per_s > 0 else nominal_gb_per_s * row.efficiency
        if gb_per_s <= 0:
            raise ConfigError(f"no bandwidth for link class {link_class.value}: the topology gives none and the "
                              "calibration table has no bus_gb_per_s", where=f"calibration {link_class.value}",
                              fix="give the row a measured bus_gb_per_s")
        return Hop(link_class, row.alpha_us * 1e-6, gb_per_s * 1e9)

    # ---- single collectives -----------------------------------------------------------------------
    @staticmethod
    def ring_allreduce(nbytes: float, ranks: int, hop: Hop) -> tuple[float, float]:
        """(seconds, latency part) of a ring all-reduce."""
        if ranks <= 1:
            return 0.0, 0.0
        latency = 2 * (ranks - 1) * hop.alpha_s
        return latency + 2 * (ranks - 1) / ranks * nbytes / hop.bytes_per_s, latency

    @staticmethod
    def tree_allreduce(nbytes: float, ranks: int, hop: Hop) -> tuple[float, float]:
        if ranks <= 1:
            return 0.0, 0.0
        latency = 2 * math.ceil(math.log2(ranks)) * hop.alpha_s
        return latency + 2 * nbytes / hop.bytes_per_s, latency

    @staticmethod
    def reduce_scatter(nbytes: float, ranks: int, hop: Hop) -> tuple[float, float]:
        """Also the cost of an all-gather of the same total size."""
        if ranks <= 1:
            return 0.0, 0.0
        latency = (ranks - 1) * hop.alpha_s
        return latency + (ranks - 1) / ranks * nbytes / hop.bytes_per_s, latency

    all_gather = reduce_scatter

    def flat_allreduce(self, nbytes: float, ranks: int, hop: Hop) -> tuple[AllReduce, float, float]:
        """The faster of ring and tree, as NCCL's tuner picks."""
        ring = self.ring_allreduce(nbytes, ranks, hop)
        tree = self.tree_allreduce(nbytes, ranks, hop)
        return (AllReduce.RING, *ring) if ring[0] <= tree[0] else (AllReduce.TREE, *tree)

    def hierarchical_allreduce(self, nbytes: float, island_size: int, islands: int, intra: Hop,
                               inter: Hop) -> tuple[float, float]:
        """Reduce-scatter in each island of `island_size`, all-reduce of 1/island_size shards across
        `islands` islands (the island_size parallel reductions share the inter hop), all-gather."""
        shard = nbytes / island_size
        shared = replace(inter, bytes_per_s=inter.bytes_per_s / island_size)
        scatter = self.reduce_scatter(nbytes, island_size, intra)
        _, across, across_latency = self.flat_allreduce(shard, islands, shared)
        return 2 * scatter[0] + across, 2 * scatter[1] + across_latency

    # ---- the gradient reduction of a step -------------------------------------------------------
    def gradient_reduction(self, gradient_bytes: float, ranks: int, world_hop: Hop, *, island_size: int = 0,
                           islands: int = 0, intra: Hop | None = None, inter: Hop | None = None) -> Reduction:
        """The fastest way to all-reduce `gradient_bytes` over `ranks`: flat ring/tree over the
        slowest hop, or hierarchical when every island has `island_size` ranks."""
        if ranks <= 1:
            return Reduction(AllReduce.NONE, 0.0, 0.0)
        options = [self.flat_allreduce(gradient_bytes, ranks, world_hop)]
        if island_size > 1 and islands > 1 and intra is not None and inter is not None:
            options.append((AllReduce.HIERARCHICAL,
                            *self.hierarchical_allreduce(gradient_bytes, island_size, islands, intra, inter)))
        algorithm, seconds, latency = min(options, key=lambda option: option[1])
        return Reduction(algorithm, seconds - latency, latency)


def bucketing(reduction: Reduction, gradient_bytes: float, *, last_ready_bytes: float, overlap_s: float,
              bucket_bytes: int | None = None) -> Bucketing:
    """Buckets for a reduction that overlaps a backward pass of `overlap_s` seconds.

    Buckets reduce while backward still runs, but the gradients that are ready last
    (`last_ready_bytes`: GPT's tied embedding, complete only when backward ends) and the last
    bucket can only start after it. More buckets hide more behind backward and pay the latency
    more often: the bucket count that minimises what the step waits for wins (powers of two,
    buckets of 1 MiB to 1 GiB). A given `bucket_bytes` (DDP's default) is costed as is."""
    if reduction.algorithm == AllReduce.NONE or gradient_bytes <= 0:
        return Bucketing(int(bucket_bytes or gradient_bytes), 1, 0.0, 0.0)

    def cost(buckets: int) -> Bucketing:
        size = gradient_bytes / buckets
        total = reduction.seconds(buckets)
        last_share = min(1.0, max(size, last_ready_bytes) / gradient_bytes)
        last = reduction.latency_s + reduction.bandwidth_seconds * last_share
        exposed = last + max(0.0, total - last - overlap_s)
        return Bucketing(int(math.ceil(size)), buckets, total, exposed)

    if bucket_bytes is not None:
        return cost(max(1, math.ceil(gradient_bytes / bucket_bytes)))
    most = max(1, int(gradient_bytes // 2**20))
    counts = [2**k for k in range(most.bit_length()) if gradient_bytes / 2**k <= 2**30] or [most]
    return min((cost(n) for n in counts), key=lambda b: (round(b.exposed_seconds, 9), b.buckets))


def parse_calibration(data: object, *, where: str) -> dict[LinkClass, LinkCalibration]:
    if not isinstance(data, dict):
        raise ConfigError("a calibration table is a JSON object of link classes", where=where,
                          fix=f"keys are {', '.join(c.value for c in LinkClass)}")
    table = {}
    for key, row in data.items():
        if key not in LinkClass.__members__.values():
            raise ConfigError(f"unknown link class {key!r}", where=where,
                              fix=f"use one of {', '.join(c.value for c in LinkClass)}")
        if (not isinstance(row, dict) or set(row) - {"alpha_us", "efficiency", "bus_gb_per_s", "ddp_compute_slowdown"}
                or "alpha_us" not in row):
            raise ConfigError(f"row {key!r} must be an object with alpha_us and efficiency or bus_gb_per_s "
                              "(and optionally ddp_compute_slowdown)",
                              where=where, fix='e.g. {"alpha_us": 8.5, "bus_gb_per_s": 47.1}')
        for name, value in row.items():
            # `type in`: true is not a number here, and neither is the string "1.5".
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ConfigError(f"row {key!r}: {name} is {value!r:.40}, not a number",
                                  where=f"{where}: {key}.{name}", fix="write a JSON number: no quotes, not true or null")
            if value < 0:
                raise ConfigError(f"row {key!r} has a negative number", where=f"{where}: {key}.{name}",
                                  fix="times, bandwidths and shares are ≥ 0")
            if name == "ddp_compute_slowdown" and value > 1:
                raise ConfigError(f"row {key!r}: ddp_compute_slowdown {value} would more than double the compute",
                                  where=f"{where}: {key}.{name}", fix="write it as a share: 0.08 for 8 %")
        link = LinkClass(key)
        values = {"ddp_compute_slowdown": DEFAULT_CALIBRATION[link].ddp_compute_slowdown,
                  **{name: float(value) for name, value in row.items()}}
        table[link] = LinkCalibration(**values)
    return table
