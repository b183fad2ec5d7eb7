"""The training loop each Ray Train worker runs.

    join the group's plan → restore the latest checkpoint → while step < steps: step; log; validate; checkpoint

Rank 0 sends one metrics row per step to the driver's `MetricsSink` every `log_every` steps.
Input comes from `storage.loader.BatchLoader`, which reads the next steps' samples (with kvikio
straight into GPU memory where it can) while this one trains. Checkpoints are written by every
rank straight into the run's storage (`workers.checkpoint.RunCheckpoints`): the newest committed
step there is what a restarted or resized worker group resumes from, so no `ray.train.report`
is needed.

Elastic runs (workers/elastic.py): every start of the worker group — the first, and each restart
Ray Train makes after a failure, a preemption or a resize — asks the driver's PlanCoordinator for the
spec of exactly the workers granted (core/spec.py: the plan made for them and the settings the
worker needs), so micro-batches and accumulation fit the group while the global batch stays fixed
and the sampler continues at the checkpoint's exact sample. A preemption
notice commits a checkpoint at once; with `[elastic] sample_ledger` every checkpoint carries the
sample ids of every committed step.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from core.errors import ArchipelagoError, CheckpointError, DataError
from core.spec import WorkerSpec
from storage.fs import Location
from storage.ledger import LEDGER_FILE
from storage.loader import BatchLoader
from storage.readers import choose_reader
from storage.sampler import DeterministicSampler
from storage.shards import TokenDataset
from workers import binding, checkpoint
from workers.batch_adapter import BatchAdapter
from workers.elastic import LedgerKeeper, PreemptionWatch, join_group, preemption_row
from workers.engine import Engine
from workers.pretrained import load_pretrained


@dataclass(kw_only=True)
class WorkerJob:
    """How a worker reaches the driver, sent once. What it trains and how comes from the coordinator,
    as the WorkerSpec of its group (`join_group`)."""

    uses_gpus: bool
    """The workers run on GPUs (they report the GPUs Ray made visible before they are planned)."""
    metrics_sink: Any
    """Actor handle of the driver's MetricsSink."""
    coordinator: Any
    """Actor handle of the driver's PlanCoordinator (orchestrator/coordinator.py)."""
    resume_from: str | None = None
    """The committed checkpoint the driver chose for --resume (None for a new run). Workers always load the
    newest committed step in the run's storage (newer than this after a failure or a resize); this only
    lets them say that the step to resume from is gone when none is left."""


@dataclass
class Progress:
    step: int = 0
    consumed_samples: int = 0
    adaptive_batch: dict | None = None
    """The checkpoint's adaptive batch state (core/adaptive_batch.py); None for a fixed batch or a fresh start."""


@dataclass
class MetricsWindow:
    """Per-step values since the last log; averaged across ranks in one all-reduce when flushed."""

    steps: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    values: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    data_waits: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def record(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor,
               data_wait_s: float = 0.0, local_gradient: tuple[torch.Tensor, int] | None = None) -> None:
        """data_wait_s: how long the step waited for its input (rank 0's wait; the loader reads ahead).
        local_gradient: the engine's (|g|², samples) of this rank's smaller batch (the noise scale)."""
        self.steps.append(step)
        self.lrs.append(lr)
        # Kept as they are until flush: under the next-forward overlap a step's norm is written
        # only once its updates are applied (Engine.settle). The local norm rides the same
        # all-reduce as the averaged mean of the ranks', with the mean of 1/samples (core/noise_scale.py).
        small_sq, samples = local_gradient if local_gradient is not None else (loss.new_tensor(math.nan), math.inf)
        self.values.append((loss, grad_norm, small_sq, loss.new_tensor(1.0 / samples)))
        self.data_waits.append(data_wait_s)

    def flush(self, tokens_per_step: int, consumed_samples: int) -> list[dict]:
        values = torch.stack([torch.stack([v.float() for v in step]) for step in self.values])
        if dist.is_initialized():
            dist.all_reduce(values)
            values /= dist.get_world_size()
        values = values.tolist()  # waits for the GPU: the window's time below is honest
        seconds = time.perf_counter() - self.started
        tokens_per_s = tokens_per_step * len(self.steps) / seconds
        rows = [{"step": s, "loss": v[0], "grad_norm": v[1], "lr": lr, "tokens_per_s": tokens_per_s, "data_wait_s": w,
                 "local_grad_sq": v[2], "inverse_local_batch": v[3]}
                for s, lr, v, w in zip(self.steps, self.lrs, values, self.data_waits)]
        rows[-1]["consumed_samples"] = consumed_samples
        self.steps, self.lrs, self.values, self.data_waits = [], [], [], []
        self.started = time.perf_counter()
        return rows

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (validation, a checkpoint save) is not charged to the window's steps."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - paused


