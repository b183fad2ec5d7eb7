"""Activation checkpointing of any model's blocks: recompute their activations in backward.

    set_activation_checkpointing(workload.blocks(model), "selective")   # or "full", or "off"

Each block's forward is replaced, on the block itself, by one that runs it under
torch.utils.checkpoint; the blocks' parameters keep their names, so checkpoints load either way,
and switching back to "off" restores the block's own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("off", "selective", "full")

# Selective checkpointing keeps what is expensive to recompute (matmuls, attention) and recomputes the
# cheap, memory-hungry rest (norms, activations, residual adds) in backward.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed(forward, mode: str, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    context = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)} \
        if mode == "selective" else {}
    # The recomputed forward draws the random numbers the first one drew (a model's dropout masks): without the
    # generator's state kept, backward would differentiate through other masks than the loss was made with.
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **context, **kwargs)


def set_activation_checkpointing(blocks: Iterable[torch.nn.Module], mode: str) -> None:
    """Recompute each block's activations in backward: "off", "selective" or "full"."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    for block in blocks:
        if "forward" in block.__dict__:  # ours: the class's forward is back once it goes
            del block.forward
        if mode != "off":
            block.forward = functools.partial(_recomputed, block.forward, mode)
        block.activation_checkpointing = mode


def activation_checkpointing(block: torch.nn.Module) -> str:
    """The mode set_activation_checkpointing gave `block` ("off" if none)."""
    return getattr(block, "activation_checkpointing", "off")
