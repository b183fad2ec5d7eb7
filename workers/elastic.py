"""The worker's side of an elastic run: get this group's plan, heed preemption notices, keep the sample ledger.

    spec, node_rank = join_group(job.coordinator, ctx, use_gpu=…)   # every rank, first thing (collective)
    notice = PreemptionWatch(every_steps).check(step)           # every rank, same steps (collective)
    ledger = LedgerKeeper(enabled, restored_bytes, rank, replica, group)
    steps = loader.stream(ledger.tap(sampler.steps(...)));  ledger.trained(step);  extra = ledger.extra()

See orchestrator/coordinator.py for the driver's side.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from ray import cloudpickle
from ray.train.v2._internal.execution.context import get_train_context  # the controller's handle: no public API

from core.errors import ArchipelagoError
from core.spec import WorkerSpec
from storage.ledger import LEDGER_FILE, SampleLedger


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What one worker of a new group says about itself before it has a plan."""

    world_rank: int
    local_rank: int
    ray_node_id: str
    address: str
    """The node's IP, as Ray names it (for people reading the events)."""
    pid: int = 0
    """The worker's process id (tests and the recovery benchmark kill workers by it)."""
    device_uuids: tuple[str, ...] = ()
    """The GPUs Ray made visible to the worker (GPU-…); () on CPU workers."""
    started_at: float = 0.0
    """Unix time the train function began on this worker."""


def join_group(coordinator, ctx, *, use_gpu: bool, started_at: float) -> tuple[WorkerSpec, int]:
    """Tells the coordinator who this group is (gathered to rank 0); returns the spec it made for it
    (the group's plan and the job's settings) and this worker's index among the group's workers on its
    Ray node (what it claims its plan entry by).
    Ray Train's own local rank counts workers per IP address, which several Ray nodes of one machine
    share. An error from the coordinator (no plan fits, a fatal error earlier) is raised on every rank."""
    report = WorkerReport(world_rank=ctx.get_world_rank(), local_rank=ctx.get_local_rank(),
                          ray_node_id=ray.get_runtime_context().get_node_id(),
                          address=ray.util.get_node_ip_address(), pid=os.getpid(),
                          device_uuids=_visible_gpus() if use_gpu else (), started_at=started_at)
    reports: list[Any] = [None] * ctx.get_world_size()
    if dist.is_initialized():
        dist.all_gather_object(reports, report)
    else:
        reports = [report]
    answer: list[Any] = [None]
    if ctx.get_world_rank() == 0:
        try:
            answer[0] = ray.get(coordinator.group_started.remote(reports, get_train_context().controller_actor))
        except ray.exceptions.RayTaskError as e:
            answer[0] = e.cause if isinstance(e.cause, ArchipelagoError) else RuntimeError(str(e))
    if dist.is_initialized():
        # Pickled by Ray's cloudpickle, as ray.get brought it: a factory from the driver's own script
        # travels in the spec's workload by value, which torch's plain pickle cannot write.
        sent = [cloudpickle.dumps(answer[0]) if ctx.get_world_rank() == 0 else None]
        dist.broadcast_object_list(sent, src=0)
        answer[0] = cloudpickle.loads(sent[0])
    if isinstance(answer[0], BaseException):
        raise answer[0]
    spec: WorkerSpec = answer[0]
    entries = [w for w in spec.plan.workers if w.ray_node_id == report.ray_node_id]
    mine = [i for i, w in enumerate(entries) if w.device_uuid and w.device_uuid in report.device_uuids]
    if len(mine) == 1:  # a GPU worker takes the entry of the GPU Ray gave it (Ray reserves GPUs by count)
        return spec, mine[0]
    on_node = sorted(r.world_rank for r in reports if r.ray_node_id == report.ray_node_id)
    return spec, on_node.index(report.world_rank)


def _visible_gpus() -> tuple[str, ...]:
    """UUIDs of the GPUs Ray made visible to this worker, as NVML names them (GPU-…)."""
    if not torch.cuda.is_available():
        return ()
    return tuple(f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count()))


class PreemptionWatch:
    """Polls Ray's preemption notice every `every_steps` steps. `ray.train.get_preemption_info` is a
    barrier across the workers, so every rank calls `check` at the same steps; the notice is acted on
    once per group (Ray restarts the group when the node goes)."""

    def __init__(self, every_steps: int):
        self.every_steps = every_steps
        self.noticed = False

    def check(self, step: int):
        if self.noticed or step % self.every_steps:
            return None
        notice = ray.train.get_preemption_info()
        self.noticed = notice is not None
        return notice


def preemption_row(notice, step: int, checkpoint_s: float) -> dict:
    deadline = notice.deadline_ms / 1000 if notice.deadline_ms else None
    return {"event": "preemption", "time": time.time(), "step": step, "nodes": notice.preempted_node_ids,
            "ranks": notice.preempted_ranks, "seconds_to_deadline": deadline - time.time() if deadline else None,
            "checkpoint_s": checkpoint_s}


class LedgerKeeper:
    """Records the sample ids each step trained on, as handed to the loader, and puts the ledger of every
    committed step into each checkpoint (storage/ledger.py). Off: every method is a no-op."""

    def __init__(self, enabled: bool, restored: bytes | None, *, rank: int, replica: int, group: Any):
        self.enabled, self.rank, self.replica, self.group = enabled, rank, replica, group
        self.ledger = SampleLedger.from_bytes(restored) if restored else SampleLedger()
        self._handed: deque[np.ndarray] = deque()
        """Ids given to the loader and not trained yet (it reads `prefetch_steps` ahead)."""
        self._trained: list[tuple[int, np.ndarray]] = []
        """(step, this rank's ids) since the last checkpoint."""

    def tap(self, steps: Iterator[list[np.ndarray]]) -> Iterator[list[np.ndarray]]:
        for micro_batches in steps:
            if self.enabled:
                self._handed.append(np.concatenate(micro_batches))
            yield micro_batches

    def forget_ahead(self) -> None:
        """The loader dropped what it read ahead (BatchLoader.discard_ahead): those ids were never trained."""
        self._handed.clear()

    def trained(self, step: int) -> None:
        if self.enabled:
            self._trained.append((step, self._handed.popleft()))

    def extra(self) -> dict[str, bytes]:
        """Collective: gathers every rank's ids to rank 0, which returns the ledger file for the checkpoint."""
        if not self.enabled:
            return {}
        mine = (self.replica, self._trained)
        gathered: list[Any] = [mine]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self.group)
        self._trained = []
        if self.rank != 0:
            return {}
        replicas: dict[int, list] = {}
        for replica, trained in gathered:  # one entry per replica: tensor-parallel peers read the same ids
            replicas.setdefault(replica, trained)
        blocks = [replicas[r] for r in sorted(replicas)]  # stream order: replica 0's block first
        for i, (step, _) in enumerate(blocks[0]):
            self.ledger.record(step, np.concatenate([trained[i][1] for trained in blocks]))
        return {LEDGER_FILE: self.ledger.to_bytes()}