def train_loop(loop_config: dict) -> dict:
    started_at = time.time()
    job: WorkerJob = loop_config["job"]
    ctx = ray.train.get_context()
    try:
        return train(job, ctx, started_at)
    except ArchipelagoError as e:  # the user's to fix: Ray Train retries any error, so later groups stop at once
        ray.get(job.coordinator.give_up.remote(e))
        raise
    except Exception:  # where it was raised: the coordinator names it if a restart meets it again
        job.coordinator.raised.remote(ctx.get_world_rank(), traceback.format_exc())
        raise


def train(job: WorkerJob, ctx, started_at: float) -> dict:
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    marks = {}  # when this group reached each stage of its start (unix s): the recovery's timeline
    spec, node_rank = join_group(job.coordinator, ctx, use_gpu=job.uses_gpus, started_at=started_at)
    marks["planned"] = time.time()
    spec, device = claim_plan_entry(spec, ctx, node_rank)
    plan, train_cfg = spec.plan, spec.train

    engine = Engine(spec, rank, device)
    checkpoints = checkpoint.RunCheckpoints(run_storage(), spec, rank)
    marks["restore_start"] = time.time()
    progress, checkpoint_readers = restore(job, checkpoints, engine.model, engine.optimizer)
    pretrained_reader = None
    if checkpoints.restored_from is None:  # step 0: [model] hf_dir's weights, when it has any
        pretrained_reader = load_pretrained(engine.model, spec.model, process_group=checkpoints.group,
                                            reader=spec.checkpoint.reader)
    marks["restored"] = time.time()
    restored_step = progress.step
    replica = plan.worker(rank).data_parallel_rank
    ledger = open_ledger(spec, checkpoints, rank, replica, restored_step)
    adapter = BatchAdapter(spec, progress.adaptive_batch)
    engine.replan(adapter.plan)

    train_loader, val_loader = open_loaders(spec, device)
    sampler = DeterministicSampler(train_loader.dataset.num_samples, train_cfg.seed)
    layout = adapter.plan.batch_layout()
    steps = train_loader.stream(ledger.tap(sampler.steps(progress.consumed_samples, layout, replica)))
    preemption = PreemptionWatch(spec.preemption_check_steps)
    window = MetricsWindow()
    send(job, rank, [{"event": "start", "step": progress.step, "consumed_samples": progress.consumed_samples,
                      "world_size": world, "device": str(device),
                      "device_model": plan.worker(rank).device_model, "precision": engine.precision.name,
                      "params": sum(p.numel() for p in engine.model.parameters()),
                      "flops_per_token": spec.flops_per_token, "model": spec.workload.name,
                      "micro_batch_sizes": list(layout.micro_batch_sizes),
                      "grad_accum_steps": adapter.plan.grad_accum_steps, "global_batch": layout.global_batch,
                      "reader": train_loader.reader_choice, "checkpoint_readers": sorted(checkpoint_readers),
                      "pretrained_reader": pretrained_reader}])

    last_val_loss = None
    while not adapter.finished(progress.step, progress.consumed_samples, train_cfg.steps):
        waiting = time.perf_counter()
        batches = next(steps)
        data_wait_s = time.perf_counter() - waiting
        lr = adapter.lr(spec.lr_schedule, progress.step, progress.consumed_samples)
        engine.seed_step(progress.step)
        loss, grad_norm = engine(batches, lr)
        progress.step += 1
        progress.consumed_samples += layout.global_batch
        ledger.trained(progress.step)
        window.record(progress.step, lr, loss, grad_norm, data_wait_s, engine.local_gradient)
        if rank == 0:
            job.coordinator.reached.remote(progress.step, time.time(), adapter.state.noise_scale)
            if progress.step == restored_step + 1:
                loss.item()  # the step has really finished (GPU work is asynchronous)
                marks["first_step_done"] = time.time()
                job.coordinator.first_step.remote(restored_step, marks)

        final = adapter.finished(progress.step, progress.consumed_samples, train_cfg.steps)
        if progress.step % train_cfg.log_every == 0 or final:
            engine.settle()
            rows = window.flush(adapter.plan.tokens_per_step, progress.consumed_samples)
            adapter.measured(rows)
            rows[-1].update(engine.window_metrics())
            if progress.step % train_cfg.eval_every == 0 or final:
                with window.paused():
                    last_val_loss = rows[-1]["val_loss"] = validate(engine, val_loader, train_cfg.eval_samples)
            change = None if final else adapter.maybe_change(progress.step)
            if change is not None:  # re-split in place: the same workers go on from the next sample
                engine.replan(adapter.plan)
                layout = adapter.plan.batch_layout()
                train_loader.discard_ahead()
                ledger.forget_ahead()
                steps = train_loader.stream(ledger.tap(sampler.steps(progress.consumed_samples, layout, replica)))
                rows.append(change)
            send(job, rank, rows)
        notice = preemption.check(progress.step)
        if progress.step % spec.checkpoint.every_steps == 0 or final or notice:
            engine.settle()
            info = checkpoint.CheckpointInfo.for_spec(spec, progress.step, progress.consumed_samples, world,
                                                      adapter.checkpointed())
            saving = time.perf_counter()
            with window.paused():
                # On a preemption notice, wait for the commit: the node may go any moment.
                saved = checkpoints.save(engine.model, engine.optimizer, info, extra=ledger.extra(),
                                         wait=notice is not None)
            send(job, rank, [{"event": "checkpoint", "step": s} for s in saved])
            if notice and rank == 0:
                job.coordinator.record.remote([preemption_row(notice, progress.step, time.perf_counter() - saving)])
    send(job, rank, [{"event": "checkpoint", "step": s} for s in checkpoints.wait()])
    train_loader.close()
    val_loader.close()
    return {"step": progress.step, "consumed_samples": progress.consumed_samples, "val_loss": last_val_loss}


