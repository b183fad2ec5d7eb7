"""Checkpoints of a training job: model and optimizer through storage.checkpoint_io, plus `archipelago.json`.

    pending = save(store.step(300), model, optimizer, info, async_save=True, process_group=group)
    info, readers = load(store.latest(), model, optimizer, reader="auto")

Every rank writes its own data files (several, one per writing thread) and the coordinator writes
`.metadata` last; DCP reshards at load time, so a checkpoint saved by N workers loads on M.
`archipelago.json` (written by the coordinator before any tensor data) holds what is needed to
continue exactly — the step, the sampler and its position — and what identifies the job (model
shape, tokenizer, seed, global batch), so a checkpoint of another model is refused with a clear
error instead of a shape mismatch from deep inside torch.

A step directory counts as committed when `.metadata` exists (storage.checkpoint_io explains why
that is enough); checkpoints live on local disk or any pyarrow.fs URI.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from core.adaptive_batch import AdaptiveBatch
from core.errors import CheckpointError
from core.schedule import LrSchedule
from core.spec import WorkerSpec
from storage.checkpoint_io import (
    DCP_METADATA,
    CheckpointStore,
    PendingSave,
    checkpoint_group,
    is_committed,
    load_checkpoint,
    save_checkpoint,
)
from storage.fs import Location
from storage.readers import ReaderKind
from storage.sampler import SAMPLER_NAME

INFO_FILE = "archipelago.json"
LEGACY_SAMPLER = "numpy-permutation"
"""The sampler of checkpoints that predate the `sampler` field."""

__all__ = ["DCP_METADATA", "INFO_FILE", "CheckpointInfo", "check_compatible", "is_committed", "load", "read_extra",
           "read_info", "save"]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    """Optimizer steps completed."""
    consumed_samples: int
    """Sampler stream position: samples used by the completed steps."""
    model: dict[str, Any]
    """The identity of the model the weights belong to (its workload's identity(): the [model] keys
    that shape the weights)."""
    tokenizer: str
    seed: int
    global_batch_size: int
    sampler: str = LEGACY_SAMPLER
    """Which sampler turned `consumed_samples` into sample ids (storage.sampler.SAMPLER_NAME)."""
    world_size: int = 0
    """Workers that saved it (for the log; any world size can load it)."""
    lr_schedule: LrSchedule | None = None
    """The schedule the steps were trained under (None in checkpoints that predate it); a resume continues it."""
    adaptive_batch: dict | None = None
    """With [train] batch_size = "adaptive": the batch of the next step and the noise-scale estimate
    (core.adaptive_batch.AdaptiveBatch.to_dict), so a resume goes on with the batch and learning rate it had."""
    dataset: str = ""
    """The training samples' identity (DataSpec.fingerprint); "" in checkpoints that predate it."""

    @classmethod
    def for_spec(cls, spec: WorkerSpec, step: int, consumed_samples: int, world_size: int = 0,
                 adaptive_batch: dict | None = None) -> CheckpointInfo:
        """`spec` is the group's, as the coordinator made it. The batch recorded is [train]'s, the one
        the sampler and the schedule count steps of: a goodput plan of an adaptive run may start at
        another, and an adaptive run's current batch is in `adaptive_batch`."""
        return cls(step, consumed_samples, spec.workload.identity(), spec.data.tokenizer, spec.train.seed,
                   spec.train.global_batch_size, SAMPLER_NAME, world_size, spec.lr_schedule, adaptive_batch,
                   spec.data.fingerprint)


def read_info(directory: str | Path | Location) -> CheckpointInfo:
    location = Location.parse(directory, error=CheckpointError)
    if not is_committed(location) or not (location / INFO_FILE).is_file():
        raise CheckpointError(f"not a committed archipelago checkpoint (needs {DCP_METADATA} and {INFO_FILE})",
                              where=str(location), fix="point at a step_* directory inside a run directory")
    try:
        fields = json.loads((location / INFO_FILE).read_bytes())
        schedule = fields.pop("lr_schedule", None)
        info = CheckpointInfo(**fields, lr_schedule=None if schedule is None else LrSchedule.from_dict(schedule))
        if info.adaptive_batch is not None:  # read here, where its damage is this file's, not on a worker's resume
            AdaptiveBatch.from_dict(info.adaptive_batch)
        return info
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{INFO_FILE} is unreadable ({e})", where=str(location),
                              fix="resume from an earlier checkpoint or start over") from None


