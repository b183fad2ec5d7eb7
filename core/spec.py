"""What one worker is told: the plan and the settings it needs, resolved on the driver.

    spec = WorkerSpec.for_plan(config, plan, workload=workload, flops_per_token=facts.flops_per_token,
                               data_location="data/stdlib-bytes", tokenizer="bytes")
    Engine(spec, rank, device)          # workers/engine.py; the Ray Train loop gets one per worker group

One plain object crosses from the driver to the workers. It holds no [parallel], [placement] or
[cluster] section: how the model is spread, in which precision, with which comm hook and buckets
is the Plan's to say, decided by the planner; the worker reads it as it is and never merges it
with the config again. On every start of an elastic worker group the driver builds the spec anew
from the plan it made for that group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from core.config import CheckpointConfig, CompileConfig, JobConfig, ModelConfig, TrainConfig
from core.plan import Plan
from core.schedule import LrSchedule
from core.workload import Workload


@dataclass(kw_only=True, slots=True, frozen=True)
class DataSpec:
    """The prepared dataset the workers read and how they read it."""

    location: str = ""
    """A local directory or a pyarrow.fs URI readable from every node ("" where the caller feeds the
    engine its batches itself: tests and benchmarks)."""
    tokenizer: str = "bytes"
    """The dataset's tokenizer identity (checkpoints record it)."""
    fingerprint: str = ""
    """The training samples' identity (storage.shards.Manifest.train_fingerprint; checkpoints record it, and a
    resume on other samples is refused: the sampler's next sample would be another); "" where not known."""
    token_flags: bool = False
    """The dataset's tokens carry a loss mask and document starts (storage/flags.py: fine-tuning data,
    `prepare --format chat|instruction`): the engine unpacks them and weights the loss by counted targets."""
    reader: str = "auto"
    reader_threads: int = 8
    prefetch_steps: int = 2
    shard_checksums_percent: float = 100.0
    """Share of shards whose payload a worker checks on first read ([data] shard_checksums_percent)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class WorkerSpec:
    plan: Plan
    """Where each worker runs, its micro-batch and accumulation, the strategy, backend, precision,
    comm hook, bucket size, overlap and activation checkpointing."""
    workload: Workload
    """The model: how to build it, its loss, its blocks (core/workload.py). A factory's callable travels
    inside it (pickled by value where the workers cannot import it)."""
    flops_per_token: float
    """Training FLOPs per token, counted on the driver (the bill's MFU)."""
    model: ModelConfig
    train: TrainConfig
    """Steps, schedule, seed, clipping, loss kernel, bf16 weights; `precision` is the plan's."""
    compile: CompileConfig
    checkpoint: CheckpointConfig
    lr_schedule: LrSchedule
    """The learning rate of every step: the config's for a new run, continued from the checkpoint's on a resume."""
    data: DataSpec = DataSpec()
    preemption_check_steps: int = 10
    """Steps between reads of Ray's preemption notice ([elastic] preemption_check_steps)."""
    sample_ledger: bool = False
    """Record the sample ids of every committed step in each checkpoint ([elastic] sample_ledger)."""

    @classmethod
    def for_plan(cls, config: JobConfig, plan: Plan, *, workload: Workload, flops_per_token: float,
                 data_location: str = "", tokenizer: str = "bytes", token_flags: bool = False,
                 data_fingerprint: str = "", lr_schedule: LrSchedule | None = None) -> WorkerSpec:
        """The spec for the workers that run `plan` of the job `config` (its model `workload`), reading
        the prepared dataset at `data_location` (its tokenizer identity `tokenizer`; `token_flags`: a
        fine-tuning dataset's flagged tokens; `data_fingerprint`: its training samples' identity);
        `lr_schedule` is [train]'s when None (a new run)."""
        data = DataSpec(location=data_location, tokenizer=tokenizer, fingerprint=data_fingerprint,
                        token_flags=token_flags, reader=config.data.reader,
                        reader_threads=config.data.reader_threads, prefetch_steps=config.data.prefetch_steps,
                        shard_checksums_percent=config.data.shard_checksums_percent)
        return cls(plan=plan, workload=workload, flops_per_token=flops_per_token, model=config.model,
                   train=dataclasses.replace(config.train, precision=plan.precision),
                   compile=config.compile, checkpoint=config.checkpoint, data=data,
                   lr_schedule=lr_schedule or LrSchedule.for_train(config.train),
                   preemption_check_steps=config.elastic.preemption_check_steps,
                   sample_ledger=config.elastic.sample_ledger)

    def with_plan(self, plan: Plan) -> WorkerSpec:
        """The same job for another plan (a re-planned worker group)."""
        return dataclasses.replace(self, plan=plan, train=dataclasses.replace(self.train, precision=plan.precision))
