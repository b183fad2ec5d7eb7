"""The training loop each Ray Train worker runs.

    restore the latest checkpoint → while step < steps: step; log; validate; checkpoint

Rank 0 sends one metrics row per step to the driver's `MetricsSink` every `log_every` steps.
Input comes from `storage.loader.BatchLoader`, which reads the next steps' samples (with kvikio
straight into GPU memory where it can) while this one trains. Checkpoints are written by every
rank straight into the run's storage (`workers.checkpoint.RunCheckpoints`): the newest committed
step there is what a restarted or resized worker group resumes from, so no `ray.train.report`
is needed.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from orchestrator.config import JobConfig
from orchestrator.placement import binding
from orchestrator.placement.plan import Plan
from storage.fs import Location
from storage.loader import BatchLoader
from storage.readers import choose_reader
from storage.sampler import DeterministicSampler
from storage.shards import TokenDataset
from workers import checkpoint
from workers.engine import Engine
from workers.optim import lr_at


@dataclass(kw_only=True)
class WorkerJob:
    """Everything a worker needs, sent once by the driver."""

    config: JobConfig
    data_dir: str
    """The prepared dataset: a local path or a pyarrow.fs URI, readable from every node."""
    tokenizer: str
    plan: Plan
    """The driver's plan; each worker claims its entry by node and local rank."""
    metrics_sink: Any
    """Actor handle of the driver's MetricsSink."""
    resume_from: str | None = None
    """The committed checkpoint the driver chose for --resume (None for a new run). Workers always load the
    newest committed step in the run's storage (newer than this after a failure or a resize); this only
    lets them say that the step to resume from is gone when none is left."""


@dataclass
class Progress:
    step: int = 0
    consumed_samples: int = 0


