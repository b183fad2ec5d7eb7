"""What the built-in models share: token embeddings, a stack of blocks, a final norm and a head.

The engine reaches into no model class: it talks to workloads (core/workload.py). Two things it can
do only with a model written for them, which the built-in GPT and Llama are:
- act between blocks: the next-forward overlap (workers/comm/overlap.py) sets `before_stage`, which
  the forward calls before the embeddings (0) and before block i (i + 1), and reads which stage first
  uses each parameter (`forward_stages`);
- compile the head apart: FSDP2 compiles block by block, and `head` (final norm, output projection
  and loss) is compiled too, since its logits cost time and memory eagerly;
- split across a tensor-parallel group: `tensor_parallel_plan` (workers/models/tensor_plans.py) says
  how each module splits, and `head` computes the loss on vocabulary shards when the output
  projection is split (loss parallel).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from kernels.loss import counted_rows, ignore_masked, linear_cross_entropy, plain_cross_entropy
from workers.models.chunked_loss import chunked_cross_entropy

LOSS_KERNELS = ("fused", "plain", "chunked")


def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None, loss_kernel: str,
              norm: nn.Module | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The output projection (after `norm`, when given) and its loss: the mean cross-entropy over the
    targets `loss_mask` keeps (all without one) when targets are given, else the logits. loss_kernel:
    "plain" (F.cross_entropy over fp32 logits), "fused" (kernels.loss: the final norm and the logits'
    gradient made in the forward pass, inside one op) or "chunked" (workers.models.chunked_loss: the
    (tokens × vocab) logits never exist whole)."""
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"loss_kernel must be one of {LOSS_KERNELS}, got {loss_kernel!r}")
    identity = norm if norm is not None else nn.Identity()
    if targets is None:
        return F.linear(identity(x), weight)
    targets = ignore_masked(targets, loss_mask).reshape(-1)
    if loss_kernel == "fused":  # the op runs the final norm itself (kernels/loss.py)
        return linear_cross_entropy(x.reshape(-1, x.size(-1)), weight, targets, norm)
    x = identity(x).reshape(-1, x.size(-1))
    if loss_kernel == "chunked":
        return chunked_cross_entropy(x, weight, targets)
    return plain_cross_entropy(F.linear(x, weight), targets)


class BlockStack(nn.Module, ABC):
    blocks: nn.ModuleList

    def __init__(self) -> None:
        super().__init__()
        self.before_stage: Callable[[int], None] | None = None
        """Called with 0 before the embeddings and i + 1 before block i, when set."""

    def stage(self, index: int) -> None:
        if self.before_stage is not None:
            self.before_stage(index)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None, loss_kernel: str,
             loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, output projection and loss (head_loss; under tensor parallelism, on the
        vocabulary shards)."""
        weight = self.output_weight()
        if isinstance(weight, DTensor):
            return self._vocabulary_sharded_head(x, targets, loss_mask)
        return head_loss(x, weight, targets, loss_kernel, self.final_norm, loss_mask)

    def _vocabulary_sharded_head(self, x: torch.Tensor, targets: torch.Tensor | None,
                                 loss_mask: torch.Tensor | None) -> torch.Tensor:
        """The head under tensor parallelism: the final norm hands over the whole sequence as a DTensor
        (tensor_plans.final_norm_styles), the logits stay split by vocabulary, and cross-entropy runs
        on the shards (call it inside torch's loss_parallel(), forward and backward). The fused and
        chunked kernels need whole vocabulary rows, so every loss_kernel is this one here. The mean
        is over the targets loss_mask keeps, as plain_cross_entropy's."""
        logits = F.linear(self.final_norm(x), self.output_weight())
        if targets is None:
            return logits.full_tensor()
        targets = ignore_masked(targets, loss_mask).reshape(-1)
        summed = F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="sum")
        return summed / counted_rows(targets)

    @abstractmethod
    def tensor_parallel_plan(self) -> dict[str, list[ParallelStyle]]:
        """Module path -> the parallel styles applied to it, in order (workers/models/tensor_plans.py)."""

    def tie_weights(self) -> None:
        """Shares the embedding's matrix with the head again where the model ties them: parallelizing
        replaces each module's parameters with new DTensors, one per module."""

    @property
    @abstractmethod
    def final_norm(self) -> nn.Module:
        """The norm before the output projection."""

    @abstractmethod
    def output_weight(self) -> torch.Tensor:
        """The output projection's weight (the token embedding's when tied)."""

    @abstractmethod
    def embedding_modules(self) -> list[nn.Module]:
        """What the forward uses before the first block."""

    @abstractmethod
    def head_modules(self) -> list[nn.Module]:
        """What the forward uses after the last block."""

    def forward_stages(self) -> dict[int, int]:
        """id(parameter) -> the forward stage that uses it first: 0 the embeddings, i + 1 block i, and
        the head's parameters with the last block's (the head has no call of its own). A weight the
        head shares with the embedding (tied) is the embedding's."""
        stages: dict[int, int] = {}
        last = len(self.blocks)
        for module, stage in [*((m, 0) for m in self.embedding_modules()),
                              *((block, i + 1) for i, block in enumerate(self.blocks)),
                              *((m, last) for m in self.head_modules())]:
            for p in module.parameters():
                stages.setdefault(id(p), stage)
        return stages

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
