"""What a training step costs: collective times (alpha–beta), compute time, and dollars.

    collectives = CollectiveCostModel()                        # or CollectiveCostModel.load("nccl-tests.json")
    hop = collectives.hop(LinkClass.INFINIBAND, nominal_gb_per_s=50)
    seconds, latency = collectives.ring_allreduce(2**30, ranks=16, hop=hop)
    collectives.gradient_reduction(2**30, ranks=16, world_hop=hop).seconds()     # the fastest algorithm
    ComputeModel().gpu_samples_per_second(peak_tflops=989.4, flops_per_sample=6e12, n_embd=768)
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
H100 ~370–480 GB/s of 450 nominal, 400G InfiniBand ~46–48 of 50 GB/s); `CollectiveCostModel.load`
reads a measured table in their place.
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from orchestrator.atomic import read_text
from orchestrator.errors import ConfigError
from orchestrator.placement.plan import AllReduce
from orchestrator.topology import catalog


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

    @classmethod
    def load(cls, path: str | Path) -> CollectiveCostModel:
        """A measured table, {"infiniband": {"alpha_us": 8.5, "bus_gb_per_s": 47.1}, …}; rows left out
        keep the defaults."""
        fix = 'write JSON like {"infiniband": {"alpha_us": 8.5, "bus_gb_per_s": 47.1}}'
        text = read_text(path, error=ConfigError, fix=fix)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"cannot read the calibration table ({e})", where=str(path), fix=fix) from None
        return cls(parse_calibration(data, where=str(path)))

    @classmethod
    def for_job(cls, config) -> CollectiveCostModel:
        """The defaults, with the rows of `[placement] calibration_file` when the job names one."""
        path = config.placement.calibration_file
        return cls.load(path) if path else cls()

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


# ---- compute ------------------------------------------------------------------------------------
MFU_ANCHORS = ((768, 0.34), (2048, 0.53))
"""(n_embd, model FLOPs utilisation) measured in eager bf16 on one H200 (shared/bench, DESIGN.md):
GPT-2 124M at B=32, T=1024 and GPT 1.3B at B=8, T=2048. Wider models keep tensor cores busier."""
COMPILED_MFU_ANCHORS = ((768, 0.483), (2048, 0.584))
"""The same for the compiled engine (fused loss, clipping): benchmarks/step.py on one H200,
benchmarks/RESULTS.md, 2026-11-30 (plain torch.compile: 0.478 / 0.596)."""
BF16_WEIGHTS_MFU_ANCHORS = ((768, 0.511), (2048, 0.609))
"""The compiled engine with [train] bf16_weights (a bf16 copy, fp32 masters), same benchmark and day
(0.499 / 0.594), times what the one-pass AdamW (kernels.adamw) gained over that path in one later run
(1.024× / 1.025×; that call measured 0.522 / 0.621 with the GPU running faster, plain compile 0.486 / 0.609)."""


@dataclass(frozen=True, slots=True)
class HookComputeRate:
    """What a compressing comm hook's own kernels cost per gradient element per step."""

    gpu_bytes_per_element: float
    """Effective bytes of device memory traffic: seconds = elements × this / the GPU's memory bandwidth."""
    cpu_core_ns_per_element: float
    """Core-nanoseconds on CPU workers (the torch twins), divided among a worker's cores."""


HOOK_COMPUTE = {
    "bf16": HookComputeRate(gpu_bytes_per_element=35.6, cpu_core_ns_per_element=3.9),
    "topk": HookComputeRate(gpu_bytes_per_element=60.3, cpu_core_ns_per_element=88.0),
}
"""Fitted to one-rank runs of GPT-2 124M's 124.4 M gradient elements (benchmarks/multigpu.py --only
hooks, 2026-11-30): on an H200 (4.8 TB/s), bf16 0.92 ms and topk at 1 % 1.56 ms a step (earlier calls
0.77–1.28 and 1.06–1.77 ms: read these to within about 1.5×; those runs summed one payload); on this
project's 2-core CPU machine, 25 M elements: bf16 49 ms, topk (compress + decompress_sum of 2
payloads) 1.0–1.1 s."""