@dataclass
class MetricsWindow:
    """Per-step values since the last log; averaged across ranks in one all-reduce when flushed."""

    steps: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def record(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.steps.append(step)
        self.lrs.append(lr)
        self.values.append(torch.stack([loss.float(), grad_norm.float()]))

    def flush(self, tokens_per_step: int, consumed_samples: int) -> list[dict]:
        values = torch.stack(self.values)
        if dist.is_initialized():
            dist.all_reduce(values)
            values /= dist.get_world_size()
        values = values.tolist()  # waits for the GPU: the window's time below is honest
        seconds = time.perf_counter() - self.started
        tokens_per_s = tokens_per_step * len(self.steps) / seconds
        rows = [{"step": s, "loss": v[0], "grad_norm": v[1], "lr": lr, "tokens_per_s": tokens_per_s}
                for s, lr, v in zip(self.steps, self.lrs, values)]
        rows[-1]["consumed_samples"] = consumed_samples
        self.steps, self.lrs, self.values = [], [], []
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
    job: WorkerJob = loop_config["job"]
    cfg = job.config
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    plan, device = claim_plan_entry(job.plan, ctx)

    engine = Engine(cfg, plan, rank, device)
    checkpoints = checkpoint.RunCheckpoints(run_storage(), cfg, rank)
    progress, checkpoint_readers = restore(job, checkpoints, engine.model, engine.optimizer)

    train_loader, val_loader = open_loaders(job, device)
    sampler = DeterministicSampler(train_loader.dataset.num_samples, cfg.train.seed)
    layout = plan.batch_layout()
    replica = plan.worker(rank).data_parallel_rank
    steps = train_loader.stream(sampler.steps(progress.consumed_samples, layout, replica))
    window = MetricsWindow()
    send(job, rank, [{"event": "start", "step": progress.step, "world_size": world, "device": str(device),
                      "device_model": plan.worker(rank).device_model, "precision": engine.precision.name,
                      "params": engine.model.num_params(), "flops_per_token": engine.model.flops_per_token(),
                      "micro_batch_sizes": list(layout.micro_batch_sizes), "grad_accum_steps": plan.grad_accum_steps,
                      "reader": train_loader.reader_choice, "checkpoint_readers": sorted(checkpoint_readers)}])

    last_val_loss = None
    while progress.step < cfg.train.steps:
        batches = next(steps)
        lr = lr_at(progress.step, cfg.train)
        loss, grad_norm = engine(batches, lr)
        progress.step += 1
        progress.consumed_samples += layout.global_batch
        window.record(progress.step, lr, loss, grad_norm)

        final = progress.step == cfg.train.steps
        if progress.step % cfg.train.log_every == 0 or final:
            rows = window.flush(cfg.tokens_per_step, progress.consumed_samples)
            rows[-1].update(engine.window_metrics())
            if progress.step % cfg.train.eval_every == 0 or final:
                with window.paused():
                    last_val_loss = rows[-1]["val_loss"] = validate(engine, val_loader, cfg, rank, world)
            send(job, rank, rows)
        if progress.step % cfg.checkpoint.every_steps == 0 or final:
            info = checkpoint.CheckpointInfo.for_job(cfg, progress.step, progress.consumed_samples, job.tokenizer, world)
            with window.paused():
                saved = checkpoints.save(engine.model, engine.optimizer, info)
            send(job, rank, [{"event": "checkpoint", "step": s} for s in saved])
    send(job, rank, [{"event": "checkpoint", "step": s} for s in checkpoints.wait()])
    train_loader.close()
    val_loader.close()
    return {"step": progress.step, "consumed_samples": progress.consumed_samples, "val_loss": last_val_loss}


def claim_plan_entry(plan: Plan, ctx) -> tuple[Plan, torch.device]:
    """Binds this worker to its plan entry's device and cores, and renumbers the plan to Ray's ranks.

    Ray Train numbers workers itself; each claims the entry of its node and local rank, and the
    claims, gathered in world-rank order, renumber the plan so plan rank == world rank."""
    entry = binding.claim(plan, ray_node_id=ray.get_runtime_context().get_node_id(), node_id=socket.gethostname(),
                          local_rank=ctx.get_local_rank())
    device = torch.device(binding.bind(entry))
    if device.type == "cpu":
        torch.set_num_threads(entry.cpus)
    else:
        torch.cuda.set_device(device)
    claimed: list[int | None] = [None] * ctx.get_world_size()
    dist.all_gather_object(claimed, entry.rank)
    return plan.reordered(claimed), device


def run_storage() -> Location:
    """The run's directory in Ray's storage (`RunDirectory.storage_path`/name): local disk or a pyarrow.fs URI."""
    storage = ray.train.get_context().get_storage()
    return Location.of(storage.storage_filesystem, storage.experiment_fs_path)


def restore(job: WorkerJob, checkpoints: checkpoint.RunCheckpoints, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer) -> tuple[Progress, set[str]]:
    """The newest committed checkpoint of the run (after a failure, a resize or --resume), or a fresh start."""
    restored = checkpoints.restore(model, optimizer, job.tokenizer, job.resume_from)
    if restored is None:
        return Progress(), set()
    info, readers = restored
    return Progress(info.step, info.consumed_samples), readers


def open_loaders(job: WorkerJob, device: torch.device) -> tuple[BatchLoader, BatchLoader]:
    """Train and validation loaders; the reader is chosen once (and reported in the start event)."""
    data = job.config.data
    train = TokenDataset(job.data_dir, "train", job.config.model.seq_len)  # reads the manifest, once
    val = TokenDataset(job.data_dir, "val", job.config.model.seq_len, manifest=train.manifest)
    choice = choose_reader(data.reader, train.location, device, threads=data.reader_threads, small_reads=True)
    train_loader = BatchLoader(train, choice, device, depth=data.prefetch_steps)
    val_reader = choose_reader(choice.reader.kind, val.location, device, threads=data.reader_threads)
    return train_loader, BatchLoader(val, val_reader, device, depth=1)


def validate(engine: Engine, val_loader: BatchLoader, cfg: JobConfig, rank: int, world: int) -> float:
    """Mean loss over a fixed, evenly spread set of validation samples, split evenly across ranks
    (every rank runs the same number of forward passes: FSDP's are collective)."""
    num_samples = val_loader.dataset.num_samples
    count = max(world, min(cfg.train.eval_samples, num_samples) // world * world)
    ids = np.linspace(0, num_samples - 1, count).astype(np.int64)[rank::world]
    size = engine.eval_batch_size
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    loss_sum, tokens = engine.evaluate(val_loader.load(chunks))
    totals = torch.tensor([loss_sum, tokens], dtype=torch.float64, device=engine.device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def send(job: WorkerJob, rank: int, rows: list[dict]) -> None:
    if rank == 0 and rows:
        job.metrics_sink.record.remote(rows)  # fire and forget: the driver drains the sink
