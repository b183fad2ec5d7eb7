"""How big the job's model is: parameters, the shapes DDP reduces, and training FLOPs per token,
counted from the workload's own model on the meta device (no weights are made).

    facts = model_facts(workload, seq_len=2048)
    facts.parameters, facts.flops_per_token, facts.shapes, facts.blocks, facts.width

FLOPs are counted, not derived from a formula: torch's FlopCounterMode over one forward and backward
of the workload's loss on a meta batch of one sample (matmuls and attention; the meta device runs
attention as matmuls, so it is counted, in full, as the usual 6N + 12·L·d·T formula counts it). A
model the meta device cannot run is counted on fake tensors, and one neither can run as 6 FLOPs per
parameter per token, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

from core.workload import Workload
from workers.models.factory_checks import fake_tensors


@dataclass(frozen=True, slots=True)
class ModelFacts:
    parameters: int
    """Distinct parameters (a tied weight once)."""
    flops_per_token: float
    """Training FLOPs per token: forward and backward, counted."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the trained parameters, in the model's order: what DDP reduces gradients of."""
    blocks: int
    """The workload's repeated blocks (what per-block overheads and pipeline-free sharding count)."""
    width: int
    """The residual stream's width: the input features of the first block's first linear layer (n_embd
    for the built-in models). Wider models keep matrix units busier (planning/compute.py)."""
    counted: bool = True
    """False when neither the meta device nor fake tensors could run the model and FLOPs are 6 per
    parameter (the plan says so in a note)."""


def model_facts(workload: Workload, seq_len: int) -> ModelFacts:
    """The workload's facts at `seq_len` tokens a sample; counted once per model identity and length."""
    key = (repr(workload.identity()), seq_len)
    if key not in _FACTS:
        _FACTS[key] = _measure(workload, seq_len)
    return _FACTS[key]


_FACTS: dict[tuple[str, int], ModelFacts] = {}


def _measure(workload: Workload, seq_len: int) -> ModelFacts:
    with torch.device("meta"):
        model = workload.build()
    trained = [p for p in model.parameters() if p.requires_grad]
    blocks = list(workload.blocks(model))
    parameters = sum(p.numel() for p in model.parameters())
    flops, counted = _count_flops(workload, model, seq_len)
    return ModelFacts(parameters=parameters, flops_per_token=flops if counted else 6.0 * parameters,
                      shapes=tuple(tuple(p.shape) for p in trained), blocks=len(blocks),
                      width=_width(blocks[0] if blocks else model), counted=counted)


def _count_flops(workload: Workload, model: torch.nn.Module, seq_len: int) -> tuple[float, bool]:
    """On the meta model; a model whose forward reads a value (transformers checks whether position ids
    restart, a meta tensor has none; a model of the user's calls .item()) is counted again on fake meta
    tensors, which such code takes for tracing and does not read, or reads as an unknown number."""
    for fake in (False, True):
        try:
            with fake_tensors() if fake else contextlib.nullcontext():
                with torch.device("meta"):
                    counted_model = workload.build() if fake else model
                tokens = torch.zeros((1, seq_len + 1), dtype=torch.long, device="meta")
                with FlopCounterMode(display=False) as counter:
                    workload.loss(counted_model, tokens[:, :-1], tokens[:, 1:], loss_kernel="plain").backward()
            return float(counter.get_total_flops()) / seq_len, True  # float() raises for a count hanging on a read value
        except Exception:  # noqa: BLE001 - an op the meta device (then fake tensors) cannot run
            continue
    return 0.0, False


def _width(module: torch.nn.Module) -> int:
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is not None:
        return linear.in_features
    embedding = next((m for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)
    return embedding.embedding_dim if embedding is not None else 1