ELIAS_FANO_LAUNCH_SECONDS_PER_ELEMENT = 5.9e-12
"""The topk hook's Elias–Fano wire (kernels.wire) on top of HOOK_COMPUTE["topk"], on a GPU, at DDP's
25 MB buckets: benchmarks/kernels.py on an H200, 6.25 M elements at k = 1 %, encode 10.3 µs and
decode of 8 rows 26.8 µs (37.1 µs a bucket). Mostly launches and small kernels, so not scaled by
memory bandwidth; measured on an H200 only. Per element it falls with the bucket (68 µs at 100 MB,
491 µs at 1 GB), so larger buckets cost less than this. Two H200s training GPT-2 124M measured
0.4 ms a step more than the payload sent as it is (one call; single steps read to about 1 ms),
where this costs 0.74 ms."""
ELIAS_FANO_DECODE_TRAFFIC = 7
"""Bytes a GPU's decode moves per byte of each rank's wire at k = 1 %: the unary part read twice
and the low bits once (about 0.6 of the wire), the payload zeroed and written (2.4), its codes and
scales copied (1.1), and the entries' places filled and written as int32 (3.3)."""
ELIAS_FANO_CPU_CORE_NS_PER_ELEMENT = 1.0
"""The torch twins on CPU workers, per gradient element: to encode once, and to decode each rank's
wire (on this project's 2-core machine, 6.25 M elements at k = 1 %: encode 3.2 ms, 8 rows 25.5 ms)."""

POWERSGD_HOST_SECONDS_PER_MATRIX = 3.1e-4
"""torch's PowerSGD hook steps each compressed matrix from Python (orthogonalisation column by
column), so its cost follows the matrices, not the bytes: 15.4 ms a step for GPT-2 124M's 50 on an
H200 host (28.6 ms in an earlier call on another host)."""


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Per-device step time: FLOPs / (peak × utilisation) + a fixed cost per micro-step.

    Utilisation is interpolated in log(n_embd) between measured anchors and held flat outside
    them; the same share of peak is assumed for every GPU (its own peak: MIG slices and slower
    models are slower in proportion). CPU workers use a nominal peak per core."""

    mfu_anchors: tuple[tuple[int, float], ...] = MFU_ANCHORS
    micro_step_overhead_s_per_layer: float = 1e-4
    """Launch and Python overhead per transformer block per micro-step (eager: ~20 kernels × 5 µs)."""
    cpu_gflops_per_core: float = 100.0
    """fp32 peak of one core (2 AVX2/AVX-512 FMA units at ~3 GHz)."""
    cpu_utilisation: float = 0.25
    """Share of that peak a small transformer reaches in torch on CPU (the CPU demo measures ~27 GFLOP/s a core)."""
    cpu_bf16_utilisation: float = 0.0315
    """The same in bf16: the CPU demo's model trained at 1,078 tok/s in bf16 against 8,557 predicted at
    the fp32 share on a 2-core AMD EPYC without bf16 units (no AVX512-BF16 or AMX), so torch emulates
    it. CPUs with AMX would be faster; the run's measured step time, not this, is what the bill uses."""
    cpu_overhead_s_per_layer: float = 5e-4

    @classmethod
    def compiled(cls, *, bf16_weights: bool = False) -> ComputeModel:
        anchors = BF16_WEIGHTS_MFU_ANCHORS if bf16_weights else COMPILED_MFU_ANCHORS
        return cls(mfu_anchors=anchors, micro_step_overhead_s_per_layer=2e-5)

    def utilisation(self, n_embd: int) -> float:
        return _interpolate_log(self.mfu_anchors, n_embd)

    def gpu_samples_per_second(self, peak_tflops: float, flops_per_sample: float, n_embd: int) -> float:
        return peak_tflops * 1e12 * self.utilisation(n_embd) / flops_per_sample

    def cpu_samples_per_second(self, cores: int, flops_per_sample: float, dtype: str = "fp32") -> float:
        """dtype: the job's compute dtype, fp32 or bf16."""
        utilisation = self.cpu_bf16_utilisation if dtype == "bf16" else self.cpu_utilisation
        return cores * self.cpu_gflops_per_core * 1e9 * utilisation / flops_per_sample

    def overhead_s(self, n_layer: int, *, cpu: bool) -> float:
        return n_layer * (self.cpu_overhead_s_per_layer if cpu else self.micro_step_overhead_s_per_layer)


@functools.lru_cache(maxsize=64)
def _interpolate_log(anchors: tuple[tuple[int, float], ...], x: int) -> float:
    """Linear in log(x) between sorted anchors, flat outside them."""
    anchors = tuple(sorted(anchors))
    if x <= anchors[0][0]:
        return anchors[0][1]
    for (x0, y0), (x1, y1) in zip(anchors, anchors[1:]):
        if x <= x1:
            return y0 + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (y1 - y0)
    return anchors[-1][1]


