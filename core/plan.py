"""The placement plan: where every worker runs, how much work it gets, in which groups, and what a step costs.

    plan = Plan.load("runs/job/plan.json")          # or planning.make_plan(topology, config)
    worker = plan.worker(rank)                      # node, device UUID, island, micro-batch, CPU cores
    layout = plan.batch_layout()                    # BatchLayout: the step's samples, per replica
    plan.predicted.step_seconds, plan.predicted.dollars_per_million_tokens

One plain object from the planner to the workers: it prints, saves as JSON and loads back, and it
checks itself on construction (ranks, one shared accumulation count, the global batch, the groups),
so a plan read from a file is as trustworthy as one the planner just made.

Batch layout: every data-parallel replica r trains on `micro_batch_size` samples per micro-step,
`grad_accum_steps` micro-steps per optimizer step, with ONE accumulation count for the whole job
(the sampler's `BatchLayout` has one); heterogeneous devices differ in micro-batch, not in
accumulation. The ranks of one tensor-parallel group are one replica and read the same samples.
"""

from __future__ import annotations

import json
import math
import numbers
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from core import codec, rules
from core.atomic import read_text, write_text_atomically
from core.errors import PlacementError, TopologyError

FORMAT = "archipelago.plan"
VERSION = 5
"""2 added comm_hook; 3 made the plan the workers' one instruction: precision, hook settings, bucket
size, overlap and activation checkpointing resolved; 4 added device_bases; 5 named the device mesh
and each worker's environment. Older plans read with allreduce, defaults and the mesh their groups
imply."""
_WRITE_COMMAND = "archipelago plan --json FILE"


class Objective(StrEnum):
    FASTEST = "fastest"
    """Shortest predicted step."""
    CHEAPEST = "cheapest"
    """Fewest dollars per million training tokens."""
    CHEAPEST_UNDER_DEADLINE = "cheapest_under_deadline"
    """Fewest dollars per million tokens among plans that finish `[train] steps` before the deadline."""
    GOODPUT = "goodput"
    """Most tokens of progress a second: throughput times the statistical efficiency of the global batch."""
    CHEAPEST_TO_TARGET = "cheapest_to_target"
    """Fewest dollars to reach the target: [placement] tokens_to_target, scaled by the batch's efficiency."""


