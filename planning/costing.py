"""The planner's cost model of one candidate: which devices, how the batch splits, what a step costs.

    job = PlanningJob.from_config(config)
    costing = Costing(job, pool, collectives, compute, prices, memory_profile)
    outcome = costing.evaluate(selection)          # selection: ((domain index, devices used), …)

`evaluate` is the one function both the planner's search and the exhaustive check call, so
"within 5% of the exhaustive optimum" compares searches over the same model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import numpy as np

from core import rules
from core.config import JobConfig
from core.plan import AllReduce, DataParallel, DeviceKind, Objective
from planning.collectives import Bucketing, CollectiveCostModel, Hop, LinkClass, Reduction, bucketing
from planning.compute import ComputeModel, StepShape
from planning.devices import DevicePool, DeviceType, Domain
from planning.figures import Source
from planning.goodput import GOODPUT_OBJECTIVES, Statistics, Throughput, batch_ladder, goodput_score
from planning.hook_costs import CommHookCost, gradient_element_bytes
from planning.memory import ALLOCATOR_SLACK, MemoryProfile
from planning.model_size import model_facts
from planning.prices import PriceTable
from planning.split import ReplicaGroup, Split, feasible_accum_steps, split_batch
from workers.models import make_workload

DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20
"""torch DDP's bucket_cap_mb default: what an unplanned run uses."""
FSDP_OVERLAP = 0.9
"""Share of the compute FSDP2's prefetching can hide all-gathers and reduce-scatters behind."""

Selection = tuple[tuple[int, int], ...]
"""((index into DevicePool.domains, devices used from that domain), …), in domain order."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a selection of devices is, as far as costs go: replicas per device type, the hops its
    collectives cross, its islands. Computed with numpy over the pool's domains."""

    domains: np.ndarray
    """Indices into DevicePool.domains, ascending."""
    counts: np.ndarray
    """Devices used from each."""
    replicas: dict[DeviceType, int]
    hops: dict[str, Hop]
    backend: str
    island_size: int
    """Replicas per used domain when all are equal (hierarchical reduction possible), else 0."""
    tp_hop: Hop | None

    @property
    def world(self) -> int:
        return int(self.counts.sum())

    @property
    def selection(self) -> Selection:
        return tuple(zip(self.domains.tolist(), self.counts.tolist()))