# ---- prices -------------------------------------------------------------------------------------
DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    "H200-SXM5-141GB": (3.50, 2.00),
    "H200-NVL-141GB": (3.30, 1.85),
    "H100-SXM5-80GB": (2.99, 1.60),
    "H100-NVL-94GB": (2.80, 1.50),
    "H100-PCIE-80GB": (2.49, 1.30),
    "A100-SXM4-80GB": (1.79, 0.90),
    "A100-SXM4-40GB": (1.29, 0.70),
    "A100-PCIE-80GB": (1.59, 0.80),
    "A100-PCIE-40GB": (1.19, 0.60),
    "MI300X": (2.49, 1.30),
    "L40S": (1.09, 0.55),
    "A10G": (1.01, 0.40),
    "L4": (0.80, 0.35),
    "V100-SXM2-32GB": (0.95, 0.40),
    "V100-SXM2-16GB": (0.85, 0.35),
    "V100-PCIE-32GB": (0.85, 0.35),
    "V100-PCIE-16GB": (0.75, 0.30),
    "cpu": (0.05, 0.02),
}
"""(on-demand, spot) dollars per device-hour ("cpu": per core-hour), typical of GPU clouds in 2026;
override rows with a `[bill] prices_file` and single prices with `[placement] prices`. A MIG slice
costs its share of the GPU's SMs."""
PRICE_COLUMNS = ("on_demand", "spot")
_PRICE_FILE_FIX = 'write one row per device, e.g. "H100-SXM5-80GB" = { on_demand = 2.49, spot = 1.25 }'


@dataclass(frozen=True, slots=True)
class PriceTable:
    prices: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRICES))

    @classmethod
    def for_job(cls, config) -> PriceTable:
        """The table a job's dollars come from: the defaults, the rows of `[bill] prices_file`, then
        `[placement] prices` for the column in use."""
        table = cls()
        if config.bill.prices_file:
            table = table.with_rows(load_price_rows(config.bill.prices_file))
        return table.with_overrides(config.placement.prices, spot=config.placement.pricing == "spot")

    def with_rows(self, rows: dict[str, dict[str, float]]) -> PriceTable:
        """Rows {model: {"on_demand": …, "spot": …}} replace the columns they give; a model the table
        lacks takes the one column it is given for both."""
        prices = dict(self.prices)
        for model, row in rows.items():
            given = row.get("on_demand", row.get("spot"))
            on_demand, spot = prices.get(model, (given, given))
            prices[model] = (row.get("on_demand", on_demand), row.get("spot", spot))
        return PriceTable(prices)

    def with_overrides(self, overrides: dict[str, float], *, spot: bool) -> PriceTable:
        """`overrides` replace the column in use (spot or on-demand) for the models they name."""
        prices = dict(self.prices)
        for model, price in overrides.items():
            on_demand, spot_price = prices.get(model, (price, price))
            prices[model] = (on_demand, price) if spot else (price, spot_price)
        return PriceTable(prices)

    def dollars_per_hour(self, model: str, *, spot: bool) -> float | None:
        """Per device (per core for "cpu"); None for a model the table lacks."""
        row = self.prices.get(model)
        return None if row is None else row[1 if spot else 0]

    def dollars_per_bf16_tflops_hour(self, model: str, *, spot: bool) -> float | None:
        """The price of one TFLOP/s of dense bf16 peak for an hour: the unit that compares devices of
        any size and vendor (an H100 SXM at $2.99 is $0.0030; None without a price or a bf16 peak)."""
        price, peak = self.dollars_per_hour(model, spot=spot), catalog.device_peak_tflops(model, "bf16")
        return price / peak if price is not None and peak else None


def load_price_rows(path: str | Path) -> dict[str, dict[str, float]]:
    """A price file (TOML, or JSON when it ends in .json): {model: {"on_demand": $, "spot": $}}."""
    where = f"[bill] prices_file {path}"
    text = read_text(path, error=ConfigError, fix=f"check the path, or {_PRICE_FILE_FIX}")
    try:
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read the price file ({e})", where=where, fix=_PRICE_FILE_FIX) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError("holds no prices", where=where, fix=_PRICE_FILE_FIX)
    rows = {}
    for model, row in data.items():
        if not isinstance(row, dict) or not row or set(row) - set(PRICE_COLUMNS):
            raise ConfigError(f"row {model!r} must be a table of {' and/or '.join(PRICE_COLUMNS)}",
                              where=f"{where}: {model}", fix=_PRICE_FILE_FIX)
        for column, price in row.items():
            if type(price) not in (int, float) or not math.isfinite(price) or price < 0:
                raise ConfigError(f"{price!r:.40} is not a price", where=f"{where}: {model}.{column}",
                                  fix="give dollars per device-hour as a number ≥ 0, e.g. 2.49")
        rows[model] = {column: float(price) for column, price in row.items()}
    return rows