class DataParallel(StrEnum):
    DDP = "ddp"
    """Every replica holds the whole model, gradients and AdamW states; gradients are all-reduced."""
    FSDP = "fsdp"
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer states sharded over the replicas;
    parameters all-gathered per block, gradients reduce-scattered."""
    HSDP = "hsdp"
    """FSDP2 on a 2-D mesh: sharded inside each NVLink island (all-gathers and reduce-scatters on
    its links), replicated across islands (one all-reduce of each island's gradient shard)."""


MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
"""The device mesh's dimension names, outermost first (torch.distributed.init_device_mesh lays ranks
out row-major, so the tensor-parallel ranks are consecutive and each shard group is contiguous)."""


def mesh_of(data_parallel: DataParallel, world_size: int, tensor_parallel_size: int,
            island_size: int = 0) -> tuple[list[str], list[int]]:
    """(dimension names, sizes) of the device mesh a plan runs on: ddp replicates over every
    replica, fsdp shards over them, hsdp shards inside islands of `island_size` ranks and replicates
    across them; "tp" is the innermost dimension when tensor_parallel_size > 1."""
    replicas = world_size // tensor_parallel_size
    if data_parallel == DataParallel.HSDP:
        shard = island_size // tensor_parallel_size
        dims = [("dp_replicate", replicas // shard), ("dp_shard", shard)] if shard else []
    else:
        dims = [("dp_replicate" if data_parallel == DataParallel.DDP else "dp_shard", replicas)]
    dims += [("tp", tensor_parallel_size)] if tensor_parallel_size > 1 else []
    return [name for name, _ in dims], [size for _, size in dims]


class AllReduce(StrEnum):
    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"
    """Reduce-scatter inside each island, all-reduce of the shards across islands, all-gather inside
    each island: the inter-node links carry 1/island-size of the gradient per rank."""
    ALL_GATHER = "all_gather"
    """The topk comm hook: every rank's compressed gradients all-gathered, and summed by each rank."""
    NONE = "none"
    """One replica: nothing to reduce."""




class DeviceKind(StrEnum):
    GPU = "gpu"
    MIG = "mig"
    CPU = "cpu"


@dataclass(kw_only=True, slots=True)
class WorkerPlacement:
    rank: int
    """Global rank, 0 … world_size − 1; the Ray Train world rank of the worker that takes this place."""
    node_id: str
    """The topology's node id (hostname); `ray_node_id` is Ray's id for the same node when known."""
    device_uuid: str | None
    """`GPU-…` or `MIG-…` to bind with CUDA_VISIBLE_DEVICES; None for a CPU worker."""
    device_kind: DeviceKind
    device_model: str
    """Catalog key (H100-SXM5-80GB), with the MIG profile for a slice ("H100-SXM5-80GB 1g.10gb"), or "cpu"."""
    island_id: str | None
    """NVLink island of the GPU; None for MIG slices and CPU workers."""
    micro_batch_size: int
    """Samples per micro-step (the same for every rank of one tensor-parallel group)."""
    grad_accum_steps: int
    """Micro-steps per optimizer step; the same for every worker."""
    data_parallel_rank: int = 0
    """Which replica this worker belongs to: its index into `Plan.batch_layout()`."""
    tensor_parallel_rank: int = 0
    cpus: int = 1
    """CPU cores reserved for the worker (Ray's CPU resource; torch threads on CPU workers)."""
    cpu_affinity: str = ""
    """NUMA-local cores to pin the worker to, as a kernel CPU list ("0-55,112-167"); "" leaves it unpinned."""
    numa_node: int | None = None
    ray_node_id: str = ""
    predicted_compute_seconds: float = 0.0
    """This worker's compute per optimizer step: all its micro-steps and the optimizer's step, its own
    kernels alone. The plan's predicted compute adds what is step-wide (the comm hook's own work, and kernels
    running slower beside DDP's collectives over NVLink), so it can exceed every worker's figure."""
    predicted_peak_memory_bytes: int = 0
    memory_capacity_bytes: int = 0
    """What the device (or, for CPU workers, the node) has; 0 when unknown."""
    gpu_index: int | None = None
    """NVML index of the GPU on its node, for messages (Ray's GPU ids count the same way)."""
    island_resource: str = ""
    """The Ray custom resource of the worker's NVLink island (`nvlink_island_<id>`, what
    `archipelago node-resources` advertises) that the worker reserves one unit of; "" outside islands."""
    environment: dict[str, str] = field(default_factory=dict)
    """Variables set in the worker's process before its process group starts: NCCL_IB_HCA and
    NCCL_SOCKET_IFNAME naming the NICs nearest its GPU ([placement] nccl_nics)."""


@dataclass(kw_only=True, slots=True)
class Prediction:
    step_seconds: float
    """compute_seconds + exposed_communication_seconds."""
    compute_seconds: float
    """The slowest worker's forward, backward and optimizer time per step."""
    exposed_communication_seconds: float
    """Collective time not hidden behind the backward pass."""
    communication_seconds: float
    """All collective time per step, hidden or not."""
    tokens_per_second: float
    dollars_per_hour: float
    """Price of every device the plan uses, per hour."""
    dollars_per_step: float
    dollars_per_million_tokens: float
    job_hours: float
    """`[train] steps` × step_seconds."""
    job_dollars: float
    statistical_efficiency: float = 1.0
    """Pollux's E(B) of the global batch against [train] global_batch_size at the noise scale the plan
    was made with (core/adaptive_batch.py); 1 without one."""
    goodput_tokens_per_second: float = 0.0
    """tokens_per_second × statistical_efficiency: progress a second, in tokens at [train] global_batch_size."""
    dollars_to_target: float = 0.0
    """Dollars to train [placement] tokens_to_target's worth of progress at this batch; 0 without a target."""


@dataclass(kw_only=True, slots=True)
class DeviceBasis:
    """What the planner took one device model of the plan to do: where its figures came from, and the
    calibration's factor on its compute (`archipelago calibrate` reads these back)."""

    device_model: str
    """As the workers' WorkerPlacement.device_model names it."""
    model: str
    """The key prices and calibrations use for it: the catalog key, the GPU's name, or "cpu" (a MIG
    slice's is its GPU's)."""
    source: str
    """declared ([devices] in the job), measured (the probe's micro-benchmark), catalog (the data sheet),
    or nominal (CPU workers without a measurement)."""
    tflops: float
    """The figure as its source gives it, at the plan's compute dtype, per device (a CPU worker: its
    cores together): a measured product rate, or a declared, catalog or nominal peak."""
    compute_efficiency: float = 1.0
    """How much faster than the cost model's own figures this model's compute was predicted to run: the
    calibration's factor (1 without one)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class HookSettings:
    """The comm hook's own settings, as [parallel] gives them (workers/comm/hooks.py)."""

    warmup_steps: int = 10
    """Plain all-reduce steps before powersgd or topk start compressing."""
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    topk_ramp_steps: int = 0
    topk_wire: str = "elias_fano"


@dataclass(kw_only=True, slots=True)
class Plan:
    job_name: str
    objective: Objective
    workers: list[WorkerPlacement]
    global_batch_size: int
    """Samples per optimizer step, exactly as the job asked."""
    seq_len: int
    grad_accum_steps: int
    data_parallel: DataParallel
    tensor_parallel_size: int = 1
    allreduce: AllReduce = AllReduce.NONE
    """How the gradient reduction is predicted to run (and what the process groups are for)."""
    intra_island_groups: list[list[int]] = field(default_factory=list)
    """Ranks that share a fast domain: an NVLink island, or the PCIe/host domain of one node for GPUs
    without NVLink peers, MIG slices and CPU workers. Every rank is in exactly one."""
    inter_island_groups: list[list[int]] = field(default_factory=list)
    """The k-th rank of every intra-island group, for each k: the groups that cross islands in a
    hierarchical all-reduce. Empty when the intra-island groups differ in size."""
    tensor_parallel_groups: list[list[int]] = field(default_factory=list)
    """Consecutive ranks inside one NVLink island; one group per rank when tensor_parallel_size is 1."""
    data_parallel_groups: list[list[int]] = field(default_factory=list)
    """Ranks with the same tensor-parallel rank: they reduce gradients together."""
    mesh_dim_names: list[str] = field(default_factory=list)
    """The workers' DeviceMesh, outermost dimension first: some of MESH_DIMS (mesh_of); made from
    the strategy, the tensor-parallel size and the islands when a plan is built without one."""
    mesh_shape: list[int] = field(default_factory=list)
    """Each mesh dimension's size; their product is the world size."""
    ddp_bucket_bytes: dict[str, int] = field(default_factory=dict)
    """Gradient bucket size per link class the reduction crosses (nvswitch, pcie, infiniband, …)."""
    bottleneck_link_class: str = ""
    """The slowest link class of the flat all-reduce: the bucket size a single DDP group uses."""
    bottleneck_gb_per_s: float = 0.0
    bottleneck_alpha_us: float = 0.0
    """The bandwidth and latency that slowest hop was costed at (its calibration row's), for
    `archipelago calibrate` to fit the link from what the run then waited; 0 without a reduction."""
    comm_hook: str = "allreduce"
    """The DDP comm hook the workers run (core.rules.COMM_HOOKS): [parallel] comm_hook, or what the
    planner picked for "auto"."""
    hook_settings: HookSettings = field(default_factory=HookSettings)
    bucket_cap_mb: float = 25.0
    """DDP's gradient bucket size: the planner's for the bottleneck link, else [parallel] bucket_mb."""
    backend: str = "nccl"
    """Process-group backend for the gradient reduction: [parallel] backend, or for "auto" gloo for CPU
    workers and for plans with several MIG slices of one GPU (NCCL runs one rank per GPU), nccl otherwise."""
    precision: str = "fp32"
    """What the workers train in (core.rules.PRECISIONS): [train] precision, "auto" resolved for the devices."""
    activation_checkpointing: str = "off"
    """off, selective or full: block activations recomputed in backward ([parallel] activation_checkpointing)."""
    overlap: str = "off"
    """"next_forward" when the reduction runs on into the next forward ([parallel] overlap, with
    several replicas); "off" otherwise."""
    overlap_backward_share: float = 1.0
    """Under the next-forward overlap, the share of a step's gradient bytes sent while backward runs:
    [parallel] overlap_backward_share, or for 0 the predicted backward time over the predicted
    communication time, at most 1."""
    price_basis: str = "on_demand"
    """"on_demand" or "spot": which column of the price table the dollars come from."""
    predicted: Prediction
    notes: list[str] = field(default_factory=list)
    """Why the planner chose what it did, in words (shown under the table)."""
    device_bases: list[DeviceBasis] = field(default_factory=list)
    """One per device model the workers run on; empty for plans made without the planner."""

    def __post_init__(self) -> None:
        if not self.mesh_dim_names:
            island = len(self.intra_island_groups[0]) if self.intra_island_groups else self.world_size
            self.mesh_dim_names, self.mesh_shape = mesh_of(self.data_parallel, self.world_size,
                                                           self.tensor_parallel_size, island)
        _check_choices(self)
        _check_workers(self)
        _check_batch(self)
        _check_groups(self)
        _check_mesh(self)

    @classmethod
    def uniform(cls, *, job_name: str, world_size: int, micro_batch_size: int, grad_accum_steps: int,
                seq_len: int, intra_island_groups: list[list[int]] | None = None, data_parallel: str = "ddp",
                tensor_parallel_size: int = 1, **choices) -> Plan:
        """A plan of identical workers with equal micro-batches and no predictions: what benchmarks and
        tests hand the worker engine when they run it without the planner (planning.
        uniform_spec resolves `choices` from a config the planner's way). The caller binds the
        devices, so the entries name none (device_model "unplanned")."""
        t = tensor_parallel_size
        workers = [WorkerPlacement(rank=r, node_id="local", device_uuid=None, device_kind=DeviceKind.CPU,
                                   device_model="unplanned", island_id=None, micro_batch_size=micro_batch_size,
                                   grad_accum_steps=grad_accum_steps, data_parallel_rank=r // t,
                                   tensor_parallel_rank=r % t) for r in range(world_size)]
        unknown = Prediction(step_seconds=0.0, compute_seconds=0.0, exposed_communication_seconds=0.0,
                             communication_seconds=0.0, tokens_per_second=0.0, dollars_per_hour=0.0,
                             dollars_per_step=0.0, dollars_per_million_tokens=0.0, job_hours=0.0, job_dollars=0.0)
        ranks = list(range(world_size))
        intra = intra_island_groups or [ranks]
        return cls(job_name=job_name, objective=Objective.FASTEST, workers=workers,
                   global_batch_size=world_size // t * micro_batch_size * grad_accum_steps, seq_len=seq_len,
                   grad_accum_steps=grad_accum_steps, data_parallel=DataParallel(data_parallel),
                   tensor_parallel_size=t, intra_island_groups=intra, inter_island_groups=cross_island_groups(intra),
                   tensor_parallel_groups=[ranks[r:r + t] for r in range(0, world_size, t)],
                   data_parallel_groups=[ranks[j::t] for j in range(t)], predicted=unknown, **choices)

    # ---- what the workers read --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def uses_gpus(self) -> bool:
        return any(worker.device_kind != DeviceKind.CPU for worker in self.workers)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def worker(self, rank: int) -> WorkerPlacement:
        if not 0 <= rank < len(self.workers):
            raise PlacementError(f"rank {rank} is not in this plan of {len(self.workers)} workers",
                                 where="plan", fix="start as many workers as the plan has (Plan.world_size)")
        return self.workers[rank]

    def replica_micro_batch_sizes(self) -> tuple[int, ...]:
        """Micro-batch of each data-parallel replica, in data_parallel_rank order."""
        sizes: dict[int, int] = {}
        for worker in self.workers:
            sizes.setdefault(worker.data_parallel_rank, worker.micro_batch_size)
        return tuple(sizes[r] for r in range(len(sizes)))

    def batch_layout(self):
        """The sampler's layout; a worker reads `rank_micro_batches(consumed, layout, worker.data_parallel_rank)`."""
        return BatchLayout(self.replica_micro_batch_sizes(), self.grad_accum_steps)

    def with_global_batch(self, batch: int) -> Plan:
        """This plan re-split for a global batch of `batch` samples (an adaptive batch's change): the
        same workers and groups, each replica's micro-batch at most what this plan gives it (what
        fits its memory), one accumulation count (`split_batch`). Re-split from the planned plan, never
        from a re-split one, whose micro-batches may be smaller than memory allows."""
        split = split_batch(batch, self.replica_micro_batch_sizes())
        if split is None:
            raise PlacementError(f"{batch} samples cannot be split over {len(self.replica_micro_batch_sizes())} "
                                 f"replicas of at most {self.replica_micro_batch_sizes()} samples a micro-step",
                                 where="plan", fix="pick the batch among adaptive_batch.batch_choices(…)")
        sizes, accum = split
        workers = [replace(w, micro_batch_size=sizes[w.data_parallel_rank], grad_accum_steps=accum)
                   for w in self.workers]
        return replace(self, workers=workers, global_batch_size=batch, grad_accum_steps=accum)

    def reordered(self, plan_ranks: list[int]) -> Plan:
        """The same plan renumbered so that rank i is the worker that had rank plan_ranks[i]: Ray Train
        numbers its workers itself, and each worker claims its plan entry by node and local rank
        (binding.claim); gather the claimed ranks in world-rank order and renumber with them."""
        if sorted(plan_ranks) != list(range(self.world_size)):
            raise PlacementError(f"claimed plan ranks {sorted(plan_ranks)[:8]}… are not each of 0 … "
                                 f"{self.world_size - 1} once", where="plan",
                                 fix="every worker claims a different plan entry; start the plan's workers")
        new = {old: rank for rank, old in enumerate(plan_ranks)}

        def renumber(groups: list[list[int]]) -> list[list[int]]:
            return [[new[rank] for rank in group] for group in groups]
        return replace(self, workers=[replace(self.workers[old], rank=rank) for rank, old in enumerate(plan_ranks)],
                       intra_island_groups=renumber(self.intra_island_groups),
                       inter_island_groups=renumber(self.inter_island_groups),
                       tensor_parallel_groups=renumber(self.tensor_parallel_groups),
                       data_parallel_groups=renumber(self.data_parallel_groups))

    # ---- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: object, *, where: str = "plan") -> Plan:
        if isinstance(data, dict) and data.get("version") in (1, 2, 3, 4):  # the fields added since take their defaults
            data = {**data, "version": VERSION, "comm_hook": data.get("comm_hook") or "allreduce"}
        fields = codec.check_header(data, format=FORMAT, version=VERSION, noun="plan", command=_WRITE_COMMAND,
                                    error=PlacementError, where=where)
        try:
            return codec.decode(cls, fields, where)
        except TopologyError as e:  # the shared strict decoder speaks of topologies; say plan
            raise PlacementError(e.what, where=e.where, fix=f"plan again with `{_WRITE_COMMAND}`") from None

    @classmethod
    def from_json(cls, text: str, *, where: str = "plan") -> Plan:
        data = codec.parse_json(text, error=PlacementError, where=where, fix=f"write it with `{_WRITE_COMMAND}`")
        return cls.from_dict(data, where=where)

    def save(self, path: str | Path) -> Path:
        return write_text_atomically(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        text = read_text(path, error=PlacementError, fix=f"write one with `{_WRITE_COMMAND}`")
        return cls.from_json(text, where=str(path))


def split_batch(batch: int, max_micro: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    """Micro-batch per replica and one accumulation count that make `batch` samples, each replica's
    micro-batch between 1 and its `max_micro`: the fewest accumulation steps (the least time), the
    micro-batches in proportion to the maxima (faster devices take more). None when nothing splits it."""
    replicas, room = len(max_micro), sum(max_micro)
    for accum in range(max(1, -(-batch // room)), batch // replicas + 1):
        if batch % accum:
            continue
        per_pass = batch // accum
        sizes = [max(1, per_pass * m // room) for m in max_micro]
        for r in sorted(range(replicas), key=lambda r: -max_micro[r]):  # hand out what rounding left
            while sum(sizes) < per_pass and sizes[r] < max_micro[r]:
                sizes[r] += 1
        while sum(sizes) > per_pass:  # the floor of 1 overshot: take back from the largest
            sizes[sizes.index(max(sizes))] -= 1
        if sum(sizes) == per_pass and all(1 <= s <= m for s, m in zip(sizes, max_micro)):
            return tuple(sizes), accum
    return None


def cross_island_groups(intra_island_groups: list[list[int]]) -> list[list[int]]:
    """The k-th rank of every island, for each k; [] when the islands differ in size (no hierarchical
    all-reduce then)."""
    if len({len(group) for group in intra_island_groups}) != 1:
        return []
    return [[group[k] for group in intra_island_groups] for k in range(len(intra_island_groups[0]))]


def _invalid(what: str, where: str, fix: str = "plan again; a plan file is not meant to be edited by hand") -> None:
    raise PlacementError(what, where=f"plan: {where}", fix=fix)


def _check_choices(plan: Plan) -> None:
    """The resolved choices name things the workers know, and go together (core/rules.py)."""
    for name, allowed in (("comm_hook", rules.COMM_HOOKS), ("precision", rules.PRECISIONS),
                          ("backend", ("gloo", "nccl")), ("activation_checkpointing", ("off", "selective", "full")),
                          ("overlap", ("off", "next_forward"))):
        if getattr(plan, name) not in allowed:
            _invalid(f"{name} {getattr(plan, name)!r} is not one of {', '.join(map(repr, allowed))}", name)
    if plan.bucket_cap_mb <= 0 or not 0 < plan.overlap_backward_share <= 1:
        _invalid(f"bucket_cap_mb {plan.bucket_cap_mb}, overlap_backward_share {plan.overlap_backward_share}",
                 "bucket_cap_mb", "buckets hold some bytes, and the share sent during backward is in (0, 1]")
    refusal = rules.comm_hook_refusal(plan.comm_hook, backend=plan.backend, strategy=plan.data_parallel.value)
    if refusal is None and plan.overlap == "next_forward":
        refusal = rules.overlap_refusal(strategy=plan.data_parallel.value, hook=plan.comm_hook,
                                        precision=plan.precision)
    if refusal is None:
        refusal = rules.tensor_parallel_refusal(plan.tensor_parallel_size, hook=plan.comm_hook, overlap=plan.overlap,
                                                precision=plan.precision)
    if refusal is not None:
        raise PlacementError(refusal.what, where=f"plan: {refusal.where}", fix=refusal.fix)


def _check_workers(plan: Plan) -> None:
    if not plan.workers:
        _invalid("has no workers", "workers")
    for i, worker in enumerate(plan.workers):
        if worker.rank != i:
            _invalid(f"workers[{i}] has rank {worker.rank}", f"workers[{i}].rank", "ranks run 0, 1, 2, … in order")
        if (worker.device_uuid is None) != (worker.device_kind == DeviceKind.CPU):
            _invalid(f"a {worker.device_kind.value} worker with device_uuid {worker.device_uuid!r}",
                     f"workers[{i}].device_uuid", "GPU and MIG workers name their device; CPU workers name none")
        if worker.micro_batch_size < 1 or worker.cpus < 1:
            _invalid(f"micro_batch_size {worker.micro_batch_size}, cpus {worker.cpus}", f"workers[{i}]",
                     "every worker trains on at least one sample per micro-step, with at least one core")
    taken = Counter(worker.device_uuid for worker in plan.workers if worker.device_uuid)
    twice = [uuid for uuid, count in taken.items() if count > 1]
    if twice:
        _invalid(f"device {twice[0]} is given to {taken[twice[0]]} workers", "workers",
                 "NCCL runs one rank per device: give every worker its own GPU or MIG slice")


def _check_batch(plan: Plan) -> None:
    accum = {worker.grad_accum_steps for worker in plan.workers}
    if accum != {plan.grad_accum_steps}:
        _invalid(f"grad_accum_steps {sorted(accum)} across workers, plan says {plan.grad_accum_steps}", "workers",
                 "every worker accumulates the same number of micro-steps")
    replicas: dict[int, set[int]] = {}
    for worker in plan.workers:
        replicas.setdefault(worker.data_parallel_rank, set()).add(worker.micro_batch_size)
    if sorted(replicas) != list(range(len(replicas))):
        _invalid(f"data_parallel_rank values {sorted(replicas)}", "workers", "replicas are numbered 0, 1, 2, …")
    split = [r for r, sizes in replicas.items() if len(sizes) > 1]
    if split:
        _invalid(f"replica {split[0]} has micro-batches {sorted(replicas[split[0]])}", "workers",
                 "the ranks of one tensor-parallel group train on the same micro-batch")
    total = sum(next(iter(sizes)) for sizes in replicas.values()) * plan.grad_accum_steps
    if total != plan.global_batch_size:
        _invalid(f"micro-batches × accumulation = {total}, global_batch_size = {plan.global_batch_size}",
                 "workers", "the replicas' micro-batches times grad_accum_steps must add up to the global batch")


def _check_groups(plan: Plan) -> None:
    ranks = set(range(plan.world_size))
    for name in ("intra_island_groups", "tensor_parallel_groups", "data_parallel_groups"):
        groups = getattr(plan, name)
        flat = [rank for group in groups for rank in group]
        if groups and (sorted(flat) != sorted(ranks)):
            _invalid(f"{name} do not hold every rank exactly once", name)
    # The workers build their hierarchical process groups from these: anything but the k-th rank of
    # every island (or none) would name ranks that do not exist or mix ranks of one island.
    if plan.inter_island_groups and plan.inter_island_groups != cross_island_groups(plan.intra_island_groups):
        _invalid(f"inter_island_groups {plan.inter_island_groups[:4]} are not the k-th rank of every "
                 "intra-island group, for each k", "inter_island_groups")
    if plan.tensor_parallel_size < 1 or plan.world_size % plan.tensor_parallel_size:
        _invalid(f"tensor_parallel_size {plan.tensor_parallel_size} does not divide {plan.world_size} workers",
                 "tensor_parallel_size")
    for group in plan.tensor_parallel_groups:
        if len(group) != plan.tensor_parallel_size:
            _invalid(f"tensor-parallel group {group} has {len(group)} ranks, not {plan.tensor_parallel_size}",
                     "tensor_parallel_groups")
        if len({plan.workers[rank].data_parallel_rank for rank in group}) != 1:
            _invalid(f"tensor-parallel group {group} spans several replicas", "tensor_parallel_groups")
        if plan.tensor_parallel_size > 1 and not _one_fast_domain([plan.workers[rank] for rank in group]):
            _invalid(f"tensor-parallel group {group} leaves one NVLink island (or holds a MIG slice)",
                     "tensor_parallel_groups", "tensor-parallel groups stay inside one NVLink island of whole GPUs")


def _one_fast_domain(workers: list[WorkerPlacement]) -> bool:
    """Whether a tensor-parallel group shares links fast enough for a collective per layer: whole
    GPUs of one NVLink island, or CPU workers of one node (shared memory: tests and CPU jobs)."""
    first = workers[0]
    if first.device_kind == DeviceKind.GPU:
        return first.island_id is not None and all(
            w.device_kind == DeviceKind.GPU and w.island_id == first.island_id for w in workers)
    return first.device_kind == DeviceKind.CPU and all(
        w.device_kind == DeviceKind.CPU and w.node_id == first.node_id for w in workers)


def _check_mesh(plan: Plan) -> None:
    """The mesh is one the workers can build from the plan: its names and sizes follow the strategy
    and the tensor-parallel size, and under hsdp each shard group is one island."""
    names, shape, t = plan.mesh_dim_names, plan.mesh_shape, plan.tensor_parallel_size
    if len(names) != len(shape) or math.prod(shape) != plan.world_size or min(shape, default=0) < 1:
        _invalid(f"mesh {names} of shape {shape} does not hold {plan.world_size} workers", "mesh_shape")
    expected = {DataParallel.DDP: ["dp_replicate"], DataParallel.FSDP: ["dp_shard"],
                DataParallel.HSDP: ["dp_replicate", "dp_shard"]}[plan.data_parallel] + (["tp"] if t > 1 else [])
    if names != expected or (t > 1 and shape[-1] != t):
        _invalid(f"mesh {names} of shape {shape} for {plan.data_parallel.value} with tensor_parallel_size {t}",
                 "mesh_dim_names", f"the mesh is {expected}, tensor-parallel innermost")
    if plan.data_parallel == DataParallel.HSDP:
        # A shard group is dp_shard replicas in a row, by plan entry (the mesh places each worker by its
        # replica): consecutive ranks as the planner numbers them, any ranks once Ray renumbered them.
        shard_groups: dict[int, list[int]] = {}
        for worker in plan.workers:
            shard_groups.setdefault(worker.data_parallel_rank // shape[1], []).append(worker.rank)
        if sorted(map(sorted, plan.intra_island_groups)) != sorted(map(sorted, shard_groups.values())):
            _invalid(f"hsdp shards over groups of {shape[1]} replicas ({shape[1] * t} ranks) in a row, but the islands "
                     f"are {plan.intra_island_groups[:4]}", "mesh_shape",
                     "hsdp needs islands of equal size, replicas numbered island by island")


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """How one optimizer step's samples are split: rank r takes accum_steps[r] micro-batches of micro_batch_sizes[r]."""

    micro_batch_sizes: tuple[int, ...]
    accum_steps: tuple[int, ...] | int

    def __post_init__(self) -> None:
        sizes = tuple(int(m) for m in self.micro_batch_sizes)
        accum = self.accum_steps
        accum = (int(accum),) * len(sizes) if isinstance(accum, numbers.Integral) else tuple(int(a) for a in accum)
        if not sizes or len(accum) != len(sizes):
            raise ValueError(f"need one micro-batch size and one accumulation count per rank, got {sizes} and {accum}")
        if min(sizes) < 1 or min(accum) < 1:
            raise ValueError(f"micro-batch sizes and accumulation counts must be positive, got {sizes} and {accum}")
        object.__setattr__(self, "micro_batch_sizes", sizes)
        object.__setattr__(self, "accum_steps", accum)

    @property
    def world_size(self) -> int:
        return len(self.micro_batch_sizes)

    @property
    def global_batch(self) -> int:
        return sum(m * a for m, a in zip(self.micro_batch_sizes, self.accum_steps))

    def rank_offset(self, rank: int) -> int:
        """Where rank `rank`'s block starts inside a step."""
        return sum(m * a for m, a in zip(self.micro_batch_sizes[:rank], self.accum_steps[:rank]))

    @classmethod
    def uniform(cls, world_size: int, micro_batch_size: int, accum_steps: int) -> BatchLayout:
        return cls((micro_batch_size,) * world_size, accum_steps)
