"""How the model is spread over the workers: DDP with a comm hook, FSDP2 with one shard group per
block, or on the plan's device mesh: tensor parallelism inside islands and FSDP2 (sharded, hybrid
sharded, or replicated) across.

Compilation is applied where it works best with each: DDP is compiled as a whole (Dynamo's
DDPOptimizer splits the graph at bucket boundaries so all-reduces overlap backward, or compiled
autograd captures them), or block by block under the next-forward overlap, which runs between
blocks; FSDP2 compiles each block before sharding it (the torchtitan recipe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._dynamo.utils import maybe_enable_compiled_autograd
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from core.config import CompileConfig
from core.plan import DataParallel, Plan
from core.spec import WorkerSpec
from workers.activation_checkpointing import set_activation_checkpointing
from workers.comm.groups import build_island_groups
from workers.comm.hooks import HookState, make_hook
from workers.comm.local_norm import LocalGradientNorm
from workers.comm.overlap import NextForwardOverlap
from workers.comm.stats import CommStats
from workers.compiler import compile_options, maybe_compile
from workers.models.stack import BlockStack
from workers.precision import Precision
from workers.tensor_parallel import apply_tensor_parallel, data_parallel_mesh, device_mesh, loss_context


@dataclass
class WrappedModel:
    forward: torch.nn.Module
    """What the training step calls: the DDP/FSDP (and possibly compiled) module."""
    ddp: DistributedDataParallel | None
    fsdp: bool
    hook_state: HookState | None
    """The DDP comm hook's state (it counts bytes and holds deferred checks); None without a hook."""
    compiled_autograd: bool = False
    """Backward runs under compiled autograd, which traces DDP's all-reduces into the backward graph."""
    local_norm: LocalGradientNorm | None = None
    """Reads this rank's gradient buckets before their reduction (the noise scale); None where no comm hook runs."""
    tensor_parallel: bool = False
    """The model is split over a tensor-parallel group: its loss is a DTensor made on vocabulary shards."""

    @property
    def dtensor_parameters(self) -> bool:
        """The parameters are DTensors (FSDP2 shards, tensor-parallel splits), not plain tensors."""
        return self.fsdp or self.tensor_parallel

    def loss_context(self):
        """Context for the forward that makes the loss (loss parallel under tensor parallelism)."""
        return loss_context(self.tensor_parallel)

    def backward_context(self):
        """Context for loss.backward(). Compiled autograd is entered only around the backward call:
        torch._dynamo.config.compiled_autograd alone covers backward calls made inside a compiled
        function, and the engine calls backward outside the compiled module. Loss parallel covers
        backward as well as forward."""
        if self.compiled_autograd:
            return maybe_enable_compiled_autograd(True)
        return loss_context(self.tensor_parallel)

    def sync_gradients(self, enabled: bool):
        """Context for one micro-batch: gradients are reduced only on the last micro-batch."""
        if self.ddp is not None and not enabled:
            return self.ddp.no_sync()
        if self.fsdp:
            self.forward.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()


def wrap(model: torch.nn.Module, spec: WorkerSpec, precision: Precision, device: torch.device,
         comm_stats: CommStats) -> WrappedModel:
    plan, blocks = spec.plan, spec.workload.blocks(model)
    set_activation_checkpointing(blocks, plan.activation_checkpointing)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return WrappedModel(maybe_compile(model, spec.compile, fullgraph=spec.compile.fullgraph), None, False, None)
    if plan.tensor_parallel_size > 1 or plan.data_parallel == DataParallel.HSDP:
        return _wrap_on_mesh(model, blocks, spec, precision, device)
    if plan.data_parallel == DataParallel.FSDP:
        return _wrap_fsdp(model, blocks, spec.compile, precision)
    return _wrap_ddp(model, spec, device, world, comm_stats)


def attach_overlap(wrapped: WrappedModel, model: BlockStack, optimizer: torch.optim.Optimizer, plan: Plan,
                   comm_stats: CommStats) -> NextForwardOverlap | None:
    """The next-forward overlap, hooked into DDP, when the plan runs it and there is DDP to hook (one
    worker alone has nothing to reduce); None otherwise."""
    if wrapped.ddp is None or plan.overlap != "next_forward":
        return None
    overlap = NextForwardOverlap(model, optimizer, world_size=dist.get_world_size(), stats=comm_stats,
                                 wire="bf16" if plan.comm_hook == "bf16" else "fp32",
                                 backward_share=plan.overlap_backward_share)
    overlap.register(wrapped.ddp)
    wrapped.hook_state = overlap.state
    return overlap