def check_compatible(info: CheckpointInfo, *, identity: dict[str, Any], seed: int, tokenizer: str,
                     global_batch_size: int, directory: str | Path | Location, dataset: str = "") -> None:
    """Refuses a checkpoint whose weights or data stream do not belong to this job: another model
    (`identity`, the job's workload's), another [train] seed or global batch, another tokenizer, other
    training samples (`dataset`, DataSpec.fingerprint; not compared where either side does not know it)."""
    differ = [f"{k}: checkpoint {info.model.get(k)!r}, config {identity.get(k)!r}"
              for k in dict.fromkeys([*identity, *info.model]) if k != "dropout" and info.model.get(k) != identity.get(k)]
    if differ:
        raise CheckpointError(f"checkpoint is from another model ({'; '.join(differ)})", where=str(directory),
                              fix="resume with the [model] section it was trained with, or start a new run (--overwrite or another name)")
    if info.tokenizer != tokenizer:
        raise CheckpointError(f"checkpoint was trained on {info.tokenizer!r} tokens, the dataset has {tokenizer!r}",
                              where=str(directory), fix="resume with the dataset it was trained on")
    if info.dataset and dataset and info.dataset != dataset:
        # The sampler's position counts samples of the dataset it was trained on: on others it would
        # go on at samples that are not the next ones.
        raise CheckpointError(f"checkpoint was trained on other samples (dataset fingerprint {info.dataset}, the "
                              f"dataset's is {dataset})", where=str(directory),
                              fix="resume with the dataset it was trained on; to train on new data, export the run "
                                  "(`archipelago export`) and start a new run from it ([model] hf_dir)")
    if info.seed != seed:
        # The sample order is a function of the seed: another seed would repeat some samples of the
        # current epoch and skip others.
        raise CheckpointError(f"checkpoint's data order came from [train] seed = {info.seed}, the config has "
                              f"{seed}; resuming would repeat and skip samples", where=str(directory),
                              fix=f"set [train] seed = {info.seed} to resume, or start a new run (--overwrite or another name)")
    if info.global_batch_size != global_batch_size:
        # The sampler's position and the schedule count steps of this many samples; the elastic rules keep it
        # fixed when workers come and go, so a change can only come from the config.
        raise CheckpointError(f"checkpoint's steps took [train] global_batch_size = {info.global_batch_size} samples, "
                              f"the config has {global_batch_size}", where=str(directory),
                              fix=f"set [train] global_batch_size = {info.global_batch_size} to resume, or start a new "
                                  "run (--overwrite or another name)")
    if info.sampler != SAMPLER_NAME:
        raise CheckpointError(f"checkpoint's data order came from sampler {info.sampler!r}, this archipelago uses "
                              f"{SAMPLER_NAME!r}, so it would not continue at the same samples", where=str(directory),
                              fix="start a new run (--overwrite or another name)")


def save(location: str | Path | Location, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         info: CheckpointInfo, *, async_save: bool = False, process_group: Any = None,
         extra: dict[str, bytes] | None = None) -> PendingSave:
    """Collective: every rank calls it. With async_save the state is copied to host memory before it returns.

    `extra`: more files the coordinator writes beside `archipelago.json` (the sample ledger), before `.metadata`."""
    model_state, optim_state = get_state_dict(model, optimizer)
    extra = {INFO_FILE: json.dumps(dataclasses.asdict(info), indent=2).encode(), **(extra or {})}
    return save_checkpoint({"model": model_state, "optimizer": optim_state}, location, extra=extra,
                           async_save=async_save, process_group=process_group)


def read_extra(directory: str | Path | Location, name: str) -> bytes | None:
    """A file saved through `save(extra=…)` in a committed checkpoint; None when it has none."""
    path = Location.parse(directory, error=CheckpointError) / name
    return path.read_bytes() if path.is_file() else None


def load(location: str | Path | Location, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         info: CheckpointInfo | None = None, reader: ReaderKind = "auto",
         process_group: Any = None) -> tuple[CheckpointInfo, set[str]]:
    """Collective: loads weights and optimizer state in place; returns the info and the reader kinds used.

    `info`: the step's `archipelago.json` when the caller has read it already (read here otherwise).
    """
    info = info if info is not None else read_info(location)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    used = load_checkpoint(state, location, reader=reader, process_group=process_group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return info, used


class RunCheckpoints:
    """One worker's side of a run's checkpoints: restore the newest committed step, save, keep the last K.

    Every rank makes one (it creates a gloo group for checkpoint collectives, itself a collective).
    An async save is awaited before the next save starts and at the end of training, so at most one
    is in flight; a step is reported committed only once its `.metadata` is written.
    """

    def __init__(self, root: str | Path | Location, spec: WorkerSpec, rank: int):
        self.store = CheckpointStore(root)
        self.spec = spec
        self.settings = spec.checkpoint
        self.rank = rank
        self.group = checkpoint_group()
        self._pending: tuple[int, PendingSave] | None = None
        self.restored_from: Location | None = None
        """The committed step directory the last `restore` loaded (None: a fresh start)."""

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                resume_from: str | None = None) -> tuple[CheckpointInfo, set[str]] | None:
        """Loads the newest committed step (after removing half-written ones); None for a fresh run."""
        self._on_rank0(self.store.remove_uncommitted)
        latest = self.store.latest()
        if latest is None:
            if resume_from:
                raise CheckpointError("the checkpoint to resume from is gone", where=resume_from,
                                      fix="run without --resume to start over")
            return None
        info = read_info(latest)
        check_compatible(info, identity=self.spec.workload.identity(), seed=self.spec.train.seed,
                         tokenizer=self.spec.data.tokenizer, global_batch_size=self.spec.train.global_batch_size,
                         directory=latest, dataset=self.spec.data.fingerprint)
        self.restored_from = latest
        return load(latest, model, optimizer, info=info, reader=self.settings.reader,
                    process_group=self.group)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: CheckpointInfo, *,
             extra: dict[str, bytes] | None = None, wait: bool = False) -> list[int]:
        """Starts saving `info.step`; returns the steps committed during this call (with wait, or without
        async_save, `info.step` among them)."""
        committed = self.wait()
        pending = save(self.store.step(info.step), model, optimizer, info,
                       async_save=self.settings.async_save and not wait, process_group=self.group,
                       extra=extra)
        self._pending = (info.step, pending)
        return committed + ([] if self.settings.async_save and not wait else self.wait())

    def wait(self) -> list[int]:
        """Blocks until the save in flight (if any) is committed, then applies retention."""
        if self._pending is None:
            return []
        step, pending = self._pending
        self._pending = None
        pending.result()
        self._on_rank0(lambda: self.store.prune(self.settings.keep_last))
        return [step]

    def _on_rank0(self, fn) -> None:
        if self.group is None:
            fn()
            return
        if self.rank == 0:
            fn()
        dist.barrier(group=self.group)
