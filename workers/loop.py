"""The training loop each Ray Train worker runs.

    restore the latest checkpoint → while step < steps: step; log; validate; checkpoint

Rank 0 sends one metrics row per step to the driver's `MetricsSink` every `log_every` steps;
`ray.train.report` is called (by every rank, it is a barrier) only with a checkpoint.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from orchestrator.config import JobConfig
from storage.sampler import BatchLayout, DeterministicSampler
from storage.shards import TokenDataset
from workers import checkpoint
from workers.models.gpt import GPT
from workers.optim import build_optimizer, lr_at
from workers.step import TrainStep


@dataclass(kw_only=True)
class WorkerJob:
    """Everything a worker needs, sent once by the driver."""

    config: JobConfig
    data_dir: str
    """Absolute path of the prepared dataset (readable from every node)."""
    tokenizer: str
    metrics_sink: Any
    """Actor handle of the driver's MetricsSink."""
    resume_from: str | None = None
    """A committed checkpoint chosen by the driver; Ray's own restore (after a failure) takes precedence."""


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


def train_loop(loop_config: dict) -> dict:
    job: WorkerJob = loop_config["job"]
    cfg = job.config
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = bind_device(cfg)

    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.train, device)
    progress = restore(job, model, optimizer)
    step_fn = TrainStep(model, optimizer, cfg, device)

    train_data = TokenDataset(job.data_dir, "train", cfg.model.seq_len)
    val_data = TokenDataset(job.data_dir, "val", cfg.model.seq_len)
    sampler = DeterministicSampler(train_data.num_samples, cfg.train.seed)
    layout = BatchLayout.uniform(world, cfg.train.micro_batch_size, cfg.grad_accum_steps)
    window = MetricsWindow()
    send(job, rank, [{"event": "start", "step": progress.step, "world_size": world, "device": str(device),
                      "params": model.num_params(), "flops_per_token": model.flops_per_token()}])

    last_val_loss, rows = None, []
    while progress.step < cfg.train.steps:
        ids = sampler.rank_micro_batches(progress.consumed_samples, layout, rank)
        batches = [to_device(train_data.batch(i), device) for i in ids]
        lr = lr_at(progress.step, cfg.train)
        loss, grad_norm = step_fn(batches, lr)
        progress.step += 1
        progress.consumed_samples += layout.global_batch
        window.record(progress.step, lr, loss, grad_norm)

        final = progress.step == cfg.train.steps
        if progress.step % cfg.train.log_every == 0 or final:
            rows = window.flush(cfg.tokens_per_step, progress.consumed_samples)
            if progress.step % cfg.train.eval_every == 0 or final:
                last_val_loss = rows[-1]["val_loss"] = validate(step_fn, val_data, cfg, rank, world, device)
            send(job, rank, rows)
        if progress.step % cfg.checkpoint.every_steps == 0 or final:
            save_checkpoint(job, model, optimizer, progress, rank, rows[-1] if rows else {})
            send(job, rank, [{"event": "checkpoint", "step": progress.step}])
            window.started = time.perf_counter()  # checkpoint time is not training throughput
        rows = []
    return {"step": progress.step, "consumed_samples": progress.consumed_samples, "val_loss": last_val_loss}


def bind_device(cfg: JobConfig) -> torch.device:
    if cfg.cluster.use_gpu:
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(cfg.cluster.cpus_per_worker)
    return torch.device("cpu")


def to_device(batch: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(batch)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def restore(job: WorkerJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Progress:
    ray_checkpoint = ray.train.get_checkpoint()
    if ray_checkpoint is None and job.resume_from is None:
        return Progress()
    with (ray_checkpoint.as_directory() if ray_checkpoint else contextlib.nullcontext(job.resume_from)) as directory:
        directory = Path(directory)
        checkpoint.check_compatible(checkpoint.read_info(directory), job.config, job.tokenizer, directory)
        info = checkpoint.load(directory, model, optimizer)
    return Progress(info.step, info.consumed_samples)


def save_checkpoint(job: WorkerJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress,
                    rank: int, metrics: dict) -> None:
    info = checkpoint.CheckpointInfo.for_job(job.config, progress.step, progress.consumed_samples, job.tokenizer)
    with tempfile.TemporaryDirectory(prefix="archipelago-ckpt-") as tmp:
        checkpoint.save(Path(tmp), model, optimizer, info, rank)
        # Every rank uploads its own DCP files; Ray merges them into one directory in storage.
        ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                         checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=checkpoint.dir_name(progress.step))


def validate(step_fn: TrainStep, val_data: TokenDataset, cfg: JobConfig, rank: int, world: int,
             device: torch.device) -> float:
    """Mean loss over a fixed, evenly spread set of validation samples, split across ranks."""
    count = min(cfg.train.eval_samples, val_data.num_samples)
    ids = np.linspace(0, val_data.num_samples - 1, count).astype(np.int64)[rank::world]
    chunks = [ids[i:i + cfg.train.micro_batch_size] for i in range(0, len(ids), cfg.train.micro_batch_size)]
    loss_sum, tokens = step_fn.evaluate([to_device(val_data.batch(c), device) for c in chunks])
    totals = torch.tensor([loss_sum, tokens], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def send(job: WorkerJob, rank: int, rows: list[dict]) -> None:
    if rank == 0:
        job.metrics_sink.record.remote(rows)  # fire and forget: the driver drains the sink