def open_ledger(spec: WorkerSpec, checkpoints: checkpoint.RunCheckpoints, rank: int, replica: int,
                restored_step: int) -> LedgerKeeper:
    """The sample ledger, continued from the restored checkpoint's (rank 0 keeps it; the others send ids)."""
    enabled = spec.sample_ledger
    restored = None
    if enabled and rank == 0 and checkpoints.restored_from is not None:
        restored = checkpoint.read_extra(checkpoints.restored_from, LEDGER_FILE)
    keeper = LedgerKeeper(enabled, restored, rank=rank, replica=replica, group=checkpoints.group)
    if enabled and rank == 0 and keeper.ledger.last_step != restored_step:
        raise CheckpointError(f"the checkpoint of step {restored_step} holds a sample ledger up to step "
                              f"{keeper.ledger.last_step} only", where=str(checkpoints.restored_from),
                              fix="set [elastic] sample_ledger = false for this run, or start it over with it on")
    return keeper


def claim_plan_entry(spec: WorkerSpec, ctx, node_rank: int) -> tuple[WorkerSpec, torch.device]:
    """Binds this worker to its plan entry's device and cores, and renumbers the plan to Ray's ranks.

    Ray Train numbers workers itself; each claims the entry of its node and its index there
    (`node_rank`), and the claims, gathered in world-rank order, renumber the plan so plan rank == world rank."""
    context = ray.get_runtime_context()
    gpu_ids = binding.ray_gpus_by_uuid(ray.get_gpu_ids())
    entry = binding.claim(spec.plan, ray_node_id=context.get_node_id(), node_id=socket.gethostname(),
                          local_rank=node_rank, gpu_ids=gpu_ids)
    assigned = context.get_assigned_resources()
    binding.check_placement(entry, node=f"{socket.gethostname()} ({context.get_node_id()[:8]})", assigned=assigned,
                            gpu_ids=gpu_ids, islands_requested=binding.islands_reserved(spec.plan, assigned))
    device = torch.device(binding.bind(entry))
    if device.type == "cpu":
        torch.set_num_threads(entry.cpus)
    else:
        torch.cuda.set_device(device)
    claimed: list[int | None] = [None] * ctx.get_world_size()
    dist.all_gather_object(claimed, entry.rank)
    return spec.with_plan(spec.plan.reordered(claimed)), device


