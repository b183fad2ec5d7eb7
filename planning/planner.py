"""The planner: choose the devices, groups and per-worker work that best serve the job's objective.

    plan = Planner(topology, config).plan()          # the plan to run
    naive = Planner(topology, config).naive(plan.world_size)   # Ray's default PACK placement, same count

Search. Domains (an NVLink island, a node's PCIe GPUs, its MIG slices, its CPU slots) fall into
classes of interchangeable domains; a candidate is how many devices to take from each class,
taken domain by domain in the class's order (best network first), so that ranks pack into as few
islands and nodes as possible. From each starting class, the planner grows the candidate greedily
— each step adds the chunk (a domain, then geometrically more) of whichever class scores best
under the objective — keeps the best candidate seen, then climbs from it by adding or removing
single domains or devices, leaving a class out, or (small pools) trading a device of one class
for one of another, until nothing improves. Every candidate is scored by model.Costing, the same
model the exhaustive check enumerates.

Then the chosen candidate becomes a Plan: ranks in topology order (island by island), micro-batches
from the split, process groups, bucket sizes, and exact fake-tensor memory peaks per worker.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import defaultdict
from itertools import product
from typing import NamedTuple

import numpy as np

from core import rules
from core.config import JobConfig
from core.errors import ConfigError, PlacementError
from core.plan import (
    DataParallel,
    DeviceBasis,
    DeviceKind,
    Objective,
    Plan,
    Prediction,
    WorkerPlacement,
    cross_island_groups,
)
from planning.calibration import Calibration
from planning.collectives import CollectiveCostModel
from planning.compute import ComputeModel
from planning.costing import (
    DDP_DEFAULT_BUCKET_BYTES,
    Costing,
    Footprint,
    Outcome,
    PlanningJob,
    Refusal,
    Selection,
    rank,
)
from planning.devices import Device, DevicePool, DeviceType, Domain
from planning.figures import FigureBook
from planning.goodput import GOODPUT_OBJECTIVES, Throughput, dollars_to_target, goodput_samples_per_second
from planning.hook_costs import COMPRESSING_HOOKS, CommHookCost
from planning.memory import MemoryProfile, measure_steps, profile, usable_bytes
from planning.model_size import model_facts
from planning.plan_table import significant
from planning.prices import PriceTable
from planning.resolve import plan_choices
from planning.split import feasible_accum_steps
from topology import catalog
from topology.cluster import ClusterTopology
from topology.nccl_env import nccl_environment
from topology.ray_resources import island_resource
from topology.sysfs import format_cpu_list, parse_cpu_list
from workers.models import make_workload

REFINE_ROUNDS = 64
"""Hill-climbing rounds after the greedy paths; each tries every class one domain or device up or
down, or left out altogether."""
FINE_MOVES_UP_TO = 128
"""Pools of at most this many devices also grow by single devices, not only whole domains."""
EXACT_MEMORY_RETRIES = 3
"""Searches again, with an exactly measured micro-batch cap, when the exact memory check of a plan
finds a micro-batch the interpolated profile let through too large."""
DOLLAR_OBJECTIVES = (Objective.CHEAPEST, Objective.CHEAPEST_UNDER_DEADLINE, Objective.CHEAPEST_TO_TARGET)
"""The objectives that need every device's price and prefer cheap compute."""
AUTO_BF16_MIN_GAIN = 0.05
"""comm_hook = "auto" takes the bf16 hook only for a step at least this much shorter than plain
all-reduce's: it rounds the averaged gradients to bf16 (over a 3.4 GB/s link between two H200s it
reached plain all-reduce's loss 1.81x sooner and ended 0.02 % above it after 200 steps)."""
HOOK_ADVICE_EXPOSED_SHARE = 0.10
"""From this share of the step spent waiting on plain all-reduce, a plan's notes say what each
compressing comm hook is predicted to do."""


class _Choice(NamedTuple):
    """A search's best candidate, the costing it was scored by (its comm hook), and why that hook."""

    outcome: Outcome
    costing: Costing
    note: str = ""


class _Overrun(Exception):
    def __init__(self, device: DeviceType, micro_batch: int):
        super().__init__(device, micro_batch)
        self.device, self.micro_batch = device, micro_batch


