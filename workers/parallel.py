"""How the model is spread over the workers: DDP with a comm hook, or FSDP2 with one shard group per block.

Compilation is applied where it works best with each: DDP is compiled as a whole (Dynamo's
DDPOptimizer splits the graph at bucket boundaries so all-reduces overlap backward, or compiled
autograd captures them); FSDP2 compiles each block before sharding it (the torchtitan recipe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import JobConfig
from workers.comm.groups import build_island_groups
from workers.comm.hooks import HookState, make_hook
from workers.comm.stats import CommStats
from workers.compiler import maybe_compile
from workers.models.gpt import GPT
from workers.precision import Precision


@dataclass
class WrappedModel:
    forward: torch.nn.Module
    """What the training step calls: the DDP/FSDP (and possibly compiled) module."""
    ddp: DistributedDataParallel | None
    fsdp: bool
    hook_state: HookState | None
    fullgraph: bool
    """Whether compile was asked for one graph (False where the wrapping splits it)."""

    def sync_gradients(self, enabled: bool):
        """Context for one micro-batch: gradients are reduced only on the last micro-batch."""
        import contextlib
        if self.ddp is not None and not enabled:
            return self.ddp.no_sync()
        if self.fsdp:
            self.forward.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()


def wrap(model: GPT, config: JobConfig, precision: Precision, device: torch.device, *,
         bucket_cap_mb: float, island_ranks: list[list[int]], comm_stats: CommStats) -> WrappedModel:
    model.set_activation_checkpointing(config.parallel.activation_checkpointing)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        fullgraph = config.compile.fullgraph
        return WrappedModel(maybe_compile(model, config.compile, fullgraph=fullgraph), None, False, None, fullgraph)
    if config.parallel.strategy == "fsdp":
        return _wrap_fsdp(model, config, precision)
    return _wrap_ddp(model, config, device, world, bucket_cap_mb, island_ranks, comm_stats)


def _wrap_ddp(model: GPT, config: JobConfig, device: torch.device, world: int, bucket_cap_mb: float,
              island_ranks: list[list[int]], comm_stats: CommStats) -> WrappedModel:
    par = config.parallel
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    islands = build_island_groups(island_ranks) if par.comm_hook == "hierarchical" else None
    hook, state = make_hook(par.comm_hook, stats=comm_stats, world_size=world, islands=islands,
                            warmup_steps=par.comm_warmup_steps, powersgd_rank=par.powersgd_rank,
                            topk_ratio=par.topk_ratio)
    compiled_autograd = config.compile.enable and config.compile.ddp_mode == "compiled_autograd"
    if compiled_autograd:
        # DDP's C++ reducer cannot be traced; the Python reducer's all-reduces become part of the
        # compiled backward graph (and can be reordered against compute by Inductor).
        torch._dynamo.config.optimize_ddp = "python_reducer"
        torch._dynamo.config.compiled_autograd = True
        state = None
    else:
        ddp.register_comm_hook(state, hook)
    # DDP measures compute, communication and their overlap on a sample of iterations; every
    # iteration here, so each metrics window reads a fresh sample.
    ddp._set_ddp_runtime_logging_sample_rate(1)
    return WrappedModel(maybe_compile(ddp, config.compile, fullgraph=compiled_autograd), ddp, False, state,
                        compiled_autograd)


def _wrap_fsdp(model: GPT, config: JobConfig, precision: Precision) -> WrappedModel:
    # Parameters are gathered in the autocast dtype and gradients reduced in fp32.
    policy = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        if config.compile.enable:
            block.compile(mode=None if config.compile.mode == "default" else config.compile.mode,
                          fullgraph=config.compile.fullgraph)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return WrappedModel(model, None, True, None, config.compile.enable and config.compile.fullgraph)
