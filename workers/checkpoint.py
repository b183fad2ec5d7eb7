"""Checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), plus `archipelago.json`.

DCP writes one file per rank and `.metadata` last; it reshards at load time, so a checkpoint
saved by N workers loads on M. `archipelago.json` (written by rank 0) holds what is needed to
continue exactly — the step and the sampler position — and what identifies the job (model
shape, tokenizer, seed, global batch) so a checkpoint of another model is refused with a clear
error instead of a shape mismatch from deep inside torch.

A checkpoint directory counts as committed when both `.metadata` and `archipelago.json` exist.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from orchestrator.config import JobConfig
from orchestrator.errors import CheckpointError

INFO_FILE = "archipelago.json"
DCP_METADATA = ".metadata"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    """Optimizer steps completed."""
    consumed_samples: int
    """Sampler stream position: samples used by the completed steps."""
    model: dict[str, Any]
    """The ModelConfig the weights belong to."""
    tokenizer: str
    seed: int
    global_batch_size: int

    @classmethod
    def for_job(cls, config: JobConfig, step: int, consumed_samples: int, tokenizer: str) -> CheckpointInfo:
        return cls(step, consumed_samples, dataclasses.asdict(config.model), tokenizer, config.train.seed,
                   config.train.global_batch_size)


def dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_committed(directory: Path) -> bool:
    return (directory / DCP_METADATA).is_file() and (directory / INFO_FILE).is_file()


def read_info(directory: Path) -> CheckpointInfo:
    if not is_committed(directory):
        raise CheckpointError(f"not a committed archipelago checkpoint (needs {DCP_METADATA} and {INFO_FILE})",
                              where=str(directory), fix="point at a step_* directory inside a run directory")
    try:
        return CheckpointInfo(**json.loads((directory / INFO_FILE).read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{INFO_FILE} is unreadable ({e})", where=str(directory),
                              fix="resume from an earlier checkpoint or start over") from None


def check_compatible(info: CheckpointInfo, config: JobConfig, tokenizer: str, directory: Path) -> None:
    """Refuses a checkpoint whose weights or data stream do not belong to this job."""
    current = dataclasses.asdict(config.model)
    differ = [f"{k}: checkpoint {info.model.get(k)!r}, config {v!r}" for k, v in current.items()
              if k != "dropout" and info.model.get(k) != v]
    if differ:
        raise CheckpointError(f"checkpoint is from another model ({'; '.join(differ)})", where=str(directory),
                              fix="resume with the [model] section it was trained with, or start a new run (--overwrite or another name)")
    if info.tokenizer != tokenizer:
        raise CheckpointError(f"checkpoint was trained on {info.tokenizer!r} tokens, the dataset has {tokenizer!r}",
                              where=str(directory), fix="resume with the dataset it was trained on")


def save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: CheckpointInfo,
         rank: int) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))
    if rank == 0:
        (directory / INFO_FILE).write_text(json.dumps(dataclasses.asdict(info), indent=2))


def load(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointInfo:
    info = read_info(directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return info