class Planner:
    def __init__(self, topology: ClusterTopology, config: JobConfig, *, memory: MemoryProfile | None = None,
                 collectives: CollectiveCostModel | None = None, compute: ComputeModel | None = None,
                 prices: PriceTable | None = None, exact_memory: bool = True, calibration: Calibration | None = None,
                 measured_noise_scale: float | None = None):
        """memory: the job's MemoryProfile (computed from the config when not given; it is the slow
        part, a few fake training steps); exact_memory re-measures the chosen micro-batches exactly.
        calibration: link rows and compute efficiencies over the defaults (the file [placement]
        calibration_file names when not given; the CLI and fit pass Calibration.for_job's, which also
        looks in the runs directory); `collectives` and `compute`, when given, are taken as they are.
        measured_noise_scale: the gradient noise scale the run has measured (an elastic re-plan), which
        the goodput objectives take over [placement] noise_scale.

        Refuses at once (PlacementError), before the memory profile, a job the cluster cannot hold
        whatever the memory: no devices, no NVLink island for a tensor-parallel group, too few
        devices for min_gpus or for the batch, no price for a device under a dollar objective."""
        self.topology = topology
        self.config = config
        self.job = PlanningJob.from_config(config)
        self.measured_noise_scale = measured_noise_scale
        if measured_noise_scale is not None:
            self.job = dataclasses.replace(self.job, statistics=dataclasses.replace(
                self.job.statistics, noise_scale=measured_noise_scale, source="measured"))
        self.calibration = calibration or Calibration.named_by(config)
        self.collectives = collectives or self.calibration.collectives()  # defaults and measured rows
        self.compute = compute or self.calibration.compute(
            ComputeModel.compiled(bf16_weights=config.train.bf16_weights) if config.compile.enable else ComputeModel())
        self.exact_memory = exact_memory
        figures = FigureBook(topology, config.devices)  # [devices] tables, measured figures, the catalog
        if self.job.use_gpu:
            self.pool = DevicePool.gpus(topology, self.collectives, dtype=self.job.compute_dtype,
                                        use_mig=self.job.use_mig, figures=figures)
        else:
            self.pool = DevicePool.cpus(topology, self.collectives, cores_per_worker=self.job.cpus_per_worker,
                                        dtype=self.job.compute_dtype,
                                        nominal_gflops_per_core=self.compute.cpu_gflops_per_core)
        priced_as = {gpu.model or gpu.name for _, gpu in topology.gpus()}  # the names the table is asked for
        prices = (prices or PriceTable.for_job(config, devices=priced_as)).with_overrides(figures.prices, spot=self.job.spot)
        self.prices = prices.with_overrides(config.placement.prices, spot=self.job.spot)  # [placement] prices last
        self._check_feasible()
        self.memory = memory or profile(config, device_type="cuda" if self.job.use_gpu else "cpu")
        self.costing = Costing(self.job, self.pool, self.collectives, self.compute, self.prices, self.memory)
        """Under the configured comm hook ("auto" costed as plain buckets until a search picks one)."""
        self.classes = self._classes()
        self._class_domains = [np.array(members, dtype=np.int64) for members in self.classes]
        self._unit_of_class = [self._usable(self.pool.domains[members[0]]) for members in self.classes]
        self._capacity = [len(members) * unit for members, unit in zip(self.classes, self._unit_of_class)]
        self._fine = (False, True) if self.pool.device_count <= FINE_MOVES_UP_TO else (False,)

    # ---- public ----------------------------------------------------------------------------------
    def plan(self) -> Plan:
        if self.config.placement.tensor_parallel_size == 0 and self.job.use_gpu:
            return self._plan_each_tensor_parallel_size()
        return self._plan()

    def _plan_each_tensor_parallel_size(self) -> Plan:
        """[placement] tensor_parallel_size = 0: a plan for every size from 1 up to the largest NVLink
        island that the model's heads, hidden width and sequence split evenly over; the best under the
        objective, with notes saying what each other size was predicted to do or why it could not run."""
        largest = max((d.size for d in self.pool.domains if d.nvlink), default=1)
        plans: dict[int, Plan] = {}
        refused: dict[int, ConfigError | PlacementError] = {}
        for t in (2 ** k for k in range(8)):
            if t > largest:
                break
            rule = self.config.tensor_parallel_refusal(t)
            if rule is not None:
                refused[t] = rule.error()
                continue
            config = dataclasses.replace(self.config, placement=dataclasses.replace(self.config.placement,
                                                                                    tensor_parallel_size=t))
            try:
                plans[t] = Planner(self.topology, config, memory=self.memory, collectives=self.collectives,
                                   compute=self.compute, prices=self.prices, exact_memory=self.exact_memory,
                                   calibration=self.calibration, measured_noise_scale=self.measured_noise_scale)._plan()
            except PlacementError as error:
                refused[t] = error
        if not plans:
            raise refused[1]
        best = min(plans, key=lambda t: _plan_score(plans[t], self.job))
        others = [f"{t}: {self._predicted(plans[t])}" for t in plans if t != best]
        others += [f"{t}: refused, {error.what}" for t, error in refused.items()]
        note = f"tensor_parallel_size = 0 took {best}" + (f" (other sizes: {'; '.join(others)})" if others else "")
        return dataclasses.replace(plans[best], notes=[*plans[best].notes, note])

    def _plan(self) -> Plan:
        if len(self.job.batch_sizes) > 1:
            return self._plan_each_batch()
        return self._plan_at_batch()

    def _plan_each_batch(self) -> Plan:
        """A goodput objective with an adaptive batch: the best plan at each global batch of the job's
        ladder (each with its own worker count), and of those the one the objective ranks first, with
        notes saying what each other batch was predicted to do. A larger batch keeps more workers busy,
        and pays where the noise scale says its samples are not wasted."""
        plans: dict[int, Plan] = {}
        refused: dict[int, PlacementError] = {}
        for batch in self.job.batch_sizes:
            try:
                plans[batch] = self._at_batch(batch)._plan_at_batch()
            except PlacementError as error:
                refused[batch] = error
        if not plans:
            raise refused[self.job.global_batch_size] if self.job.global_batch_size in refused else next(iter(refused.values()))
        best = min(plans, key=lambda batch: _plan_score(plans[batch], self.job))
        others = [f"{batch}: {_workers(plans[batch])}, {self._predicted(plans[batch])}" for batch in plans if batch != best]
        others += [f"{batch}: refused, {error.what}" for batch, error in refused.items()]
        note = (f"{self.job.objective.value} took global batch {best} on {_workers(plans[best])}"
                + (f" (other batches: {'; '.join(others)})" if others else ""))
        return dataclasses.replace(plans[best], notes=[*plans[best].notes, note])

    def _at_batch(self, batch: int) -> Planner:
        """This planner with the job's global batch set to `batch` (the costing's caches carry over)."""
        other = copy.copy(self)
        other.job = dataclasses.replace(self.job, global_batch_size=batch, batch_sizes=(batch,))
        other.costing = self.costing.with_batch(other.job)
        return other

    def _predicted(self, plan: Plan) -> str:
        """What the objective weighs of a plan, for notes comparing it with the chosen one."""
        predicted = plan.predicted
        if self.job.objective == Objective.GOODPUT:
            return (f"{predicted.goodput_tokens_per_second:,.0f} goodput tokens/s "
                    f"(efficiency {predicted.statistical_efficiency:.2f}), {predicted.step_seconds * 1e3:.1f} ms a step")
        if self.job.objective == Objective.CHEAPEST_TO_TARGET:
            return (f"{_dollars(predicted.dollars_to_target)} to the target "
                    f"(efficiency {predicted.statistical_efficiency:.2f}), {predicted.step_seconds * 1e3:.1f} ms a step")
        return (f"{predicted.step_seconds * 1e3:.1f} ms a step, "
                f"{_dollars(predicted.dollars_per_million_tokens)} per million tokens")

    def _plan_at_batch(self) -> Plan:
        for _ in range(EXACT_MEMORY_RETRIES):
            choice = self._search_for_hook()
            try:
                return self.build(choice.outcome, choice.costing, notes=self._notes(choice))
            except _Overrun as overrun:  # the interpolation was optimistic: cap that device exactly, search again
                # Every costing derived from self.costing shares its micro-batch limits.
                choice.costing.limit_micro_batch(overrun.device, self._exact_fit(overrun, choice))
                failed = overrun
        raise PlacementError(f"the exact memory estimate of micro-batch {failed.micro_batch} does not fit "
                             f"{failed.device.label}", where="[train] micro_batch_size",
                             fix=f"set micro_batch_size below {failed.micro_batch}")

    def _exact_fit(self, overrun: _Overrun, choice: _Choice) -> int:
        """The largest micro-batch below the one that overran whose exact peak fits the device."""
        outcome = choice.outcome
        return self.memory.max_micro_batch(
            choice.costing.capacity_for_step(overrun.device, outcome.data_parallel, outcome.devices),
            data_parallel=outcome.data_parallel.value, world_size=choice.costing.sharded_over(outcome),
            tensor_parallel_size=self.job.tensor_parallel_size, accumulating=outcome.split.grad_accum_steps > 1,
            limit=overrun.micro_batch - 1, exact=True)

    def _search_for_hook(self) -> _Choice:
        """search() under the configured comm hook. Under "auto": under plain all-reduce and, where the
        rules allow it, the bf16 hook, which is taken only for a step AUTO_BF16_MIN_GAIN shorter."""
        if self.config.parallel.comm_hook != "auto":
            return _Choice(self.search(self.costing), self.costing)
        plain_costing = self.costing.with_comm_hook(CommHookCost.plain(self.job.gradient_bytes))
        plain = self.search(plain_costing)
        if not self._hook_allowed("bf16"):
            return _Choice(plain, plain_costing)
        bf16_costing = plain_costing.with_comm_hook(CommHookCost.for_job(self.config, "bf16"))
        bf16 = self.search(bf16_costing)
        if bf16.step_seconds <= (1 - AUTO_BF16_MIN_GAIN) * plain.step_seconds and bf16.score <= plain.score:
            return _Choice(bf16, bf16_costing, f"comm_hook = auto took bf16: a predicted {bf16.step_seconds * 1e3:.1f} "
                                               f"ms step against {plain.step_seconds * 1e3:.1f} ms with plain all-reduce")
        return _Choice(plain, plain_costing)

    def _hook_allowed(self, name: str) -> bool:
        """Whether the rules (core/rules.py) let this job run comm hook `name` in place of its own."""
        config = self.config
        compiled_autograd = config.compile.uses_compiled_autograd
        refusal = rules.comm_hook_refusal(name, backend=config.gradient_backend, strategy=config.parallel.strategy,
                                          bf16_weights=config.train.bf16_weights, compiled_autograd=compiled_autograd)
        if refusal is None and config.parallel.overlap == "next_forward":
            refusal = rules.overlap_refusal(strategy=config.parallel.strategy, hook=name,
                                            grad_clip=config.train.grad_clip, precision=config.train.precision,
                                            bf16_weights=config.train.bf16_weights, compiled_autograd=compiled_autograd)
        return refusal is None

    def search(self, costing: Costing) -> Outcome:
        """The best candidate the greedy paths and hill climbing find under `costing` (raises
        PlacementError if none). Reads nothing but the costing and the planner's fixed classes."""
        evaluated: dict[tuple[int, ...], Outcome | Refusal] = {}
        best: Outcome | None = None

        def visit(counts: tuple[int, ...]) -> Outcome | Refusal:
            nonlocal best
            if counts not in evaluated:
                evaluated[counts] = costing.evaluate(self._footprint(counts))
                outcome = evaluated[counts]
                if self._acceptable(outcome) and (best is None or outcome.score < best.score):
                    best = outcome
            return evaluated[counts]

        for start in [None, *range(len(self.classes))]:
            counts = tuple(0 for _ in self.classes)
            if start is not None:
                counts = self._grow(counts, start, fine=False) or counts
            while True:
                moves = [m for c in range(len(self.classes)) for fine in self._fine
                         if (m := self._grow(counts, c, fine=fine)) is not None]
                if not moves:
                    break
                counts = min(moves, key=lambda m: _guide(visit(m)))
        if best is None:
            raise self._why_nothing_fits(evaluated)
        counts = self._counts_of(best.selection)
        for _ in range(REFINE_ROUNDS):
            neighbours = [m for c in range(len(self.classes)) for fine in self._fine for grow in (True, False)
                          if (m := (self._grow if grow else self._shrink)(counts, c, fine=fine)) is not None]
            # Leaving a whole class out is one move, not one per device: slow links cost as a class.
            neighbours += [counts[:c] + (0,) + counts[c + 1:] for c in range(len(self.classes)) if counts[c]]
            if len(self._fine) > 1:  # small pools: also trade one device of a class for one of another
                neighbours += [m for a in range(len(self.classes)) for b in range(len(self.classes)) if a != b
                               and (grown := self._grow(counts, a, fine=True)) is not None
                               and (m := self._shrink(grown, b, fine=True)) is not None]
            for m in neighbours:
                visit(m)
            better = self._counts_of(best.selection)
            if better == counts:
                break
            counts = better
        return best

    def exhaustive(self, costing: Costing | None = None) -> Outcome:
        """The optimum of the same cost model (`costing`, the configured hook's by default) over every
        number of devices from every domain, and every feasible accumulation count. Devices of one
        domain are interchangeable in the model, so this covers every subset of devices. Exponential:
        for clusters of a few domains."""
        costing = costing or self.costing
        unit = self.job.tensor_parallel_size
        ranges = [range(0, d.size // unit * unit + 1, unit) for d in self.pool.domains]
        best: Outcome | None = None
        for counts in product(*ranges):
            if not self._in_range(sum(counts)) or sum(counts) == 0:
                continue
            selection = tuple((i, k) for i, k in enumerate(counts) if k)
            outcome = costing.evaluate(selection, all_accumulations=True)
            if self._acceptable(outcome) and (best is None or outcome.score < best.score):
                best = outcome
        if best is None:
            raise PlacementError("no subset of devices can run the job", where="[placement]",
                                 fix="see `archipelago plan` for the constraint that fails")
        return best

    def naive(self, world_size: int | None = None, global_batch_size: int | None = None) -> Plan | None:
        """What `ScalingConfig(num_workers=N, use_gpu=…)` does without a plan: Ray packs N workers
        onto the nodes in order (PACK), each takes the next whole GPU by index, every worker gets
        the config's micro-batch (lowered until it fits the smallest device and divides the batch),
        DDP all-reduces flat with its default 25 MiB buckets. N defaults to every whole GPU (CPU
        slot); the batch to [train]'s (a goodput plan's own, to compare like with like). None when N
        devices are not there or no uniform micro-batch fits."""
        if global_batch_size is not None and global_batch_size != self.job.global_batch_size:
            return self._at_batch(global_batch_size).naive(world_size)
        order = [(i, d) for i, d in enumerate(self.pool.domains) if d.type.kind != DeviceKind.MIG]
        wanted = world_size or sum(d.size for _, d in order)
        selection, left = [], wanted
        for index, domain in order:
            take = min(left, domain.size)
            if take:
                selection.append((index, take))
                left -= take
        if left:
            return None
        types = {self.pool.domains[i].type for i, _ in selection}
        costing = self.costing
        if self.config.parallel.comm_hook == "auto":  # unplanned: DDP's own all-reduce
            costing = costing.with_comm_hook(CommHookCost.plain(self.job.gradient_bytes))
        for micro_batch in range(self.job.micro_batch_limit, 0, -1):
            outcome = costing.evaluate(tuple(selection), uniform_micro_batch=micro_batch, planned_comm=False)
            if isinstance(outcome, Outcome):
                what = "whole GPUs" if self.job.use_gpu else "CPU slots"
                note = (f"Ray's PACK order: {wanted} {what} in node and index order, micro-batch "
                        f"{micro_batch} for every worker ({', '.join(sorted(t.label for t in types))})")
                try:
                    return self.build(outcome, costing, notes=[note],
                                      bucket_bytes={"default": DDP_DEFAULT_BUCKET_BYTES})
                except _Overrun:  # the exact estimate is larger than the profile's: a smaller one
                    continue
        return None

    # ---- candidates ------------------------------------------------------------------------------
    def _classes(self) -> list[list[int]]:
        """Domain indices grouped into classes of interchangeable domains, best first within a class
        (fastest network), classes in the objective's order of preference."""
        usable = [i for i, d in enumerate(self.pool.domains) if self._usable(d)]
        classes: dict[tuple, list[int]] = defaultdict(list)
        for i in sorted(usable, key=lambda i: -self.pool.domains[i].network_hop.bytes_per_s):
            classes[self.pool.domains[i].class_key()].append(i)
        cheap = self.job.objective in DOLLAR_OBJECTIVES

        def preference(members: list[int]) -> tuple:
            device = self.pool.domains[members[0]].type
            speed = device.peak_tflops
            price = self.costing.price(device)
            return (-(speed / price) if cheap and price > 0 else 0.0, -speed)
        return sorted(classes.values(), key=preference)

    def _usable(self, domain: Domain) -> int:
        """Devices of `domain` the job can use: whole tensor-parallel groups, which need NVLink, of
        devices that have float8 where the job trains in it."""
        unit = self.job.tensor_parallel_size
        if unit > 1 and not domain.nvlink:
            return 0
        if self.job.float8 and not _has_float8(domain.type):
            return 0
        return domain.size // unit * unit

    def _grow(self, counts: tuple[int, ...], c: int, *, fine: bool) -> tuple[int, ...] | None:
        """counts with more devices of class c: one device (fine) or a chunk of domains growing
        with the class's size, cut down to the device limit. None when nothing can be added."""
        room = self._capacity[c] - counts[c]
        unit = self.job.tensor_parallel_size  # counts stay whole tensor-parallel groups
        limit = (self.job.max_devices - sum(counts)) // unit * unit if self.job.max_devices else room
        domain = self._unit_of_class[c]
        step = self.job.tensor_parallel_size if fine else domain * max(1, counts[c] // domain // 4)
        if not fine and counts[c] % domain:
            step = domain - counts[c] % domain  # complete the partly used domain first
        step = min(step, room, limit)
        if step <= 0:
            return None
        return counts[:c] + (counts[c] + step,) + counts[c + 1:]

    def _shrink(self, counts: tuple[int, ...], c: int, *, fine: bool) -> tuple[int, ...] | None:
        domain = self._unit_of_class[c]
        step = self.job.tensor_parallel_size if fine else (counts[c] % domain or domain)
        if counts[c] - step < 0 or step <= 0:
            return None
        return counts[:c] + (counts[c] - step,) + counts[c + 1:]

    def _footprint(self, counts: tuple[int, ...]) -> Footprint:
        """The candidate `counts` (devices per class), packed: whole domains first, in class order."""
        domains, taken = [], []
        for c, count in enumerate(counts):
            unit = self._unit_of_class[c]
            full, partial = divmod(count, unit)
            used = self._class_domains[c][:full + (partial > 0)]
            domains.append(used)
            taken.append(np.full(len(used), unit, dtype=np.int64))
            if partial:
                taken[-1][-1] = partial
        return self.costing.footprint(np.concatenate(domains), np.concatenate(taken))

    def _counts_of(self, selection: Selection) -> tuple[int, ...]:
        class_of = {i: c for c, members in enumerate(self.classes) for i in members}
        counts = [0] * len(self.classes)
        for i, k in selection:
            counts[class_of[i]] += k
        return tuple(counts)

    def _acceptable(self, outcome: Outcome | Refusal) -> bool:
        """Runs, within the device range, and (cheapest_under_deadline) before the deadline."""
        return isinstance(outcome, Outcome) and self._in_range(outcome.devices) and math.isfinite(outcome.score[0])

    def _in_range(self, devices: int) -> bool:
        return devices >= self.job.min_devices and (not self.job.max_devices or devices <= self.job.max_devices)

    # ---- refusals --------------------------------------------------------------------------------
    def _check_feasible(self) -> None:
        """The refusals that need only the device pool, the job and the prices (not the memory profile)."""
        job, pool = self.job, self.pool
        what = "GPUs and MIG slices" if job.use_gpu else f"CPU worker slots of {job.cpus_per_worker} cores"
        if pool.device_count == 0:
            raise self._why_no_devices(what)
        if job.float8 and not any(_has_float8(d.type) for d in pool.domains):
            models = sorted({d.type.label for d in pool.domains})
            raise PlacementError(f"float8 needs GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                                 f"the cluster has {', '.join(models)}", where="[train] precision",
                                 fix='use precision = "bf16" on these GPUs')
        unit = job.tensor_parallel_size
        if unit > 1:
            largest = max((d for d in pool.domains if d.nvlink), key=lambda d: d.size, default=None)
            if largest is None or largest.size < unit:
                have = f"the largest has {largest.size} GPUs ({largest.domain_id})" if largest else "there are none"
                raise PlacementError(f"tensor_parallel_size {unit} needs an NVLink island of {unit} whole GPUs; "
                                     f"{have}", where="[placement] tensor_parallel_size",
                                     fix=f"set tensor_parallel_size to at most {largest.size if largest else 1}"
                                         ", or use fully sharded data parallelism ([parallel] strategy = \"fsdp\")")
            self._check_range_holds_groups()
        usable = sum(self._usable(domain) for domain in pool.domains)
        if usable < job.min_devices:
            key = "[placement] min_gpus" if job.use_gpu else "[cluster] num_workers"
            raise PlacementError(f"asks for {job.min_devices} workers; the cluster has {usable} usable {what}",
                                 where=key, fix=f"set {key.split()[-1]} to at most {usable}, or add nodes")
        if job.min_devices > job.global_batch_size * unit:
            raise PlacementError(f"{job.min_devices} workers but a global batch of {job.global_batch_size}: some "
                                 "would train on nothing", where="[train] global_batch_size",
                                 fix=f"raise global_batch_size to at least {job.min_devices // unit}")
        missing = sorted({d.type.model for d in pool.domains
                          if self.prices.dollars_per_hour(d.type.model, spot=job.spot) is None})
        if missing and job.objective in DOLLAR_OBJECTIVES:
            raise PlacementError(f"no price for {', '.join(missing)}", where="[placement] prices",
                                 fix=f"add them, e.g. prices = {{ \"{missing[0]}\" = 2.0 }} (dollars per hour)")

    def _check_range_holds_groups(self) -> None:
        """A GPU range with no multiple of tensor_parallel_size in it: no count of whole groups can run."""
        job, unit = self.job, self.job.tensor_parallel_size
        lowest = -(-job.min_devices // unit) * unit
        if job.max_devices and lowest > job.max_devices:
            raise PlacementError(f"min_gpus = {job.min_devices} to max_gpus = {job.max_devices} holds no multiple of "
                                 f"tensor_parallel_size = {unit}", where="[placement] max_gpus",
                                 fix=f"set max_gpus to {lowest} (whole tensor-parallel groups), or tensor_parallel_size "
                                     "to a size that divides a GPU count in the range")

    def _why_no_devices(self, what: str) -> PlacementError:
        """Why the pool is empty, in the cluster's own terms: GPUs nothing describes, GPUs that are all
        unreadable or in MIG mode, or really no GPUs (or CPU slots) at all."""
        if not self.job.use_gpu:
            return PlacementError(f"the cluster has no {what}", where="topology",
                                  fix="lower [cluster] cpus_per_worker to what a node has")
        gpus = [gpu for _, gpu in self.topology.gpus()]
        if self.pool.unknown:
            return _unknown_gpus_error(self.pool.unknown)
        if not gpus:
            return PlacementError(f"the cluster has no {what}", where="topology",
                                  fix="set [cluster] use_gpu = false to train on CPUs, or map the GPU nodes")
        unreadable = sum(1 for gpu in gpus if gpu.error)
        mig = sum(1 for gpu in gpus if gpu.mig_enabled and not gpu.error)
        reasons = [f"{unreadable} NVML could not read (see `archipelago topology`)"] if unreadable else []
        if mig:
            reasons.append(f"{mig} in MIG mode" + (", and [placement] use_mig = false" if not self.job.use_mig
                                                   else " with no MIG slices created"))
        return PlacementError(f"none of the cluster's {len(gpus)} GPUs can take a worker: {'; '.join(reasons)}",
                              where="topology", fix="set [placement] use_mig = true, or create MIG slices on the "
                                                    "GPUs in MIG mode, or fix the unreadable GPUs")

    def _why_nothing_fits(self, evaluated: dict) -> PlacementError:
        """Names the constraint that failed for the candidate that came closest, and what would fit."""
        job = self.job
        outcomes = [o for o in evaluated.values() if isinstance(o, Outcome)]
        if job.objective == Objective.CHEAPEST_UNDER_DEADLINE and outcomes:
            fastest = min(outcomes, key=lambda o: o.step_seconds)
            return PlacementError(
                f"no plan finishes {job.steps} steps within {job.deadline_hours:g} h: the fastest takes "
                f"{fastest.job_hours(job):.2f} h on {fastest.devices} devices", where="[placement] deadline_hours",
                fix=f"raise deadline_hours to {math.ceil(fastest.job_hours(job) * 100) / 100:g}, lower [train] steps, "
                    "or raise max_gpus")
        refusal = max((o for o in evaluated.values() if isinstance(o, Refusal)), key=lambda r: r.devices,
                      default=Refusal("no candidate", "", 0))
        if outcomes:
            most = max(o.devices for o in outcomes)
            larger = f" (on {refusal.devices}: {refusal.constraint})" if refusal.devices > most else ""
            return PlacementError(f"every plan that runs uses fewer than min_gpus = {job.min_devices} devices{larger}",
                                  where="[placement] min_gpus",
                                  fix=f"lower min_gpus to {most}" + (f", or {refusal.fix}" if larger and refusal.fix else ""))
        return PlacementError(refusal.constraint, where="[placement]", fix=refusal.fix or self._memory_fix())

    def _memory_fix(self) -> str:
        """What would make the model fit: a smaller micro-batch, FSDP over enough workers, checkpointing."""
        job = self.job
        largest = max(self.pool.domains, key=lambda d: d.type.memory_bytes).type
        usable = usable_bytes(largest.memory_bytes, self.memory.spec.device_type)
        need = self.memory.peak_bytes(1, data_parallel="ddp", world_size=2)
        fixes = [f"at micro-batch 1 a DDP worker needs {need / 2**30:.1f} GiB and the largest device "
                 f"({largest.label}) can give {usable / 2**30:.1f} GiB"]
        shards = next((n for n in (2 ** k for k in range(1, 17)) if n <= self.pool.device_count and
                       self.memory.peak_bytes(1, data_parallel="fsdp", world_size=n) <= usable), None)
        if shards and DataParallel.FSDP not in job.strategies:
            fixes.append(f"set [parallel] strategy = \"fsdp\" (fits from {shards} workers)")
        elif shards:
            fixes.append(f"use at least {shards} workers (min_gpus) so FSDP shards enough")
        if self.memory.spec.activation_checkpointing == "off":
            fixes.append("set [parallel] activation_checkpointing = \"full\"")
        fixes.append("lower [train] micro_batch_size or [model] seq_len, or use GPUs with more memory")
        return "; ".join(fixes)

    def _notes(self, choice: _Choice) -> list[str]:
        best, costing = choice.outcome, choice.costing
        notes = list(self.pool.notes)
        facts = model_facts(make_workload(self.config.model), self.job.seq_len)
        if not facts.counted:
            notes.append(f"FLOPs per token estimated as 6 × {facts.parameters:,} parameters, not counted: the model's "
                         "loss does not run on meta tensors (nor fake ones), so the step times, MFU and dollars "
                         "rest on that estimate")
        calibrated = self.calibration.describe({self.pool.domains[i].type.model for i, _ in best.selection},
                                               {hop.link_class for hop in best.hops.values()})
        if self.calibration.path and calibrated:
            notes.append(calibrated)
        if self.pool.unknown:
            notes.append(f"left out GPUs nothing gives figures for ({_listed(self.pool.unknown)}): "
                         f"{_unknown_gpus_error(self.pool.unknown).fix}")
        nodes = {device.node.node_id for i, k in best.selection for device in self.pool.domains[i].devices[:k]}
        guessed = sorted(nodes & self.pool.guessed_networks)
        if len(nodes) > 1 and guessed:
            notes.append(f"NIC speed unknown on {', '.join(guessed[:4])}: planned as 10 Gbit/s Ethernet")
        used = {self.pool.domains[i].type.label for i, _ in best.selection}
        unused = sorted({d.type.label for d in self.pool.domains} - used)
        if unused:
            reason = {Objective.FASTEST: "slower", Objective.GOODPUT: "slower in goodput",
                      Objective.CHEAPEST_TO_TARGET: "dearer to the target"}.get(self.job.objective, "dearer per token")
            notes.append(f"left out {', '.join(unused)}: adding them made the plan {reason}")
        notes.extend(self._no_fast_path_notes({self.pool.domains[i].type.model for i, _ in best.selection}))
        if best.split.grad_accum_steps > 1:
            notes.append(self._accumulation_note(best, costing))
        if choice.note:
            notes.append(choice.note)
        if self.job.objective in GOODPUT_OBJECTIVES:
            notes.append(self.job.statistics.describe())
        hook = costing.comm_hook
        if hook.compresses and best.bucketing is not None:
            share = f"{hook.wire_bytes / 1e6:.1f} MB a step ({hook.wire_bytes / hook.buffer_bytes:.1%} of its " \
                    f"{hook.buffer_bytes / 1e6:.1f} MB of gradient buckets)"
            sends = (f"each rank sends {share} and receives as much from every other by all-gather"
                     if hook.all_gather else f"each rank all-reduces {share}")
            notes.append(f"comm hook {hook.name}: {sends}; its own work adds {best.hook_compute_seconds * 1e3:.1f} ms "
                         "a step (costed as after its plain all-reduce warm-up)")
        notes.extend(self._hook_advice(best, costing))
        notes.extend(self._topk_wire_advice(best, costing))
        notes.extend(self._overlap_notes(best))
        if best.backend == "gloo" and self.job.use_gpu:
            notes.append("several MIG slices of one GPU: NCCL runs one rank per GPU, so gradients are reduced "
                         "with gloo through host memory")
        return notes

    def _accumulation_note(self, best: Outcome, costing: Costing) -> str:
        """Why the plan runs several micro-steps, from what the search could cost on its devices and strategy:
        fewer need micro-batches above the memory or [train] micro_batch_size caps, or they fit and were slower."""
        steps = best.split.grad_accum_steps
        fewer = [a for a in range(1, steps) if self._accumulation_fits(best, costing, a)]
        if fewer:  # the search costs the fewest steps that fit, so this one lost on its predicted step
            one = "one step" if fewer[0] == 1 else f"{fewer[0]} steps"
            return f"{steps} accumulation steps: predicted faster than {one} of larger micro-batches, which fit too"
        nearest = max(a for a in range(1, steps) if self.job.global_batch_size % a == 0)
        caps = self._micro_batch_caps(best, costing, accumulating=nearest > 1)
        limit = self.job.micro_batch_limit
        memory = [f"{cap} on {device.label}" for device, cap in caps.items() if cap < limit]
        capped = [device.label for device, cap in caps.items() if cap >= limit]
        reasons = [f"memory allows ({', '.join(memory)})"] if memory else []
        if capped:
            reasons.append(f"[train] micro_batch_size = {limit}" + (f" (on {', '.join(capped)})" if memory else ""))
        return f"{steps} accumulation steps: fewer would need micro-batches larger than {' and '.join(reasons)}"

    def _accumulation_fits(self, best: Outcome, costing: Costing, steps: int) -> bool:
        """Whether `steps` micro-steps split the global batch within every replica's cap, as the search's split does."""
        caps = self._micro_batch_caps(best, costing, accumulating=steps > 1)
        if min(caps.values()) < 1:
            return False
        footprint = best.footprint
        groups = [costing.replica_group(device, footprint.replicas[device], cap, footprint.tp_hop)
                  for device, cap in caps.items()]
        return steps in feasible_accum_steps(groups, self.job.global_batch_size)

    @staticmethod
    def _micro_batch_caps(best: Outcome, costing: Costing, *, accumulating: bool) -> dict[DeviceType, int]:
        """Each device type's largest micro-batch under the plan's strategy: its memory's, or micro_batch_size."""
        world = costing.sharded_over(best)
        return {device: costing.micro_batch_cap(device, best.data_parallel, world, accumulating) for device in best.types}

    def _no_fast_path_notes(self, models: set[str]) -> list[str]:
        """GPU models of the plan the catalog gives no 16-bit tensor rate: costed at fp32, which a bf16
        job on them would not reach (the workers emulate bf16)."""
        if self.job.compute_dtype != "bf16":
            return []
        slow = sorted(key for key in models if (model := catalog.find(key)) is not None
                      and not ({"bf16", "fp16"} & set(model.peak_tflops)))
        return [f"{key} has no bf16 or fp16 tensor cores: costed at its fp32 rate; set [train] precision = "
                '"fp32" to train at it' for key in slow]

    def _hook_advice(self, best: Outcome, costing: Costing) -> list[str]:
        """Where plain all-reduce leaves the step waiting on the wire, what each compressing hook the
        config allows would do on the same devices, if it shortens the step. A hint, not a choice:
        compression changes the loss."""
        exposed = best.exposed_communication_seconds / best.step_seconds if best.step_seconds else 0.0
        if costing.comm_hook.compresses or exposed < HOOK_ADVICE_EXPOSED_SHARE:
            return []
        steps = []
        for name in COMPRESSING_HOOKS:
            if not self._hook_allowed(name):
                continue
            outcome = costing.with_comm_hook(CommHookCost.for_job(self.config, name)).evaluate(best.footprint)
            if isinstance(outcome, Outcome) and outcome.step_seconds < best.step_seconds:
                steps.append(f"{name} {outcome.step_seconds * 1e3:.1f} ms")
        return [f"the step waits {exposed:.0%} of its {best.step_seconds * 1e3:.1f} ms on gradient communication; "
                f"predicted with [parallel] comm_hook = {', '.join(steps)} (per step: compression can cost "
                "loss, benchmarks/RESULTS.md)"] if steps else []

    def _overlap_notes(self, best: Outcome) -> list[str]:
        """What becomes of [parallel] overlap = "next_forward" on this plan: nothing to overlap with
        one data-parallel worker, and otherwise a step the prediction does not cost."""
        if self.config.parallel.overlap != "next_forward":
            return []
        if best.devices // self.job.tensor_parallel_size <= 1:
            return ['[parallel] overlap = "next_forward" is ignored: one data-parallel worker exchanges no gradients']
        return ['[parallel] overlap = "next_forward" is not costed: the prediction is plain DDP\'s step (on two '
                "H200s the overlap measured 0.88x to 1.03x of it, by model, link and wire; benchmarks/RESULTS.md)"]

    def _topk_wire_advice(self, best: Outcome, costing: Costing) -> list[str]:
        """For topk, the step with its places sent the other way on the same devices, where that is
        shorter: Elias–Fano's smaller wire against the encode and per-rank decode it costs."""
        if costing.comm_hook.name != "topk":
            return []
        other = "offsets" if self.config.parallel.topk_wire == "elias_fano" else "elias_fano"
        hook = CommHookCost.for_job(self.config, "topk", topk_wire=other)
        outcome = costing.with_comm_hook(hook).evaluate(best.footprint)
        if not (isinstance(outcome, Outcome) and outcome.step_seconds < best.step_seconds):
            return []
        return [f'[parallel] topk_wire = "{other}" is predicted at {outcome.step_seconds * 1e3:.1f} ms a step '
                f"against {best.step_seconds * 1e3:.1f} ms (each rank sends {hook.wire_bytes / 1e6:.1f} MB a step "
                f"instead of {costing.comm_hook.wire_bytes / 1e6:.1f})"]

    # ---- the plan --------------------------------------------------------------------------------
    def build(self, outcome: Outcome, costing: Costing, *, notes: list[str],
              bucket_bytes: dict[str, int] | None = None) -> Plan:
        """The Plan of `outcome`, scored under `costing` (whose comm hook the workers run); bucket_bytes
        replaces the buckets the costing would choose (an unplanned run's DDP default)."""
        job, t = self.job, self.job.tensor_parallel_size
        devices: list[tuple[Device, Domain]] = [(device, self.pool.domains[i]) for i, k in outcome.selection
                                                for device in self.pool.domains[i].devices[:k]]
        sizes = {d: iter(outcome.split.per_replica(g)) for g, d in enumerate(outcome.types)}
        micro_batches = []
        for replica in range(len(devices) // t):
            micro_batches += [next(sizes[devices[replica * t][0].type])] * t
        peaks = self._peaks(outcome, costing, devices, micro_batches)
        affinity = _numa_shares(devices)
        accum = outcome.split.grad_accum_steps
        workers = [WorkerPlacement(
            rank=rank, node_id=device.node.node_id, device_uuid=device.uuid, device_kind=device.type.kind,
            device_model=device.type.label, island_id=device.island_id, micro_batch_size=micro_batches[rank],
            grad_accum_steps=accum, data_parallel_rank=rank // t, tensor_parallel_rank=rank % t,
            cpus=self.job.cpus_per_worker, cpu_affinity=affinity[rank], numa_node=device.numa_node,
            ray_node_id=device.node.ray_node_id,
            predicted_compute_seconds=accum * costing.replica_group(
                device.type, 1, 1, domain.intra_hop).micro_step_seconds(micro_batches[rank])
            + costing.optimizer_seconds(device.type, outcome.footprint, outcome.data_parallel),
            predicted_peak_memory_bytes=peaks[rank], memory_capacity_bytes=device.type.memory_bytes,
            gpu_index=_gpu_index(device), island_resource=_island_resource(device, domain),
            environment=nccl_environment(device.node, device.uuid) if self._nccl_nics(device) else {})
            for rank, (device, domain) in enumerate(devices)]
        islands: dict[int, list[int]] = defaultdict(list)
        for rank, (_, domain) in enumerate(devices):
            islands[id(domain)].append(rank)
        intra = list(islands.values())
        buckets = bucket_bytes if bucket_bytes is not None else costing.bucket_sizes(outcome)
        bottleneck = ("default" if bucket_bytes is not None else
                      outcome.hops["world"].link_class.value if "world" in outcome.hops else "")
        world = outcome.hops.get("world")
        prediction = self._prediction(outcome)
        choices = plan_choices(self.config, use_gpu=job.use_gpu, replicas=len(workers) // t,
                               data_parallel=outcome.data_parallel, comm_hook=costing.comm_hook.name,
                               backend=outcome.backend, bucket_bytes=buckets.get(bottleneck), prediction=prediction)
        return Plan(
            device_bases=self._device_bases(devices),
            job_name=job.name, objective=job.objective, workers=workers, global_batch_size=job.global_batch_size,
            seq_len=job.seq_len, grad_accum_steps=accum, data_parallel=outcome.data_parallel,
            tensor_parallel_size=t, allreduce=outcome.allreduce, intra_island_groups=intra,
            inter_island_groups=cross_island_groups(intra),
            tensor_parallel_groups=[list(range(r, r + t)) for r in range(0, len(workers), t)],
            data_parallel_groups=[list(range(j, len(workers), t)) for j in range(t)],
            ddp_bucket_bytes=buckets, bottleneck_link_class=bottleneck,
            bottleneck_gb_per_s=world.bytes_per_s / 1e9 if world else 0.0,
            bottleneck_alpha_us=world.alpha_s * 1e6 if world else 0.0,
            price_basis="spot" if job.spot else "on_demand", predicted=prediction, notes=notes, **choices)

    def _nccl_nics(self, device: Device) -> bool:
        """Whether the plan names NCCL's NICs for this device: whole GPUs and MIG slices, unless
        [placement] nccl_nics is off."""
        return self.config.placement.nccl_nics and device.uuid is not None and device.type.kind != DeviceKind.CPU

    def _device_bases(self, devices: list[tuple[Device, Domain]]) -> list[DeviceBasis]:
        """Per device model of the plan, where its figures came from (CPU slots of several nodes that share
        the label "cpu": the slowest)."""
        slowest: dict[str, DeviceType] = {}
        for device, _ in devices:
            known = slowest.get(device.type.label)
            if known is None or device.type.peak_tflops < known.peak_tflops:
                slowest[device.type.label] = device.type
        return [DeviceBasis(device_model=label, model=t.model, source=t.source.value, tflops=t.stated_tflops,
                            compute_efficiency=self.compute.efficiency_of(t.model)) for label, t in slowest.items()]

    def _peaks(self, outcome: Outcome, costing: Costing, devices: list, micro_batches: list[int]) -> list[int]:
        accumulating = outcome.split.grad_accum_steps > 1
        strategy = outcome.data_parallel.value
        if self.exact_memory:  # one fake model for every micro-batch the plan hands out
            measure_steps(self.memory.spec, tuple(sorted(set(micro_batches))))
        peaks = {}
        hook_state = int(costing.hook_state_bytes(outcome.data_parallel, len(devices)))
        for m in set(micro_batches):
            peaks[m] = hook_state + self.memory.peak_bytes(m, data_parallel=strategy,
                                                           world_size=costing.sharded_over(outcome),
                                                           tensor_parallel_size=self.job.tensor_parallel_size,
                                                           accumulating=accumulating, exact=self.exact_memory)
        for (device, _), m in zip(devices, micro_batches):
            if peaks[m] > usable_bytes(device.type.memory_bytes, self.memory.spec.device_type):
                raise _Overrun(device.type, m)
        return [peaks[m] for m in micro_batches]

    def _prediction(self, outcome: Outcome) -> Prediction:
        job, stats = self.job, self.job.statistics
        step, size = outcome.step_seconds, outcome.throughput(self.job)
        return Prediction(step_seconds=step, compute_seconds=outcome.compute_seconds,
                          exposed_communication_seconds=outcome.exposed_communication_seconds,
                          communication_seconds=outcome.communication_seconds,
                          tokens_per_second=job.tokens_per_step / step if step > 0 else 0.0,
                          dollars_per_hour=outcome.dollars_per_hour, dollars_per_step=outcome.dollars_per_step(),
                          dollars_per_million_tokens=outcome.dollars_per_million_tokens(job),
                          job_hours=outcome.job_hours(job), job_dollars=outcome.dollars_per_step() * job.steps,
                          statistical_efficiency=stats.efficiency(job.global_batch_size),
                          goodput_tokens_per_second=goodput_samples_per_second(size, stats) * job.seq_len,
                          dollars_to_target=dollars_to_target(size, stats) if stats.samples_to_target else 0.0)


def make_plan(topology: ClusterTopology, config: JobConfig, **kwargs) -> Plan:
    """Plans `config` on `topology` (see Planner for the keyword arguments)."""
    return Planner(topology, config, **kwargs).plan()


def _unknown_gpus_error(unknown: dict[str, int]) -> PlacementError:
    """The GPUs no [devices] table, measurement or catalog entry describes, and both ways to describe them."""
    named = {name: count for name, count in unknown.items() if name}
    if not named:
        return PlacementError(f"the cluster's {unknown['']} GPUs have no model name: the nvidia-smi text has no "
                              "`nvidia-smi -L` lines", where="topology",
                              fix="save `nvidia-smi -L; nvidia-smi topo -m` together, so the names come with "
                                  "the matrix")
    example = sorted(named)[0]
    return PlacementError(
        f"the cluster's GPUs are of models the device catalog lacks, with no measured or declared figures: "
        f"{_listed(unknown)}",
        where="topology",
        fix=f'describe each in the job config, e.g. [devices."{example}"] with bf16_tflops = (dense bf16 TFLOP/s), '
            "memory_gib = (GiB) and price = ($ per GPU-hour); or plan on a measured map: run `archipelago topology "
            "--local --json node.json` on one such machine and pass it with --topology (or plan on the live Ray "
            "cluster, whose probe measures every node)")


def _listed(unknown: dict[str, int]) -> str:
    """"8× NVIDIA GeForce RTX 3090, 2× unnamed" """
    return ", ".join(f"{count}× {name or 'unnamed'}" for name, count in sorted(unknown.items()))


def _has_float8(device: DeviceType) -> bool:
    """Whether the device has float8 tensor cores: compute capability 8.9 or newer by the catalog (a
    model the catalog does not know is let through; its worker checks the device itself)."""
    model = catalog.find(device.model)
    if model is None:
        return device.kind != DeviceKind.CPU
    major, minor = (int(part) for part in model.compute_capability.split("."))
    return (major, minor) >= (8, 9)


def _gpu_index(device: Device) -> int | None:
    return next((gpu.index for gpu in device.node.gpus if gpu.uuid == device.uuid), None)


def _island_resource(device: Device, domain: Domain) -> str:
    """The Ray resource `archipelago node-resources` advertises for the device's NVLink island of two or
    more GPUs on one node; "" elsewhere (fabric islands span nodes, PCIe GPUs and MIG slices have none)."""
    if not domain.nvlink or domain.fabric_id or len(domain.devices) < 2 or device.island_id is None:
        return ""
    return island_resource(device.island_id)


def _workers(plan: Plan) -> str:
    return f"{plan.world_size} worker{'s' * (plan.world_size != 1)}"


def _dollars(amount: float) -> str:
    """Cents where they matter, three figures where a sum is small: "$1,234.50", "$0.0123"."""
    return f"${significant(amount)}"


def _plan_score(plan: Plan, job: PlanningJob) -> tuple:
    """How whole plans (of different tensor-parallel sizes or global batches) rank under the job's
    objective: in Costing.score's order."""
    size = Throughput(plan.world_size, plan.global_batch_size, plan.predicted.step_seconds,
                      plan.predicted.dollars_per_hour)
    return rank(job, size)


def _guide(outcome: Outcome | Refusal) -> tuple:
    """How the greedy path ranks its next step: by score; a candidate that cannot run ranks last,
    the larger first (more devices is what lifts memory and batch refusals)."""
    if isinstance(outcome, Outcome):
        return (0, *outcome.score)
    return (1, -outcome.devices)


def _numa_shares(devices: list[tuple[Device, Domain]]) -> list[str]:
    """Each worker's CPUs: its device's NUMA-local cores, split evenly and without overlap among the
    plan's workers that share that NUMA node (CPU workers keep their slot's cores)."""
    sharing: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, (device, _) in enumerate(devices):
        if device.type.kind != DeviceKind.CPU and device.cpu_affinity:
            sharing[device.node.node_id, device.cpu_affinity].append(rank)
    shares = [device.cpu_affinity for device, _ in devices]
    for (_, cpus), ranks in sharing.items():
        for rank, share in zip(ranks, _split_cpus(cpus, len(ranks))):
            shares[rank] = share
    return shares


@functools.lru_cache(maxsize=1024)
def _split_cpus(cpus: str, parts: int) -> tuple[str, ...]:
    """`cpus` cut into `parts` equal, disjoint lists (the whole list for each when there are too few)."""
    cores = parse_cpu_list(cpus)
    per = len(cores) // parts
    if per == 0:
        return (cpus,) * parts
    return tuple(format_cpu_list(cores[k * per:(k + 1) * per]) for k in range(parts))
