"""How the built-in models split across a tensor-parallel group (torch DTensor, Megatron-style).

    styles = gpt_plan(model)        # {module path: ParallelStyle}; parallelize_module(model, tp_mesh, styles)

Each block is the pattern of Megatron-LM with sequence parallelism: the norms run on a shard of the
sequence (SequenceParallel), the attention and MLP inputs are gathered whole, their first
projection is split by output rows (column-wise: each rank holds whole heads and hidden units, as
the models order their stacked rows, and the bias entries of its rows) and their second by input columns (row-wise), whose partial
sums are reduce-scattered back onto sequence shards. Between blocks each rank holds 1/t of the
sequence, so activations (and their memory) shrink with t.

The token embedding is split by vocabulary rows and hands out sequence shards, finished (see
FinishedOutput); GPT's position embedding is split by position rows the same way, so its sequence
shard adds to the tokens'. The final norm gathers the sequence back whole and the output projection
keeps the vocabulary split: the logits stay sharded by vocabulary and the loss is computed on the
shards (loss parallel, BlockStack.head). A tied head shares the embedding's vocabulary-sharded
matrix (same placement).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)


class FinishedOutput(ParallelStyle):
    """The module's output with its collective finished. torch's styles leave an output's
    redistribution in flight (an AsyncCollectiveTensor) for the next op to wait on. When that next op
    is a compiled block (the embeddings run eagerly, the blocks compiled), torch 2.13 unwraps the
    in-flight tensor without its requires_grad and traces the block as if its input needed no
    gradient: Llama's backward failed with "'Tensor' object has no attribute '_local_tensor'" (GPT's
    eager add of its two embeddings waited first). The unwrap came with pytorch/pytorch#179849; PR
    #191113 keeps requires_grad. wait_tensor passes the gradient through, as
    AsyncCollectiveTensor.wait() does not."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(_finish)
        return module


def _finish(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return wait_tensor(output)


def embedding_styles() -> list[ParallelStyle]:
    """Vocabulary rows split; whole token ids in, finished sequence shards out."""
    return [RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), FinishedOutput()]


def gathered_input(extra_inputs: int = 0) -> ParallelStyle:
    """A sublayer's input gathered from sequence shards into the whole sequence (other inputs as they are)."""
    return PrepareModuleInput(input_layouts=(Shard(1), *[None] * extra_inputs),
                              desired_input_layouts=(Replicate(), *[None] * extra_inputs))


def final_norm_styles() -> list[ParallelStyle]:
    """The final norm on sequence shards, its output gathered whole and kept a DTensor for the head."""
    return [SequenceParallel(), PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                                    use_local_output=False)]


def gpt_block_plan() -> dict[str, ParallelStyle]:
    return {
        "ln_1": SequenceParallel(),
        "attn": gathered_input(),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": gathered_input(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def llama_block_plan() -> dict[str, ParallelStyle]:
    return {
        "attention_norm": SequenceParallel(),
        "attention": gathered_input(extra_inputs=3),  # the rotary tables and the document mask pass through whole
        "attention.wqkv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gathered_input(),
        "feed_forward.w13": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