@dataclass(frozen=True, slots=True)
class PlanningJob:
    """What the planner needs from a JobConfig, resolved to numbers."""

    name: str
    global_batch_size: int
    seq_len: int
    steps: int
    micro_batch_limit: int
    """[train] micro_batch_size: no worker gets more per micro-step."""
    flops_per_sample: float
    parameters: int
    n_layer: int
    """The model's repeated blocks (workload.blocks)."""
    n_embd: int
    """The residual stream's width (model_size.ModelFacts.width)."""
    vocab_size: int
    """[model] vocab_size: the loss's and the embedding's rows (compute.MemoryTraffic)."""
    compute_dtype: str
    """Key of the devices' peak_tflops: bf16 or fp32."""
    parameter_bytes_compute: int
    """Bytes FSDP all-gathers per pass: parameters in the compute dtype."""
    objective: Objective
    deadline_hours: float
    min_devices: int
    max_devices: int
    """0 = no limit."""
    tensor_parallel_size: int
    """The size the search costs ([placement] tensor_parallel_size; for 0 the planner searches once per size)."""
    strategies: tuple[DataParallel, ...]
    """The data-parallel strategies the search costs: the one [parallel] strategy names, or every one for "auto"."""
    use_gpu: bool
    cpus_per_worker: int
    spot: bool
    use_mig: bool
    float8: bool = False
    """[train] precision = "fp8": only devices with float8 tensor cores can take part."""
    gradient_element_bytes: int = 4
    """Bytes of a gradient element in DDP's buckets (comm_hooks.gradient_element_bytes)."""
    comm_hook: CommHookCost | None = None
    """What DDP's comm hook puts on the wire, costs in compute and keeps in memory; a job built by
    hand without one is planned with plain all-reduce of its buckets."""
    statistics: Statistics = Statistics(base_batch=1)
    """The noise scale and target the goodput objectives weigh batches by (planning/goodput.py)."""
    batch_sizes: tuple[int, ...] = ()
    """The global batches the planner weighs: several for a goodput objective with [train] batch_size =
    "adaptive" (its range), else none but global_batch_size."""

    @classmethod
    def from_config(cls, config: JobConfig) -> PlanningJob:
        facts = model_facts(make_workload(config.model), config.model.seq_len)
        parameters = facts.parameters
        placement = config.placement
        precision = config.train.precision
        dtype = "fp32" if precision == "fp32" or (precision == "auto" and not config.cluster.use_gpu) else "bf16"
        workers = config.cluster.num_workers
        objective, train = Objective(placement.objective), config.train
        statistics = Statistics(base_batch=train.global_batch_size, noise_scale=placement.noise_scale,
                                samples_to_target=placement.tokens_to_target / config.model.seq_len,
                                source="configured" if placement.noise_scale is not None else "")
        adaptive = train.batch_size == "adaptive" and objective in GOODPUT_OBJECTIVES
        batches = (batch_ladder(train.min_batch_size, train.max_batch_size, train.global_batch_size) if adaptive
                   else (train.global_batch_size,))
        return cls(name=config.name, global_batch_size=config.train.global_batch_size, seq_len=config.model.seq_len,
                   steps=config.train.steps, micro_batch_limit=config.train.micro_batch_size,
                   flops_per_sample=float(facts.flops_per_token * config.model.seq_len),
                   parameters=parameters, n_layer=facts.blocks, n_embd=facts.width,
                   vocab_size=config.model.vocab_size,
                   compute_dtype=dtype, parameter_bytes_compute=parameters * (4 if dtype == "fp32" else 2),
                   objective=objective, deadline_hours=placement.deadline_hours,
                   min_devices=placement.min_gpus if config.cluster.use_gpu else workers,
                   max_devices=placement.max_gpus if config.cluster.use_gpu else workers,
                   tensor_parallel_size=(placement.tensor_parallel_size or 1) if config.cluster.use_gpu else 1,
                   strategies=strategies_for(config.parallel.strategy), use_gpu=config.cluster.use_gpu,
                   cpus_per_worker=config.cluster.cpus_per_worker,
                   spot=placement.pricing == "spot", use_mig=placement.use_mig,
                   float8=precision == "fp8", gradient_element_bytes=gradient_element_bytes(config),
                   comm_hook=CommHookCost.for_job(config), statistics=statistics, batch_sizes=batches)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients reduced per step: fp32 (the parameters' dtype under autocast) unless bf16."""
        return self.parameters * self.gradient_element_bytes

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def step_shape(self) -> StepShape:
        return StepShape(flops_per_sample=self.flops_per_sample, seq_len=self.seq_len, n_layer=self.n_layer,
                         width=self.n_embd, vocab_size=self.vocab_size)


def strategies_for(strategy: str) -> tuple[DataParallel, ...]:
    """[parallel] strategy as the strategies the planner costs."""
    return tuple(DataParallel) if strategy == "auto" else (DataParallel(strategy),)


@dataclass(slots=True)
class Outcome:
    """One evaluated candidate."""

    footprint: Footprint
    data_parallel: DataParallel
    types: list[DeviceType]
    """Replica groups, in the order of split.micro_batches."""
    split: Split
    allreduce: AllReduce
    bucketing: Bucketing | None
    """DDP's buckets for the gradient reduction; None without one (one replica, or FSDP)."""
    overlap_seconds: float
    """Backward time of the last micro-step: what the reduction can hide behind."""
    hops: dict[str, Hop]
    """"world", and "intra" / "inter" where the reduction has them."""
    compute_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    dollars_per_hour: float
    backend: str
    devices: int
    hook_compute_seconds: float = 0.0
    """The comm hook's own work per step, included in compute_seconds."""
    score: tuple[float, ...] = field(default=())

    @property
    def selection(self) -> Selection:
        return self.footprint.selection

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed_communication_seconds

    def dollars_per_step(self) -> float:
        return self.dollars_per_hour * self.step_seconds / 3600

    def dollars_per_million_tokens(self, job: PlanningJob) -> float:
        return self.dollars_per_step() / job.tokens_per_step * 1e6

    def job_hours(self, job: PlanningJob) -> float:
        return job.steps * self.step_seconds / 3600

    def throughput(self, job: PlanningJob) -> Throughput:
        return Throughput(self.devices, job.global_batch_size, self.step_seconds, self.dollars_per_hour)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a candidate cannot run: the constraint and what would lift it."""

    constraint: str
    fix: str
    devices: int = 0


class Costing:
    def __init__(self, job: PlanningJob, pool: DevicePool, collectives: CollectiveCostModel, compute: ComputeModel,
                 prices: PriceTable, memory: MemoryProfile):
        self.job = job
        self.pool = pool
        self.collectives = collectives
        self.compute = compute
        self.prices = prices
        self.memory = memory
        self.comm_hook = job.comm_hook or CommHookCost.plain(job.gradient_bytes)
        self._caps: dict[tuple, int] = {}
        self._groups: dict[tuple, ReplicaGroup] = {}
        self._limits: dict[DeviceType, int] = {}
        self._loopback = collectives.hop(LinkClass.LOOPBACK)
        domains = pool.domains
        self._types = list(dict.fromkeys(d.type for d in domains))
        nodes = list(dict.fromkeys(d.node_id for d in domains))
        type_index = {t: i for i, t in enumerate(self._types)}
        node_index = {n: i for i, n in enumerate(nodes)}
        self._type_of = np.array([type_index[d.type] for d in domains], dtype=np.int64)
        self._node_of = np.array([node_index[d.node_id] for d in domains], dtype=np.int64)
        self._node_count = len(nodes)
        self._intra_bw = np.array([d.intra_hop.bytes_per_s if d.intra_hop else np.inf for d in domains])
        self._network_bw = np.array([d.network_hop.bytes_per_s for d in domains])
        self._cross_hops = [pool.cross_domain_hops.get(node) for node in nodes]
        # NCCL refuses two ranks on one GPU: from this many devices on, a MIG domain holds two
        # slices of one GPU, and the reduction goes through gloo on the host.
        self._shared_parent_at = np.array([_shared_parent_at(d) for d in domains], dtype=np.int64)
        self._cpu = any(t.kind == DeviceKind.CPU for t in self._types)

    def with_batch(self, job: PlanningJob) -> Costing:
        """The same costing for `job`, the same one at another global batch (a goodput search); the
        replica groups and micro-batch caps found so far do not depend on the batch and carry over."""
        other = copy.copy(self)
        other.job = job
        return other

    def with_comm_hook(self, hook: CommHookCost) -> Costing:
        """The same costing with another comm hook (comm_hook = "auto", the what-if notes); micro-batch
        limits found so far carry over, and the caps too where the hook keeps the same memory."""
        other = copy.copy(self)
        other.comm_hook = hook
        if hook.state_bytes != self.comm_hook.state_bytes:
            other._caps = {}
        return other

    def hook_state_bytes(self, strategy: DataParallel, world: int) -> float:
        """What the comm hook keeps on each worker: only DDP over several replicas runs one."""
        t = self.job.tensor_parallel_size
        return self.comm_hook.state_bytes / t if strategy == DataParallel.DDP and world // t > 1 else 0.0

    def sharded_over(self, outcome: Outcome) -> int:
        """The ranks a worker's model state is spread over, as the memory profile counts them: an
        island's under hsdp, every rank otherwise."""
        t = self.job.tensor_parallel_size
        return outcome.footprint.island_size * t if outcome.data_parallel == DataParallel.HSDP else outcome.devices

    def capacity_for_step(self, device: DeviceType, strategy: DataParallel, world: int) -> int:
        """The device memory the memory profile may plan a step into: the hook's state taken off what
        the allocator can use (usable_bytes scales capacity by 1 - ALLOCATOR_SLACK)."""
        state = self.hook_state_bytes(strategy, world)
        return int(device.memory_bytes - state / (1 - ALLOCATOR_SLACK))

    # ---- per device type --------------------------------------------------------------------------
    def replica_group(self, device: DeviceType, count: int, cap: int, tp_hop: Hop | None) -> ReplicaGroup:
        key = (device, count, cap, tp_hop)
        if key not in self._groups:
            self._groups[key] = self._replica_group(device, count, cap, tp_hop)
        return self._groups[key]

    def _replica_group(self, device: DeviceType, count: int, cap: int, tp_hop: Hop | None) -> ReplicaGroup:
        job, t = self.job, self.job.tensor_parallel_size
        overhead = self.compute.overhead_s(job.n_layer, cpu=device.kind == DeviceKind.CPU)
        if device.kind == DeviceKind.CPU:
            per_sample = 1 / self.compute.cpu_samples_per_second(device.peak_tflops, job.flops_per_sample,
                                                                 job.compute_dtype,
                                                                 measured=device.source == Source.MEASURED,
                                                                 training_tflops=device.training_tflops)
        else:  # a tensor-parallel group's t GPUs share the FLOPs and the traffic
            per_sample = self.compute.gpu_seconds_per_sample(device.peak_tflops * t, device.memory_bytes_per_s * t,
                                                             job.step_shape)
            overhead += self.compute.gpu_micro_step_seconds(device.memory_bytes_per_s * t, job.step_shape)
        efficiency = self.compute.efficiency_of(device.model)  # a calibration's: the whole micro-step scales
        per_sample, overhead = per_sample / efficiency, overhead / efficiency
        if t > 1 and tp_hop is not None:
            # Megatron-style blocks all-reduce their output twice forward and twice backward, in bf16.
            activation_bytes = job.seq_len * job.n_embd * 2
            latency = 4 * job.n_layer * 2 * (t - 1) * tp_hop.alpha_s
            per_sample += 4 * job.n_layer * 2 * (t - 1) / t * activation_bytes / tp_hop.bytes_per_s
            overhead += latency
        return ReplicaGroup(count=count, seconds_per_sample=per_sample, overhead_s=overhead, max_micro_batch=cap)

    def micro_batch_cap(self, device: DeviceType, strategy: DataParallel, world: int, accumulating: bool) -> int:
        # A DDP replica's memory does not depend on how many others there are, only on whether there are.
        replicas = world // self.job.tensor_parallel_size > 1  # whether DDP runs a hook, and its state
        key = (device, strategy, (min(world, 2), replicas) if strategy == DataParallel.DDP else world, accumulating)
        if key not in self._caps:
            fit = self.memory.max_micro_batch(self.capacity_for_step(device, strategy, world),
                                              data_parallel=strategy.value, world_size=world,
                                              tensor_parallel_size=self.job.tensor_parallel_size,
                                              accumulating=accumulating, limit=self.job.micro_batch_limit)
            self._caps[key] = min(fit, self.job.micro_batch_limit)
        return min(self._caps[key], self._limits.get(device, self._caps[key]))

    def limit_micro_batch(self, device: DeviceType, micro_batch: int) -> None:
        """Caps `device`'s micro-batch below what the interpolated memory profile allows."""
        self._limits[device] = min(micro_batch, self._limits.get(device, micro_batch))

    def price(self, device: DeviceType) -> float:
        per_unit = self.prices.dollars_per_hour(device.model, spot=self.job.spot)
        return (per_unit or 0.0) * device.price_units

    # ---- one candidate ---------------------------------------------------------------------------
    def footprint(self, domains: np.ndarray, counts: np.ndarray) -> Footprint:
        t = self.job.tensor_parallel_size
        used = counts > 0
        domains, counts = domains[used], counts[used]
        order = np.argsort(domains, kind="stable")
        domains, counts = domains[order], counts[order]
        per_type = np.bincount(self._type_of[domains], weights=counts // t, minlength=len(self._types))
        replicas = {self._types[i]: int(per_type[i]) for i in np.flatnonzero(per_type)}
        hops: dict[str, Hop] = {}
        multi = counts > 1
        if multi.any():
            hops["intra"] = self.pool.domains[int(domains[multi][np.argmin(self._intra_bw[domains[multi]])])].intra_hop
        if len(domains) > 1:
            inter = []
            nodes = np.bincount(self._node_of[domains], minlength=self._node_count)
            if np.count_nonzero(nodes) > 1:
                inter.append(self.pool.domains[int(domains[np.argmin(self._network_bw[domains])])].network_hop)
            inter += [self._cross_hops[n] for n in np.flatnonzero(nodes > 1)]
            hops["inter"] = min(inter, key=lambda h: (h.bytes_per_s, -h.alpha_s))
        gloo = self._cpu or bool((counts >= self._shared_parent_at[domains]).any())
        world = list(hops.values()) + ([self._loopback] if gloo and not self._cpu else [])
        if world:
            hops["world"] = world[0]
            for hop in world[1:]:
                hops["world"] = hops["world"].slower(hop)
        sizes = counts // t
        island_size = int(sizes[0]) if len(sizes) > 1 and not gloo and (sizes == sizes[0]).all() else 0
        return Footprint(domains=domains, counts=counts, replicas=replicas, hops=hops, island_size=island_size,
                         backend="gloo" if gloo else "nccl", tp_hop=hops.get("intra") if t > 1 else None)

    def evaluate(self, selection: Selection | Footprint, *, all_accumulations: bool = False,
                 uniform_micro_batch: int = 0, planned_comm: bool = True) -> Outcome | Refusal:
        """The best step this selection allows under each allowed strategy.

        all_accumulations tries every feasible accumulation count (the exhaustive check does);
        otherwise the two smallest, where the optimum lies (fewer, larger micro-steps pay less
        overhead and split finer). uniform_micro_batch and planned_comm=False describe an
        unplanned run: one micro-batch for all, flat all-reduce, DDP's default buckets."""
        if not isinstance(selection, Footprint):
            pairs = np.array(selection, dtype=np.int64).reshape(-1, 2)
            selection = self.footprint(pairs[:, 0], pairs[:, 1])
        best: Outcome | Refusal = Refusal("no data-parallel strategy is allowed", "set [parallel] strategy")
        for strategy in self.job.strategies:
            outcome = self._evaluate(selection, strategy, all_accumulations, uniform_micro_batch, planned_comm)
            if isinstance(outcome, Outcome) and (isinstance(best, Refusal) or outcome.score < best.score):
                best = outcome
            elif isinstance(best, Refusal) and isinstance(outcome, Refusal):
                best = outcome
        return best

    def _evaluate(self, footprint: Footprint, strategy: DataParallel, all_accumulations: bool,
                  uniform_micro_batch: int, planned_comm: bool) -> Outcome | Refusal:
        t = self.job.tensor_parallel_size
        world = footprint.world
        if world == 0:
            return Refusal("no devices chosen", "", 0)
        refusal = rules.comm_hook_refusal(self.comm_hook.name, backend=footprint.backend) if world > 1 else None
        if refusal is not None:  # several MIG slices of one GPU reduce through gloo
            return Refusal(refusal.what, f"{refusal.fix}, or use one MIG slice per GPU (bound [placement] max_gpus)",
                           world)
        if strategy == DataParallel.HSDP and footprint.island_size < 2:
            return Refusal("hsdp needs two or more NVLink islands with the same number of replicas, two or more each",
                           'set [parallel] strategy = "fsdp" or "ddp" (or "auto") for these devices', world)
        replicas = footprint.replicas
        types = list(replicas)
        # An hsdp worker holds 1/island of the model state: its memory is an fsdp worker's in one island.
        sharded_over = footprint.island_size * t if strategy == DataParallel.HSDP else world
        caps = {accumulating: [self.micro_batch_cap(d, strategy, sharded_over, accumulating) for d in types]
                for accumulating in (False, True)}
        if min(caps[True]) < 1 and min(caps[False]) < 1:
            small = types[caps[True].index(min(caps[True]))]
            return Refusal(f"one sample does not fit a {small.label} ({small.memory_bytes / 2**30:.0f} GiB) "
                           f"with {strategy.value} on {world} workers", "", world)
        splits = self._splits(types, replicas, caps, footprint.tp_hop, all_accumulations, uniform_micro_batch)
        if isinstance(splits, Refusal):
            return splits
        best: Outcome | None = None
        dollars_per_hour = sum(self.price(d) * replicas[d] * t for d in types)
        for split in splits:
            outcome = self._communication(footprint, strategy, types, split, dollars_per_hour, planned_comm)
            if best is None or outcome.score < best.score:
                best = outcome
        return best

    def _splits(self, types: list[DeviceType], replicas: dict[DeviceType, int], caps: dict[bool, list[int]],
                tp_hop: Hop | None, all_accumulations: bool, uniform: int) -> list[Split] | Refusal:
        job = self.job
        groups = {accumulating: [self.replica_group(d, replicas[d], max(cap, 1), tp_hop)
                                 for d, cap in zip(types, caps[accumulating])] for accumulating in (False, True)}
        total = sum(replicas.values())
        if uniform:
            accum, remainder = divmod(job.global_batch_size, uniform * total)
            if remainder or accum < 1 or uniform > min(caps[accum > 1]):
                return Refusal(f"micro-batch {uniform} on {total} workers does not fit or divide the global batch",
                               "", total)
            slowest = max(g.micro_step_seconds(uniform) for g in groups[accum > 1])
            return [Split(accum, tuple(((uniform, replicas[d]),) for d in types), slowest)]
        if total > job.global_batch_size:
            return Refusal(f"{total} replicas but a global batch of {job.global_batch_size} samples: some would "
                           "get no sample", f"use at most {job.global_batch_size} workers, or raise "
                           "[train] global_batch_size", total)
        feasible = []
        if min(caps[False]) >= 1 and 1 in feasible_accum_steps(groups[False], job.global_batch_size):
            feasible.append(split_batch(groups[False], job.global_batch_size, 1))
        if min(caps[True]) >= 1:
            more = [a for a in feasible_accum_steps(groups[True], job.global_batch_size) if a > 1]
            chosen = more if all_accumulations else _promising(more, groups[True], job.global_batch_size,
                                                               1 if feasible else None)
            feasible += [split_batch(groups[True], job.global_batch_size, a) for a in chosen]
        if not feasible:
            return Refusal(f"no accumulation count splits {job.global_batch_size} samples over {total} replicas "
                           "within their memory", "lower [train] micro_batch_size or use more workers", total)
        return feasible

    def _communication(self, footprint: Footprint, strategy: DataParallel, types: list[DeviceType], split: Split,
                       dollars_per_hour: float, planned_comm: bool) -> Outcome:
        job, t = self.job, self.job.tensor_parallel_size
        hops, world = footprint.hops, footprint.world
        ranks = world // t
        overhead = max(self.compute.overhead_s(job.n_layer, cpu=d.kind == DeviceKind.CPU) for d in types)
        optimizer = max(self.optimizer_seconds(d, footprint, strategy) for d in types)
        compute, hook_seconds = split.compute_seconds + optimizer, 0.0
        buckets, algorithm = None, AllReduce.NONE
        backward = 2 / 3 * max(split.micro_step_seconds - overhead, 0.0)
        if ranks > 1 and strategy == DataParallel.DDP:
            hook = self.comm_hook
            reduction = self._reduction(hook.wire_bytes / t, ranks, footprint, planned_comm)
            algorithm = reduction.algorithm
            # Sized in the buckets' bytes (DDP's bucket_cap_mb), timed by what the hook sends for them.
            buckets = bucketing(reduction, hook.buffer_bytes / t, overlap_s=backward if hook.overlaps_backward else 0.0,
                                last_ready_bytes=self.memory.root_parameter_bytes / t,
                                bucket_bytes=None if planned_comm else DDP_DEFAULT_BUCKET_BYTES)
            communication = buckets.seconds
            exposed = buckets.exposed_seconds if hook.overlaps_backward else communication
            hook_seconds = max(hook.compute_seconds(d, ranks, t) for d in types)
            # Only the last micro-step reduces (the others run under no_sync), so only it is slowed.
            compute += hook_seconds + split.micro_step_seconds * self._ddp_compute_slowdown(footprint)
        elif ranks > 1 and strategy == DataParallel.HSDP:
            communication = self._hsdp_seconds(footprint, split.grad_accum_steps)
            hidden = FSDP_OVERLAP * split.grad_accum_steps * max(split.micro_step_seconds - overhead, 0.0)
            exposed = max(communication / (job.n_layer + 1), communication - hidden)
            algorithm = AllReduce.HIERARCHICAL
        elif ranks > 1:
            gather, _ = self.collectives.all_gather(job.parameter_bytes_compute / t, ranks, hops["world"])
            scatter, _ = self.collectives.reduce_scatter(job.gradient_bytes / t, ranks, hops["world"])
            communication = split.grad_accum_steps * 2 * gather + scatter
            hidden = FSDP_OVERLAP * split.grad_accum_steps * max(split.micro_step_seconds - overhead, 0.0)
            exposed = max(communication / (job.n_layer + 1), communication - hidden)
            algorithm = AllReduce.RING
        else:
            communication = exposed = 0.0
        outcome = Outcome(footprint=footprint, data_parallel=strategy, types=types, split=split, allreduce=algorithm,
                          bucketing=buckets, overlap_seconds=backward, hops=hops, compute_seconds=compute,
                          communication_seconds=communication, exposed_communication_seconds=exposed,
                          dollars_per_hour=dollars_per_hour, backend=footprint.backend,
                          devices=world, hook_compute_seconds=hook_seconds)
        outcome.score = self.score(outcome)
        return outcome

    def optimizer_seconds(self, device: DeviceType, footprint: Footprint, strategy: DataParallel) -> float:
        """The optimizer's step on one GPU, over the parameters its worker holds: all of its
        tensor-parallel share under ddp, its island's shard under hsdp, its world's under fsdp (a CPU
        worker's is in its per-block overhead)."""
        if device.kind == DeviceKind.CPU:
            return 0.0
        t = self.job.tensor_parallel_size
        shards = {DataParallel.DDP: t, DataParallel.HSDP: footprint.island_size * t}.get(strategy, footprint.world)
        return (self.compute.gpu_optimizer_seconds(device.memory_bytes_per_s, self.job.parameters / max(shards, 1))
                / self.compute.efficiency_of(device.model))

    def _hsdp_seconds(self, footprint: Footprint, accumulation: int) -> float:
        """One step's hsdp collectives: each micro-step all-gathers the parameters twice (forward and
        backward) among the island's replicas, on its links; the gradients are reduce-scattered there
        once, and each island's shard all-reduced across islands, over the slowest link between them."""
        job, t = self.job, self.job.tensor_parallel_size
        shard, islands = footprint.island_size, len(footprint.domains)
        intra = footprint.hops.get("intra", footprint.hops["world"])
        inter = footprint.hops.get("inter", footprint.hops["world"])
        gather, _ = self.collectives.all_gather(job.parameter_bytes_compute / t, shard, intra)
        scatter, _ = self.collectives.reduce_scatter(job.gradient_bytes / t, shard, intra)
        # The island's ranks all-reduce their shards at once, sharing the links out of the island.
        shared = replace(inter, bytes_per_s=inter.bytes_per_s / shard)
        _, across, _ = self.collectives.flat_allreduce(job.gradient_bytes / (t * shard), islands, shared)
        return accumulation * 2 * gather + scatter + across

    def _ddp_compute_slowdown(self, footprint: Footprint) -> float:
        """How much longer the step's kernels run beside DDP's collectives than alone: measured for
        NCCL over NVSwitch (cost.NVLINK_DDP_COMPUTE_SLOWDOWN). The largest figure among the placement's
        links applies (with tensor parallelism that includes its NVLink, whose collectives run beside
        the kernels too); gloo (host memory) has none measured."""
        if footprint.backend != "nccl":
            return 0.0
        return max((self.collectives.calibration[hop.link_class].ddp_compute_slowdown
                    for hop in footprint.hops.values()), default=0.0)

    def _reduction(self, wire_bytes: float, ranks: int, footprint: Footprint, planned: bool) -> Reduction:
        """How one step's `wire_bytes` per rank are reduced: by the comm hook's collective, and for
        an all-reduce the fastest algorithm the placement allows (flat only when unplanned). NCCL's
        own all-reduce, which the allreduce, bf16 and powersgd hooks call, builds its rings and trees
        island by island, so it is costed as able to reach the hierarchical figure too."""
        hops = footprint.hops
        if not planned or self.comm_hook.all_gather:
            return self._flat_reduction(wire_bytes, ranks, hops["world"])
        size = footprint.island_size
        reduction = self.collectives.gradient_reduction(
            wire_bytes, ranks, hops["world"], island_size=size, islands=len(footprint.domains) if size else 0,
            intra=hops.get("intra"), inter=hops.get("inter"))
        return replace(reduction, latency_s=reduction.latency_s * self.comm_hook.collectives_per_bucket)

    def _flat_reduction(self, wire_bytes: float, ranks: int, hop: Hop) -> Reduction:
        """The hook's collective over one hop: an all-gather of every rank's payload, or ring/tree all-reduce."""
        per_bucket = self.comm_hook.collectives_per_bucket
        if self.comm_hook.all_gather:
            seconds, latency = self.collectives.all_gather(ranks * wire_bytes, ranks, hop)
            return Reduction(AllReduce.ALL_GATHER, seconds - latency, latency * per_bucket)
        algorithm, seconds, latency = self.collectives.flat_allreduce(wire_bytes, ranks, hop)
        return Reduction(algorithm, seconds - latency, latency * per_bucket)

    def score(self, outcome: Outcome) -> tuple[float, ...]:
        return rank(self.job, outcome.throughput(self.job))

    def bucket_sizes(self, outcome: Outcome) -> dict[str, int]:
        """The bucket that suits each link class the reduction crosses: the plan's own for the slowest
        (world) hop, and for each other hop the one a reduction over all ranks on it would want."""
        if outcome.bucketing is None:
            return {}
        t = self.job.tensor_parallel_size
        ranks, hook = outcome.devices // t, self.comm_hook
        sizes = {}
        for hop in outcome.hops.values():
            sizes[hop.link_class.value] = bucketing(
                self._flat_reduction(hook.wire_bytes / t, ranks, hop), hook.buffer_bytes / t,
                overlap_s=outcome.overlap_seconds if hook.overlaps_backward else 0.0,
                last_ready_bytes=self.memory.root_parameter_bytes / t).bucket_bytes
        sizes[outcome.hops["world"].link_class.value] = outcome.bucketing.bucket_bytes
        return sizes


def rank(job: PlanningJob, size: Throughput) -> tuple[float, ...]:
    """How the job's objective orders candidates, lower first: Costing.score asks it of each candidate,
    the planner of whole plans (of several tensor-parallel sizes or global batches)."""
    if job.objective in GOODPUT_OBJECTIVES:
        return goodput_score(job.objective, size, job.statistics)
    step, cost = size.step_seconds, size.dollars_per_step / (size.batch * job.seq_len) * 1e6
    if job.objective == Objective.FASTEST:
        return (step, cost)
    if job.objective == Objective.CHEAPEST_UNDER_DEADLINE and job.steps * step / 3600 > job.deadline_hours:
        return (math.inf, step, cost)  # misses the deadline: ranked by how close it comes
    return (cost, step)


def _promising(accumulations: list[int], groups: list[ReplicaGroup], global_batch: int,
               smallest: int | None) -> list[int]:
    """The accumulation counts worth costing: the smallest feasible ones (fewest micro-steps, least
    overhead, the finest split), and those from which no replica's memory cap binds any more — when
    a fast device is capped, more micro-steps let it take its full share of every step's samples."""
    if not accumulations:
        return []
    total_speed = sum(g.count / g.seconds_per_sample for g in groups)
    balanced = max(global_batch / (g.max_micro_batch * g.seconds_per_sample * total_speed) for g in groups)
    first_balanced = next((i for i, a in enumerate(accumulations) if a >= balanced), len(accumulations) - 1)
    picks = accumulations[:1 if smallest else 2] + accumulations[first_balanced:first_balanced + 2]
    return sorted(set(picks))


def _shared_parent_at(domain: Domain) -> int:
    """How many of the domain's devices, taken in order, first include two slices of one GPU."""
    seen: set[str] = set()
    for k, device in enumerate(domain.devices, start=1):
        if device.parent_uuid and device.parent_uuid in seen:
            return k
        seen.add(device.parent_uuid)
    return np.iinfo(np.int64).max
