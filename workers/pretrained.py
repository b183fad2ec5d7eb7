"""Pretrained weights into the model a worker trains, after wrapping: each rank reads only its shard.

    used = load_pretrained(engine.model, spec.model, process_group=group, reader="auto")  # fresh start, every rank

[model] hf_dir's safetensors are read straight into the (FSDP2-sharded, or replicated) parameters,
file by file, tensor slice by tensor slice: no rank ever holds the whole state dict.
- kind = "hf": torch.distributed.checkpoint's HuggingFaceStorageReader loads the tensors by their own
  names (DCP plans which slice of which file each rank's shards need, and reads only those).
- kind = "llama": the built-in stacks and permutes HF tensors (workers/models/hf_weights.py), which
  DCP's reader cannot do; each rank reads the rows of its shard of each parameter with safetensors'
  row reads instead (FSDP2's and column-wise tensor parallelism's dim-0 shards; row-wise tensor
  parallelism's column shards are cut from whole rows).
Both read the bytes through storage/safetensors_io.py's TensorReads, as checkpoints are read: on GPUs
with kvikio straight into GPU memory where it runs (`[checkpoint] reader`), else POSIX reads.
A resumed or restarted run loads its checkpoint instead (workers/loop.py); these weights are its step 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from core.config import ModelConfig
from core.errors import ConfigError
from storage.readers import ReaderKind
from storage.safetensors_io import SafetensorsStorageReader, TensorReads
from workers.models.hf import PREFIX, expected_weights
from workers.models.hf_weights import llama_layout, read_rows, safetensors_files, stored_tensors


def load_pretrained(model: torch.nn.Module, config: ModelConfig, *, process_group: Any = None,
                    reader: ReaderKind = "auto", threads: int = 8) -> str | None:
    """Loads hf_dir's weights into `model` in place (collective under torch.distributed: every rank
    calls it); the kind of reader they were read with ("kvikio", "posix"), or None when there were
    none to load (no hf_dir, or no safetensors in it)."""
    if not config.hf_dir or not safetensors_files(config.hf_dir):
        return None
    device = next(model.parameters()).device
    with TensorReads(config.hf_dir, device, reader=reader, threads=threads) as reads:
        if config.kind == "hf":
            _load_by_name(model, config.hf_dir, reads, process_group)
        else:
            _load_llama_rows(model, config, reads)
        _check_finite(model, config.hf_dir, process_group)
        return reads.kind


@torch.no_grad()
def _check_finite(model: torch.nn.Module, hf_dir: str, process_group: Any) -> None:
    """Collective: weights holding NaN or inf would train a run of NaN losses to its end."""
    named = [(name, _local_part(param)[0]) for name, param in model.named_parameters()]
    finite = torch.stack([torch.isfinite(local).all() for _, local in named])
    bad = (~finite).int().max().reshape(1)  # one read of the device for every parameter
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=process_group)
    if bad.item():
        first = next((name.removeprefix(PREFIX) for (name, _), ok in zip(named, finite.tolist()) if not ok),
                     "one on another rank")
        raise ConfigError(f"the pretrained weights hold NaN or infinity (first: {first})", where=f"[model] hf_dir = {hf_dir}",
                          fix="download the weights again, or take a checkpoint saved before its run diverged")


def _load_by_name(model: torch.nn.Module, hf_dir: str, reads: TensorReads, process_group: Any) -> None:
    wanted = expected_weights(model)
    state = {name.removeprefix(PREFIX): value for name, value in get_model_state_dict(model).items()
             if name.removeprefix(PREFIX) in wanted}
    dcp.load(state, storage_reader=SafetensorsStorageReader(hf_dir, reads), process_group=process_group)
    set_model_state_dict(model, {PREFIX + name: value for name, value in state.items()},
                         options=StateDictOptions(strict=False))


@torch.no_grad()
def _load_llama_rows(model: torch.nn.Module, config: ModelConfig, reads: TensorReads) -> None:
    layout, stored = llama_layout(config), stored_tensors(config.hf_dir)
    for name, param in model.named_parameters():
        local, offset = _local_part(param)
        if local.numel():
            rows = read_rows(layout[name], offset[0], offset[0] + local.shape[0], stored, reads)
            columns = [slice(start, start + size) for start, size in zip(offset[1:], local.shape[1:], strict=True)]
            local.copy_(rows[(slice(None), *columns)])


def _local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of a parameter and where it starts in each dimension: FSDP2 and column-wise
    tensor parallelism shard dim 0, row-wise tensor parallelism dim 1 (whose whole rows are read, then cut)."""
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.dim()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(offset)
