"""Elastic runs: plan for the workers Ray actually grants, on every start, and account for each recovery.

Ray Train V2 restarts the whole worker group after a worker failure, a preemption or a resize and
runs the train function again with the same arguments, so the plan made before `trainer.fit()` can
name workers that are gone. On every start of a group:

    every worker                                   PlanCoordinator (named actor on the driver's node)
    WorkerReport.here(ctx) ─ all_gather ─► rank 0 ─► group_started(reports): the plan for exactly these
                                                     workers (the driver's plan when they match it)
    plan ◄── broadcast from rank 0
    restore, first step ─► rank 0 ─► first_step(step, marks): a "restart" event row with the timings

`FailureRecorder`, a Ray Train UserCallback on the controller, tells the coordinator when and how
workers failed: the start of a recovery, and the list a FailureBudgetError names. Event rows go to
the driver's MetricsSink like the workers' rows, so they land in metrics.jsonl and the report.

`ElasticState` holds the logic without Ray (unit tests drive it directly); `PlanCoordinator` is the
thin actor around it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.train import FailureConfig, UserCallback
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import planning
from core.config import JobConfig
from core.errors import ArchipelagoError, ClusterError, ConfigError, PlacementError, RepeatedFailureError
from core.plan import Plan
from core.spec import WorkerSpec
from orchestrator.accounting.bill import Rates
from planning.calibration import Calibration
from planning.memory import measure_steps
from topology.cluster import ClusterTopology, NodeTopology
from topology.discover import discover_cluster
from topology.sysfs import format_cpu_list, parse_cpu_list
from workers.elastic import WorkerReport
from workers.models import adopt_workload

COORDINATOR_NAME = "archipelago-plan-coordinator-{}"
"""Ray actor name, by run name: one coordinator per run."""
WORKER_DEATHS = ("ActorDiedError", "WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError",
                 "ActorUnavailableError", "NodeDiedError", "RayActorError", "OutOfMemoryError")
"""How Ray reports a worker process or node that is gone, or frozen past [elastic] health_check_timeout_s
(FailureRecorder prefixes the type's name)."""
COLLECTIVE_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
"""torch.distributed's errors: a peer's failure seen from a survivor, never the fault itself."""


@dataclass(frozen=True, slots=True)
class Failure:
    attempt: int
    """The worker group (1 = the first start) that failed."""
    time: float
    """Unix time the controller saw it."""
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    """Address (and short Ray node id) of each failed rank's node."""
    error: str
    """The first failed rank's error, first line."""
    preempted: bool = False
    """The group had a preemption notice: Ray charges this to max_preemption_failures."""

    def describe(self) -> str:
        where = ", ".join(f"rank {r} on {n}" for r, n in zip(self.ranks, self.nodes))
        return f"group {self.attempt}{' (preempted)' if self.preempted else ''}: {where}: {self.error}"


def granted_topology(nodes: list[NodeTopology], reports: list[WorkerReport], *, cpus_per_worker: int,
                     use_gpu: bool) -> ClusterTopology:
    """The cluster map cut down to what Ray granted: each node with only the devices its workers hold,
    so a plan for it with min = max = len(reports) workers puts one plan entry where each worker is.

    CPU nodes keep `workers × cpus_per_worker` cores. When several Ray nodes share one machine
    (ray.cluster_utils, one node per GPU group) the map cannot tell which cores Ray gives which node,
    so their workers are left unpinned rather than all pinned to the same first cores."""
    per_node = Counter(r.ray_node_id for r in reports)
    shared = Counter(node.hostname for node in nodes if node.ray_node_id in per_node)
    kept = []
    for node in nodes:
        workers = per_node.get(node.ray_node_id, 0)
        if not workers:
            continue
        if use_gpu:
            uuids = {u for r in reports if r.ray_node_id == node.ray_node_id for u in r.device_uuids}
            kept.append(dataclasses.replace(
                node, gpus=[g for g in node.gpus if g.uuid in uuids], mig_slices=[],
                links=[link for link in node.links if link.gpu_a in uuids and link.gpu_b in uuids]))
        else:
            kept.append(_cpu_share(node, workers, cpus_per_worker, unpinned=shared[node.hostname] > 1))
    return ClusterTopology(nodes=kept)


def _cpu_share(node: NodeTopology, workers: int, cores: int, *, unpinned: bool) -> NodeTopology:
    numa, need = [], workers
    for domain in [] if unpinned else node.numa_nodes:
        cpus = parse_cpu_list(domain.cpus)
        slots = min(need, len(cpus) // cores)
        if slots:
            numa.append(dataclasses.replace(domain, cpus=format_cpu_list(cpus[:slots * cores])))
            need -= slots
    return dataclasses.replace(node, cpu_count=workers * cores, numa_nodes=numa if not need else [])


def ray_cpu_slots(topology: ClusterTopology, cpus_per_worker: int) -> tuple[ClusterTopology, int]:
    """The map cut down to the CPU worker slots Ray can schedule (each node's Ray "CPU" resource, not
    the machine's cores: several Ray nodes may share a machine, and an embedded cluster may advertise
    more CPUs than cores to run the workers asked for), and how many slots that is."""
    reports = [WorkerReport(world_rank=0, local_rank=0, ray_node_id=node.ray_node_id, address=node.address)
               for node in topology.nodes
               for _ in range(int(node.ray_resources.get("CPU", node.cpu_count) // cpus_per_worker))]
    return granted_topology(topology.nodes, reports, cpus_per_worker=cpus_per_worker, use_gpu=False), len(reports)


PLACEMENT_NOTE_S = 30.0
"""How long the driver waits for a group's first row before it asks Ray whether the group is held back."""


def placement_wait_note(pending_bundles: list[dict[str, float]], available: dict[str, float],
                        total: dict[str, float], *, use_gpu: bool) -> str | None:
    """What to tell a user whose worker group Ray has not placed: the CPUs or GPUs its pending bundles ask for
    against those free (Ray waits silently, and forever unless they free up), or None when nothing is short."""
    needed: Counter = Counter()
    for bundle in pending_bundles:
        needed.update({k: v for k, v in bundle.items() if k in ("CPU", "GPU")})
    short = [f"{needed[k]:g} {k}s where the cluster has {available.get(k, 0):g} of its {total.get(k, 0):g} free"
             for k in ("GPU", "CPU") if needed[k] > available.get(k, 0)]
    if not short:
        return None
    knob = "lower [placement] max_gpus" if use_gpu else "lower [cluster] num_workers (or set [elastic] min_workers)"
    return (f"waiting for Ray to place {len(pending_bundles)} workers: they need {'; '.join(short)} "
            f"(other jobs or actors hold the rest; `ray status` lists the demands). The run starts once they are "
            f"free; to start now, stop what holds them or {knob}.")


def config_for_world(config: JobConfig, world_size: int) -> JobConfig:
    """The job with its device range pinned to `world_size`: what the planner plans for a granted group."""
    if config.cluster.use_gpu:
        placement = dataclasses.replace(config.placement, min_gpus=world_size, max_gpus=world_size)
        return dataclasses.replace(config, placement=placement)
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, num_workers=world_size))


def matches(plan: Plan, reports: list[WorkerReport]) -> bool:
    """The plan has one entry per granted worker, on the same nodes (and the same GPUs)."""
    if Counter(w.ray_node_id for w in plan.workers) != Counter(r.ray_node_id for r in reports):
        return False
    granted = {u for r in reports for u in r.device_uuids}
    return not granted or granted == {w.device_uuid for w in plan.workers}


class ElasticState:
    """The coordinator's logic: specs for granted groups, failures, and the timeline of each recovery.

    `spec` is what the first group runs (the driver's first plan); `plan_for(topology, config, noise_scale)`
    plans (planning.make_plan with a cached memory profile in the actor, and the gradient noise scale
    the run measured last, for the goodput objectives, or None); `discover()` maps the live cluster
    (called only when a granted node is not in the map yet: a node that keeps its Ray id keeps its
    hardware)."""

    def __init__(self, config: JobConfig, spec: WorkerSpec, nodes: list[NodeTopology], *,
                 plan_for: Callable[[ClusterTopology, JobConfig, float | None], Plan],
                 discover: Callable[[], ClusterTopology], clock: Callable[[], float] = time.time):
        self.config = config
        self.spec = spec
        """What the current group runs: rebuilt from each re-plan, never merged with the config on a worker."""
        self.nodes = {node.ray_node_id: node for node in nodes}
        self._plan_for, self._discover, self._clock = plan_for, discover, clock
        self.attempt = 0
        self.reports: list[WorkerReport] = []
        self.failures: list[Failure] = []
        self.fatal: ArchipelagoError | None = None
        """An error a worker raised for the user (bad data, a bad checkpoint): later groups stop at once."""
        self.last_step, self.last_step_at = 0, clock()
        self.noise_scale: float | None = None
        """The gradient noise scale rank 0 last reported: what a re-plan's goodput objective weighs batches by."""
        self.noticed_in = 0
        """The group that last had a preemption notice."""
        self._lost: Failure | None = None
        """The failure that ended the current group, until the next group starts."""
        self._raised: tuple[int, set[str]] | None = None
        """The last failure's step and the errors its workers raised (none when a worker died)."""
        self.tracebacks: dict[int, str] = {}
        """The traceback each rank sent as it raised (Ray hands the controller the error without it)."""
        self._recovery: dict | None = None

    @property
    def plan(self) -> Plan:
        return self.spec.plan

    # ---- what the workers and the controller tell it ----------------------------------------------
    def reached(self, step: int, at: float, noise_scale: float | None = None) -> None:
        self.last_step, self.last_step_at = step, at
        if noise_scale is not None:
            self.noise_scale = noise_scale

    def failed(self, errors: dict[int, str]) -> list[dict]:
        """The controller saw these ranks fail; [] when this group's failure was recorded already
        (the controller reports it on every poll until it restarts the group)."""
        if self._lost is not None or not errors:
            return []
        by_rank = {r.world_rank: r for r in self.reports}
        # A dead worker takes its peers' collectives down with it; name the dead, not the collateral.
        dead = [rank for rank, error in errors.items() if error.startswith(WORKER_DEATHS)]
        ranks = tuple(sorted(dead or errors))
        nodes = tuple(_node_name(by_rank[r]) if r in by_rank else "unknown node" for r in ranks)
        self._lost = Failure(self.attempt, self._clock(), ranks, nodes, errors[ranks[0]].strip().splitlines()[0][:300],
                             preempted=self.noticed_in == self.attempt)
        self.failures.append(self._lost)
        self._stop_if_repeated(errors, died=bool(dead) or self._lost.preempted)
        return [{"event": "worker_lost", "time": self._lost.time, "attempt": self.attempt, "step": self.last_step,
                 "ranks": list(ranks), "nodes": list(nodes), "error": self._lost.error,
                 "preempted": self._lost.preempted, "failures": len(self.failures)}]

    def _stop_if_repeated(self, errors: dict[int, str], *, died: bool) -> None:
        """Gives up (`fatal`) when the workers raise an error again at the step where the last group raised it:
        a restart met the same fault, so Ray's next retry would too (an index out of range in the model, a
        parameter DDP never sees a gradient for)."""
        raised = set() if died else {_error_line(e) for e in errors.values()} - {""}
        previous, self._raised = self._raised, (self.last_step, raised)
        again = sorted(raised & previous[1]) if previous is not None and previous[0] == self.last_step else []
        if again:
            rank = min(r for r, e in errors.items() if _error_line(e) == again[0])
            at = _raised_at(self.tracebacks.get(rank, errors[rank]))
            self.fatal = RepeatedFailureError(
                f"the workers failed twice with the same error, so restarting cannot fix it: {again[0]}"
                + (f" (raised at {at})" if at else ""), where=f"step {self.last_step + 1}, rank {rank}",
                fix="fix what raised it (each worker's traceback is in the Ray worker logs), then run again with --resume")

    def group_started(self, reports: list[WorkerReport]) -> tuple[WorkerSpec, list[dict]]:
        """A new group's workers (every rank's report): the spec they run, and the event rows."""
        if self.fatal is not None:
            raise self.fatal
        reports = sorted(reports, key=lambda r: r.world_rank)
        previous, lost = self.reports, self._lost
        self.attempt += 1
        self.reports, self._lost = reports, None
        now = self._clock()
        rows: list[dict] = []
        if previous and len(previous) != len(reports):
            rows.append({"event": "resize", "time": now, "attempt": self.attempt, "world_size": len(reports),
                         "previous_world_size": len(previous), "step": self.last_step,
                         "reason": "worker lost" if lost else "capacity changed"})
        replan_s = 0.0
        if not matches(self.plan, reports):
            self.spec = self.spec.with_plan(self._replan(reports))
            replan_s = self._clock() - now
            rows.append({"event": "replan", "time": now, "attempt": self.attempt, "world_size": len(reports),
                         "micro_batch_sizes": list(self.plan.replica_micro_batch_sizes()),
                         "grad_accum_steps": self.plan.grad_accum_steps, "comm_hook": self.plan.comm_hook,
                         "replan_s": replan_s,
                         "nodes": sorted({_node_name(r) for r in reports}),
                         "rates": dataclasses.asdict(Rates.from_plan(self.plan))})  # the bill's new prices
        if previous:
            self._recovery = {"lost": lost, "world_size": len(reports), "previous_world_size": len(previous),
                              "last_step": self.last_step, "last_step_at": self.last_step_at,
                              "started_at": min(r.started_at for r in reports), "replan_s": replan_s}
        return self.spec, rows

    def first_step(self, restored_step: int, marks: dict[str, float]) -> list[dict]:
        """Rank 0 finished the group's first step. marks (unix times on rank 0): planned, restore_start,
        restored, first_step_done. Returns the "restart" row (none for the run's first group)."""
        recovery, self._recovery = self._recovery, None
        if recovery is None:
            return []
        lost: Failure | None = recovery["lost"]
        began = lost.time if lost else recovery["started_at"]
        return [{"event": "restart", "time": marks["first_step_done"], "attempt": self.attempt,
                 "step": restored_step, "world_size": recovery["world_size"],
                 "previous_world_size": recovery["previous_world_size"],
                 "cause": ("preemption" if lost.preempted else "worker lost") if lost else "resize",
                 "steps_redone": max(0, recovery["last_step"] - restored_step),
                 "detect_s": lost.time - recovery["last_step_at"] if lost else None,
                 "startup_s": recovery["started_at"] - began,
                 "replan_s": recovery["replan_s"],
                 "setup_s": marks["restore_start"] - marks["planned"],
                 "restore_s": marks["restored"] - marks["restore_start"],
                 "recompile_s": marks["first_step_done"] - marks["restored"],
                 "recovery_s": marks["first_step_done"] - (recovery["last_step_at"] if lost else began)}]

    def failure_summary(self) -> str:
        return "; ".join(f.describe() for f in self.failures) or "no worker failure was recorded"

    # ---- planning ---------------------------------------------------------------------------------
    def _replan(self, reports: list[WorkerReport]) -> Plan:
        granted = {r.ray_node_id for r in reports}
        if granted - set(self.nodes):
            self.nodes.update({node.ray_node_id: node for node in self._discover().nodes})
        unknown = granted - set(self.nodes)
        if unknown:
            raise ClusterError(f"workers run on {len(unknown)} node(s) the topology probe did not map",
                               where=", ".join(sorted(unknown)), fix="check the nodes with `ray status`")
        cluster = self.config.cluster
        topology = granted_topology(list(self.nodes.values()), reports, cpus_per_worker=cluster.cpus_per_worker,
                                    use_gpu=cluster.use_gpu)
        try:
            return self._plan_for(topology, config_for_world(self.config, len(reports)), self.noise_scale)
        except (ConfigError, PlacementError) as e:  # ConfigError: the batch cannot be split over this many
            raise PlacementError(f"no plan for the {len(reports)} workers Ray granted: {e.what}", where=e.where,
                                 fix=e.fix or "narrow the [elastic] worker range") from None


def _error_line(error: str) -> str:
    """The line that says what was raised (a traceback's last), "" for a collective's error: a survivor's view of
    a peer that failed, whose words name addresses and ports that change from one group to the next."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return "" if line.startswith(COLLECTIVE_ERRORS) or error.startswith(COLLECTIVE_ERRORS) else line


def _raised_at(error: str) -> str:
    """Where a traceback's innermost frame is ("file.py:12 in forward"), "" when the error carries none."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', error)
    return f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""


def _node_name(report: WorkerReport) -> str:
    return f"{report.address} ({report.ray_node_id[:8]})"


class PlanCoordinator:
    """The Ray actor around ElasticState: one per fit, on the driver's node (it outlives any worker node),
    named after the run so tests and benchmarks can watch a run from outside (`status`)."""

    def __init__(self, config: JobConfig, spec: WorkerSpec, topology: ClusterTopology, plan_path: str, sink, memory,
                 calibration: Calibration):
        self.plan_path, self.sink, self.memory, self.calibration = plan_path, sink, memory, calibration
        adopt_workload(config.model, spec.workload)  # a factory from the driver's script is not importable here
        self.state = ElasticState(config, spec, topology.nodes, plan_for=self._plan_for, discover=_discover)
        self.events: list[dict] = []
        self.controller = None
        # Now, not during a recovery: the exact memory of every micro-batch a re-plan can hand out (the
        # planner checks its choice with them), and the planner's imports (torch and all).
        measure_steps(memory.spec, tuple(range(1, config.train.micro_batch_size + 1)))

    def group_started(self, reports: list[WorkerReport], controller=None) -> WorkerSpec:
        """controller: Ray Train's controller actor, which the driver asks to stop the workers on Ctrl-C."""
        self.controller = controller
        try:
            spec, rows = self.state.group_started(reports)
        except ArchipelagoError as e:  # a group that cannot be planned for: later groups stop at once too
            self.state.fatal = e
            raise
        if any(row["event"] == "replan" for row in rows):
            spec.plan.save(self.plan_path)
        self.record(rows)
        return spec

    def reached(self, step: int, at: float, noise_scale: float | None = None) -> None:
        self.state.reached(step, at, noise_scale)

    def raised(self, rank: int, traceback: str) -> None:
        """A worker's error, with its traceback, as it leaves the train function."""
        self.state.tracebacks[rank] = traceback

    def train_controller(self):
        """The handle group_started was given (None before the first group starts)."""
        return self.controller

    def failed(self, errors: dict[int, str]) -> None:
        self.record(self.state.failed(errors))

    def first_step(self, restored_step: int, marks: dict[str, float]) -> None:
        self.record(self.state.first_step(restored_step, marks))

    def give_up(self, error: ArchipelagoError) -> None:
        """A worker raised an error for the user (bad data, a bad checkpoint): the run stops (FailureRecorder),
        and a group started before it does stops at once."""
        self.state.fatal = error

    def fatal_error(self) -> ArchipelagoError | None:
        return self.state.fatal

    def record(self, rows: list[dict]) -> None:
        if any(row["event"] == "preemption" for row in rows):
            self.state.noticed_in = self.state.attempt
        if rows:
            self.events.extend(rows)
            self.sink.record.remote(rows)

    def current_plan(self) -> Plan:
        return self.state.plan

    def failures(self) -> list[Failure]:
        return list(self.state.failures)

    def status(self) -> dict:
        """For watching a run from outside: the group, its workers' pids and nodes, progress, events."""
        return {"attempt": self.state.attempt, "last_step": self.state.last_step,
                "world_size": len(self.state.reports), "workers": [dataclasses.asdict(r) for r in self.state.reports],
                "events": list(self.events)}

    def _plan_for(self, topology: ClusterTopology, config: JobConfig, noise_scale: float | None) -> Plan:
        return planning.make_plan(topology, config, memory=self.memory, calibration=self.calibration,
                                  measured_noise_scale=noise_scale)


def _discover() -> ClusterTopology:
    return discover_cluster()


def on_this_node():
    """A scheduling strategy that keeps an actor on this (the driver's) node: it must outlive any worker node."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def start_coordinator(config: JobConfig, spec: WorkerSpec, topology: ClusterTopology, plan_path: str, sink, memory,
                      calibration: Calibration):
    """Starts the run's PlanCoordinator on the driver's node; returns its handle. `memory`: the job's
    MemoryProfile (the slow part of planning, the same for every world size); `calibration`: the one
    the first plan used, read on the driver."""
    actor = ray.remote(num_cpus=0, max_restarts=0)(PlanCoordinator)
    return actor.options(name=COORDINATOR_NAME.format(config.name), scheduling_strategy=on_this_node()).remote(
        config, spec, topology, str(plan_path), sink, memory, calibration)


def failure_config(config: JobConfig):
    """Ray Train's FailureConfig from [elastic]: worker failures and preemptions on separate budgets."""
    elastic = config.elastic
    return FailureConfig(max_failures=elastic.max_failures, max_preemption_failures=elastic.max_preemption_failures,
                         preemption_grace_s=elastic.preemption_grace_s)


def failure_recorder(coordinator):
    """A Ray Train UserCallback (it runs on the controller) that tells the coordinator about failed workers, and
    stops the run at once when a worker failed on the user's data or checkpoint: that is no node failure, and
    every retry would fail the same way."""
    class FailureRecorder(UserCallback):
        def __init__(self, coordinator):
            self.coordinator = coordinator

        def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
            self.coordinator.failed.remote({rank: f"{type(e).__name__}: {e}" for rank, e in worker_exceptions.items()})
            # The worker told the coordinator before it raised (workers/loop.py train_loop). An exception from a
            # callback is a controller error to Ray Train 2.60, which its failure policy never retries.
            fatal = ray.get(self.coordinator.fatal_error.remote())
            if fatal is not None:
                raise fatal

    return FailureRecorder(coordinator)