def _wrap_ddp(model: torch.nn.Module, spec: WorkerSpec, device: torch.device, world: int,
              comm_stats: CommStats) -> WrappedModel:
    plan, hooks = spec.plan, spec.plan.hook_settings
    compiled_autograd = spec.compile.uses_compiled_autograd
    # The next-forward overlap runs Python between blocks (BlockStack.before_stage): compile block by block.
    by_block = plan.overlap == "next_forward"
    if by_block:
        _compile_by_block(model, spec.workload.blocks(model), spec.compile)
    # DDP reads optimize_ddp once, in its constructor; both flags are process-wide, so every wrap
    # sets them either way (a later engine in the same process must not inherit them).
    # With compiled autograd, DDP's C++ reducer is replaced by the Python one, whose all-reduces
    # become part of the compiled backward graph (and can be reordered against compute by Inductor).
    torch._dynamo.config.optimize_ddp = "python_reducer" if compiled_autograd else "ddp_optimizer"
    torch._dynamo.config.compiled_autograd = compiled_autograd
    # With the all-reduces in the backward graph, Inductor can move each one to start as soon as its
    # gradients exist and sink its wait to their first use (unmeasured on several GPUs so far).
    inductor_config.reorder_for_compute_comm_overlap = compiled_autograd
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=plan.bucket_cap_mb, gradient_as_bucket_view=True)
    state, local_norm = None, None
    if not (compiled_autograd or by_block):  # the overlap registers its own hook (attach_overlap)
        islands = (build_island_groups(plan.intra_island_groups, plan.inter_island_groups)
                   if plan.comm_hook == "hierarchical" else None)
        hook, state = make_hook(plan.comm_hook, stats=comm_stats, world_size=world, islands=islands,
                                warmup_steps=hooks.warmup_steps, powersgd_rank=hooks.powersgd_rank,
                                topk_ratio=hooks.topk_ratio, topk_ramp_steps=hooks.topk_ramp_steps,
                                topk_wire=hooks.topk_wire)
        local_norm = LocalGradientNorm()
        ddp.register_comm_hook(state, local_norm.wrap(hook))
    # DDP times compute, communication and their overlap on sampled iterations; a sampled iteration
    # waits for the previous one's timing events, so sample once per metrics window, not every step.
    ddp._set_ddp_runtime_logging_sample_rate(spec.train.log_every * plan.grad_accum_steps)
    forward = ddp if by_block else maybe_compile(ddp, spec.compile, fullgraph=compiled_autograd)
    return WrappedModel(forward, ddp, False, state, compiled_autograd=compiled_autograd, local_norm=local_norm)


def _wrap_fsdp(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], compile_config: CompileConfig,
               precision: Precision) -> WrappedModel:
    # Parameters are gathered in the autocast dtype and gradients reduced in fp32.
    policy = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
    _compile_by_block(model, blocks, compile_config)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # in place: the model itself is now the FSDP module
    return WrappedModel(model, None, True, None)


def _wrap_on_mesh(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], spec: WorkerSpec, precision: Precision,
                  device: torch.device) -> WrappedModel:
    """The torchtitan order: split each layer over the tensor-parallel ranks, compile block by block,
    then FSDP2 over the data-parallel dimensions (with one replica, tensor parallelism alone)."""
    plan = spec.plan
    mesh = device_mesh(plan, device)
    tensor_parallel = plan.tensor_parallel_size > 1
    if tensor_parallel:
        apply_tensor_parallel(model, spec.workload, mesh["tp"])
    _compile_by_block(model, blocks, spec.compile)
    replicas = plan.world_size // plan.tensor_parallel_size
    if replicas > 1:
        policy = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
        dp_mesh = data_parallel_mesh(plan, mesh)
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return WrappedModel(model, None, replicas > 1, None, tensor_parallel=tensor_parallel)


def _compile_by_block(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], compile_config: CompileConfig) -> None:
    """Compiles each block, and a built-in model's head, in place (names unchanged, so checkpoints load
    either way); what runs between them, embeddings included, stays eager (the torchtitan recipe)."""
    if not compile_config.enable:
        return
    options = compile_options(compile_config, fullgraph=compile_config.fullgraph)
    for block in blocks:
        block.compile(**options)
    if isinstance(model, BlockStack):
        model.head = torch.compile(model.head, **options)
