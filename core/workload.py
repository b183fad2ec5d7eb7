"""The model a job trains, as everything else meets it: one small interface.

    workload = make_workload(config.model)       # workers/models: gpt, llama, or the user's factory
    with torch.device("meta"):
        model = workload.build()                 # initialised on torch's current default device
    loss = workload.loss(model, inputs, targets, loss_kernel="fused")   # mean over the targets
    loss = workload.loss(model, inputs, targets, loss_mask=mask, positions=positions)  # fine-tuning data
    workload.blocks(model)                       # FSDP2 shards, compiles and checkpoints each
    workload.tensor_parallel_plan(model)         # optional: {module path: [ParallelStyle]}, and
    workload.tie_weights(model)                  # re-ties shared weights once parallelized (gpt, llama)

The planner sizes the model (parameters, FLOPs per token counted on fake tensors) and estimates its
memory through it; the engine builds, wraps, compiles, converts to float8 and checkpoints it through
it; the bill takes its FLOPs. No code outside the workload names a model class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: core imports no torch
    import torch


@runtime_checkable
class Workload(Protocol):
    name: str
    """What the run's reports call the model ("gpt", "llama", or the factory's path)."""

    def identity(self) -> dict[str, Any]:
        """What makes the weights this model's: checkpoints record it and refuse another's."""

    def build(self) -> torch.nn.Module:
        """A new model, initialised, on torch's current default device (meta or fake tensors for
        planning, the worker's device for training). The same torch seed gives the same weights."""

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
             loss_kernel: str = "plain", loss_mask: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy of `model` (what build() made, maybe wrapped by DDP, FSDP2 or
        torch.compile: call it, do not reach inside) predicting `targets` from `inputs`, both
        (batch, seq) token ids. loss_kernel: "fused", "plain" or "chunked" ([train] loss_kernel);
        a workload may compute every one the same way.

        Fine-tuning datasets (storage/flags.py) add two (batch, seq) tensors; the engine passes them
        only then, so a workload for pretraining data alone may leave them out of its signature:
        loss_mask (bool): the targets that count, the mean is over them (kernels.loss.IGNORE_INDEX);
        positions (int64): each input token's place in its packed document, 0 where one starts, for a
        model that restarts its positions and keeps attention inside each document."""

    def blocks(self, model: torch.nn.Module) -> Sequence[torch.nn.Module]:
        """The model's repeated layers in forward order: FSDP2 shards each, torch.compile compiles
        each where the model is compiled block by block, activation checkpointing wraps each."""