def run_storage() -> Location:
    """The run's directory in Ray's storage (`RunDirectory.storage_path`/name): local disk or a pyarrow.fs URI."""
    storage = ray.train.get_context().get_storage()
    return Location.of(storage.storage_filesystem, storage.experiment_fs_path)


def restore(job: WorkerJob, checkpoints: checkpoint.RunCheckpoints, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer) -> tuple[Progress, set[str]]:
    """The newest committed checkpoint of the run (after a failure, a resize or --resume), or a fresh start."""
    restored = checkpoints.restore(model, optimizer, job.resume_from)
    if restored is None:
        return Progress(), set()
    info, readers = restored
    return Progress(info.step, info.consumed_samples, info.adaptive_batch), readers


def open_loaders(spec: WorkerSpec, device: torch.device) -> tuple[BatchLoader, BatchLoader]:
    """Train and validation loaders; the reader is chosen once (and reported in the start event)."""
    data = spec.data
    checks = data.shard_checksums_percent
    train = TokenDataset(data.location, "train", spec.model.seq_len, checksum_percent=checks)  # reads the manifest
    val = TokenDataset(data.location, "val", spec.model.seq_len, manifest=train.manifest, checksum_percent=checks)
    choice = choose_reader(data.reader, train.location, device, threads=data.reader_threads, small_reads=True)
    train_loader = BatchLoader(train, choice, device, depth=data.prefetch_steps)
    val_reader = choose_reader(choice.reader.kind, val.location, device, threads=data.reader_threads)
    return train_loader, BatchLoader(val, val_reader, device, depth=1)


def validate(engine: Engine, val_loader: BatchLoader, eval_samples: int) -> float:
    """Mean loss over a fixed, evenly spread set of validation samples, split evenly across the data-parallel
    replicas: the ranks of a tensor-parallel group run one model on the same samples, and every rank runs
    the same number of forward passes (FSDP's and TP's are collective)."""
    replicas = len(engine.spec.plan.replica_micro_batch_sizes())
    num_samples = val_loader.dataset.num_samples
    count = max(replicas, min(eval_samples, num_samples) // replicas * replicas)
    ids = np.linspace(0, num_samples - 1, count).astype(np.int64)[engine.worker.data_parallel_rank::replicas]
    size = engine.eval_batch_size
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    loss_sum, tokens = engine.evaluate(val_loader.load(chunks))
    totals = torch.tensor([loss_sum, tokens], dtype=torch.float64, device=engine.device)
    if dist.is_initialized():  # each replica's sums come once from each of its ranks: the ratio is the mean
        dist.all_reduce(totals)
    if totals[1] == 0:  # a mean of nothing would be reported as a validation loss of nan
        raise DataError(f"the {len(ids) * replicas} validation samples read hold no token the loss counts",
                        where="[train] eval_samples", fix="raise eval_samples, or give the validation split's "
                        "conversations assistant turns")
    return float(totals[0] / totals[1])


def send(job: WorkerJob, rank: int, rows: list[dict]) -> None:
    if rank == 0 and rows:
        job.metrics_sink.record.remote(rows)  # fire and forget: the driver drains the sink
