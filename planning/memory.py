"""Peak memory per worker for (model, micro-batch, precision, optimizer, DDP or FSDP2), without a GPU.

    profile = memory.profile(config, device_type="cuda")      # fake steps at 3 micro-batches, ~1 s each for GPT-2
    profile.peak_bytes(micro_batch_size=16, data_parallel="ddp", world_size=8)
    profile.max_micro_batch(capacity_bytes=80 * 2**30, data_parallel="ddp", world_size=8)
    memory.measure_step(spec, micro_batch_size=16)            # one exact fake step

How: the worker's training step (workers/engine.py: build the workload's model, AdamW, micro-batches under
autocast, backward, clip, step) runs on fake tensors (`FakeTensorMode`: shapes and dtypes, no
data, no allocation) under a dispatch-level tracker that adds every new tensor storage's bytes
when an op creates it and subtracts them when the storage dies — what
`torch.distributed._tools.mem_tracker.MemTracker` does, without its per-module snapshots, which
cost a deep copy per op and made a GPT-2 step take 7 s instead of about one. Besides the peak,
the tracker keeps the highest live total less the live gradients, so the peak can be re-read
with every gradient held for the whole step as DDP's bucket views hold them.

Where this is exact and where it is a model:
- Parameters, gradients, AdamW states, activations, the loss and temporaries that ops allocate
  through the dispatcher are counted exactly, rounded to the CUDA caching allocator's 512-byte
  blocks for GPU targets. Scratch space a kernel allocates inside itself (flash-attention's
  backward accumulators, cuBLAS workspaces) is invisible; `KERNEL_WORKSPACE_BYTES` covers it.
- The fake step runs CPU kernels' shapes: SDPA saves output and log-sum-exp on CPU as flash
  attention does on CUDA, and CPU autocast casts the same ops to bf16. rms_norm is the exception
  found so far (the CPU's decomposition keeps an fp32 copy of the normalised input for backward,
  CUDA's fused kernel does not): for CUDA targets it runs as CUDA runs it (planning/as_cuda.py).
- DDP is the fake step's timeline with every gradient alive from the start (bucket views).
- FSDP2 and tensor parallelism are analytic on top of the measured breakdown (see `peak_bytes`).
- Between the measured micro-batches the peak is interpolated linearly (it is a maximum of
  terms linear in the micro-batch, plus the chunked loss's chunk that stops growing at 4,096
  rows); `measure_step` gives the exact figure, which the planner takes for the micro-batches it
  finally hands out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from core.config import JobConfig, ModelConfig, TrainConfig
from core.workload import Workload
from planning.as_cuda import cuda_ops
from planning.resolve import resolve_precision
from workers.activation_checkpointing import set_activation_checkpointing
from workers.compute_copy import Bf16ComputeCopy
from workers.models import make_workload
from workers.models.factory_checks import fake_tensors
from workers.optim import build_optimizer

DeviceType = Literal["cuda", "cpu"]
CUDA_BLOCK_BYTES = 512
"""The caching allocator rounds every allocation up to this (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize)."""
KERNEL_WORKSPACE_BYTES = {"cuda": 64 * 2**20, "cpu": 0}
"""Scratch the kernels allocate that no dispatcher-level tracker sees: cuBLAS/cuBLASLt workspaces
(32 MiB each on Hopper by default) and flash-attention backward accumulators."""
RUNTIME_RESERVE_BYTES = {"cuda": 1536 * 2**20, "cpu": 512 * 2**20}
"""Memory a worker needs that its allocator never reports: the CUDA context and kernels (~0.5 GiB
on Hopper), NCCL's buffers (~0.5 GiB for a few communicators), and the Python process itself."""
ALLOCATOR_SLACK = 0.05
"""Share of the device the caching allocator loses to fragmentation and rounding of cached blocks."""


@dataclass(frozen=True, slots=True)
class StepSpec:
    """Everything about a training step that decides its memory, apart from the micro-batch."""

    model: ModelConfig
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "bf16"
    """Resolved (not "auto"). fp16 and fp8 are measured as bf16: the same 2-byte activations (fp8
    keeps bf16 activations for backward and adds small scale tensors)."""
    activation_checkpointing: Literal["off", "selective", "full"] = "off"
    loss_kernel: Literal["fused", "plain", "chunked"] = "fused"
    device_type: DeviceType = "cuda"
    """What the step will run on: cuda rounds to allocator blocks and uses the fused AdamW."""
    bf16_weights: bool = False
    """[train] bf16_weights: a bf16 copy of the model trains and the fp32 masters take the step."""

    @classmethod
    def for_job(cls, config: JobConfig, *, device_type: DeviceType) -> StepSpec:
        precision = resolve_precision(config.train.precision, use_gpu=device_type == "cuda")
        return cls(model=config.model, precision=precision, device_type=device_type,
                   activation_checkpointing=config.parallel.activation_checkpointing,
                   loss_kernel=config.train.loss_kernel, bf16_weights=config.train.bf16_weights)


@dataclass(frozen=True, slots=True)
class StepMemory:
    """One fake training step's peak, and what was alive at that moment."""

    micro_batch_size: int
    peak_bytes: int
    """Single worker, gradients as the step allocates them, plus KERNEL_WORKSPACE_BYTES."""
    ddp_peak_bytes: int
    """The same step with every gradient alive throughout, as DDP's bucket views keep them."""
    parameter_bytes: int
    gradient_bytes: int
    """All gradients together (the size of one full set)."""
    optimizer_bytes: int
    activation_bytes: int
    """Everything else alive at the peak: saved activations, the loss, temporaries."""
    largest_block_parameter_bytes: int
    """Parameters of the largest transformer block: what FSDP2 gathers at once."""
    root_parameter_bytes: int
    """Parameters outside the blocks (embeddings, final norm): FSDP2's root unit."""


class _StorageTimeline(TorchDispatchMode):
    """Live bytes of tensor storages as ops create them and Python frees them, with their categories."""

    def __init__(self, round_to: int):
        super().__init__()
        self.round_to = round_to
        self.live = 0
        self.live_by_tag: dict[str, int] = {}
        self._tag_of: dict[int, tuple[str, int]] = {}
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.peak = 0
        self.peak_by_tag: dict[str, int] = {}
        self.peak_without_grads = 0
        """The highest live total less the live gradients: what DDP's bucket views add back in full."""

    def nbytes(self, storage: torch.UntypedStorage) -> int:
        size = storage.nbytes()
        return math.ceil(size / self.round_to) * self.round_to if self.round_to > 1 else size

    def add(self, tensor: torch.Tensor, tag: str | None) -> None:
        """Counts the tensor's storage if new; a tag (param, optimizer, grad) also re-labels a known one."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._tag_of:
            old_tag, size = self._tag_of[key]
            if tag is not None and old_tag != tag:  # e.g. a tensor made in backward becoming a .grad
                self.live_by_tag[old_tag] -= size
                self.live_by_tag[tag] = self.live_by_tag.get(tag, 0) + size
                self._tag_of[key] = (tag, size)
            return
        size = self.nbytes(storage)
        tag = tag or "other"
        self._tag_of[key] = (tag, size)
        self.live += size
        self.live_by_tag[tag] = self.live_by_tag.get(tag, 0) + size
        weakref.finalize(storage, self._free, key)
        if self.live > self.peak:
            self.peak, self.peak_by_tag = self.live, dict(self.live_by_tag)
        self.peak_without_grads = max(self.peak_without_grads, self.live - self.live_by_tag.get("grad", 0))

    def _free(self, key: int) -> None:
        tag, size = self._tag_of.pop(key)
        self.live -= size
        self.live_by_tag[tag] -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, lambda t: self.add(t, None), out)
        return out


def measure_step(spec: StepSpec, micro_batch_size: int) -> StepMemory:
    """The peak of one steady-state training step of `spec` at `micro_batch_size`, on fake tensors."""
    return measure_steps(spec, (micro_batch_size,))[0]


def measure_steps(spec: StepSpec, micro_batch_sizes: tuple[int, ...]) -> list[StepMemory]:
    """`measure_step` for several micro-batches, sharing one fake model and its warm-up step."""
    key = repr(spec)  # ModelConfig is not hashable; its repr names every field
    missing = tuple(m for m in dict.fromkeys(micro_batch_sizes) if (key, m) not in _MEASURED)
    if missing:
        for step in _measure(spec, missing):
            _MEASURED[key, step.micro_batch_size] = step
    return [_MEASURED[key, m] for m in micro_batch_sizes]


_MEASURED: dict[tuple[str, int], StepMemory] = {}


def _measure(spec: StepSpec, micro_batch_sizes: tuple[int, ...]) -> list[StepMemory]:
    """Builds the model and AdamW on fake tensors, runs one untracked step (AdamW creates its states
    at the first `step()`), then one tracked steady-state step per micro-batch."""
    if min(micro_batch_sizes) < 1:
        raise ValueError(f"micro-batch sizes must be positive, got {micro_batch_sizes}")
    dtype = None if spec.precision == "fp32" else torch.bfloat16
    round_to = CUDA_BLOCK_BYTES if spec.device_type == "cuda" else 1
    results = []
    workload = make_workload(spec.model)
    as_cuda = cuda_ops() if spec.device_type == "cuda" else contextlib.nullcontext()
    with fake_tensors(), torch.device("cpu"), as_cuda:  # a forward that reads a value (.item()) reads an unknown number
        model = workload.build()
        # Same optimizer as the worker builds for the target device (fused AdamW on CUDA).
        optimizer = build_optimizer(model, TrainConfig(), torch.device(spec.device_type))
        compute = Bf16ComputeCopy(model, _bf16_model(workload)) if spec.bf16_weights else None
        trained = compute.model if compute is not None else model  # the one whose gradients backward makes
        set_activation_checkpointing(workload.blocks(trained), spec.activation_checkpointing)
        params = [p for p in trained.parameters() if p.requires_grad]  # those a gradient reaches
        step = functools.partial(_train_step, workload, model, optimizer, spec=spec, dtype=dtype, compute=compute)
        step(_batch(spec, 1), one_pass=False)  # makes AdamW's states
        sizes = _parameter_sizes(trained, workload.blocks(trained), round_to)
        for micro_batch_size in micro_batch_sizes:
            timeline = _StorageTimeline(round_to)
            for p in (*model.parameters(), *(compute.params if compute is not None else ())):
                timeline.add(p, "param")
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        timeline.add(value, "optimizer")
            hooks = [p.register_post_accumulate_grad_hook(lambda p: timeline.add(p.grad, "grad")) for p in params]
            with timeline:
                step(_batch(spec, micro_batch_size))
            for hook in hooks:
                hook.remove()
            results.append(_summarise(timeline, spec, micro_batch_size, *sizes))
    return results


def _bf16_model(workload: Workload) -> torch.nn.Module:
    """The workload's model made in bf16 (converting a fake model's parameters with .to() would swap them)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return workload.build()
    finally:
        torch.set_default_dtype(default)


def _batch(spec: StepSpec, micro_batch_size: int) -> torch.Tensor:
    return torch.randint(0, spec.model.vocab_size, (micro_batch_size, spec.model.seq_len + 1))


def _parameter_sizes(model, blocks, round_to: int) -> tuple[int, int, int]:
    """(all gradients, the largest block's parameters, the parameters outside the blocks), in bytes."""
    size = lambda p: math.ceil(p.untyped_storage().nbytes() / round_to) * round_to  # noqa: E731
    gradients = sum(size(p) for p in model.parameters() if p.requires_grad)  # a frozen parameter has none
    largest_block = max((sum(size(p) for p in block.parameters()) for block in blocks), default=0)
    root = sum(size(p) for p in model.parameters()) - sum(size(p) for block in blocks for p in block.parameters())
    return gradients, largest_block, root


def _train_step(workload: Workload, model, optimizer, batch: torch.Tensor, *, spec: StepSpec,
                dtype: torch.dtype | None, compute=None, one_pass: bool = True) -> None:
    """What workers/engine.py Engine.__call__ does for one optimizer step, minus the collectives.
    With a bf16 compute copy on CUDA the engine steps the masters from the copy's bf16 gradients in
    one kernel (kernels.adamw), in place, making nothing the size of a parameter; elsewhere, and
    for the step that makes AdamW's states, fp32 master gradients are made after backward. Assumes
    the CUDA workers have triton, as CUDA builds of torch ship it: without it the engine takes the
    old path, 4 bytes a parameter more at the step."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if compute is not None:
        compute.pull_weights()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None and compute is None):
        loss = workload.loss(compute.model if compute else model, inputs, targets, loss_kernel=spec.loss_kernel)
    loss.backward()
    if compute is not None and one_pass and spec.device_type == "cuda":
        compute.gradient_norm()
        for param in compute.params:
            param.grad = None
        return
    if compute is not None:
        compute.push_gradients()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _summarise(timeline: _StorageTimeline, spec: StepSpec, micro_batch_size: int, gradient_bytes: int,
               block_bytes: int, root_bytes: int) -> StepMemory:
    workspace = KERNEL_WORKSPACE_BYTES[spec.device_type]
    peak_total, peak_tags = timeline.peak, timeline.peak_by_tag
    # DDP: gradients are views into buckets allocated up front, so they never come and go.
    ddp_peak = timeline.peak_without_grads + gradient_bytes
    param_bytes = peak_tags.get("param", 0)
    optimizer_bytes = peak_tags.get("optimizer", 0)
    activation = peak_total - param_bytes - optimizer_bytes - peak_tags.get("grad", 0)
    return StepMemory(micro_batch_size=micro_batch_size, peak_bytes=peak_total + workspace,
                      ddp_peak_bytes=ddp_peak + workspace, parameter_bytes=param_bytes, gradient_bytes=gradient_bytes,
                      optimizer_bytes=optimizer_bytes, activation_bytes=activation,
                      largest_block_parameter_bytes=block_bytes, root_parameter_bytes=root_bytes)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """Peak bytes per worker as a function of micro-batch, data-parallel strategy and world size,
    interpolated between exact fake steps (at 1, half the job's micro-batch limit, and the limit)."""

    spec: StepSpec
    points: tuple[StepMemory, ...]
    """Measured steps, by increasing micro-batch."""

    def peak_bytes(self, micro_batch_size: int, *, data_parallel: str = "ddp", world_size: int = 1,
                   tensor_parallel_size: int = 1, accumulating: bool = False, exact: bool = False) -> int:
        """Peak allocated bytes of one worker (what torch.cuda.max_memory_allocated would report).

        - one worker, one micro-step: the step as measured;
        - ddp, or gradient accumulation: every gradient alive the whole step (DDP's bucket views;
          accumulation keeps the first micro-step's gradients through the others' backward);
        - fsdp (FSDP2, one unit per block and a root unit), and hsdp with world_size the ranks of one
          island (what it shards over): parameters, gradients and AdamW states
          divided by the replicas; the root unit's parameters stay gathered, and two blocks'
          gathered parameters in the compute dtype (the one computing and the one prefetched) plus
          one block's unsharded fp32 gradients exist at once;
        - tensor parallelism t: block parameters, gradients and states divided by t; activations
          divided by t: the workers split layers with sequence parallelism (workers/models/
          tensor_plans.py), whose blocks keep 34/t of the bytes per token and layer that Korthikanti
          et al. (2022) count (attention scores are not stored with flash attention).
        """
        step = measure_step(self.spec, micro_batch_size) if exact else self._interpolate(micro_batch_size)
        sharded = data_parallel in ("fsdp", "hsdp") and world_size // max(1, tensor_parallel_size) > 1
        if tensor_parallel_size <= 1 and not sharded:
            grads_held = accumulating or (world_size > 1 and data_parallel == "ddp")
            return step.ddp_peak_bytes if grads_held else step.peak_bytes
        t = max(1, tensor_parallel_size)
        shards = world_size // t if sharded else 1
        root = step.root_parameter_bytes
        model_state = step.parameter_bytes + step.gradient_bytes + step.optimizer_bytes
        state_per_param_byte = model_state / step.parameter_bytes
        model_bytes = state_per_param_byte * (root + (step.parameter_bytes - root) / t) / shards
        if sharded:
            block = step.largest_block_parameter_bytes / t
            compute_dtype_share = 1.0 if self.spec.precision == "fp32" else 0.5
            model_bytes += root * (1 - 1 / shards) + 2 * block * compute_dtype_share + block
        activations = step.activation_bytes / t
        return int(model_bytes + activations + KERNEL_WORKSPACE_BYTES[self.spec.device_type])

    def _interpolate(self, micro_batch_size: int) -> StepMemory:
        """Linear between the two measured steps around `micro_batch_size` (the last two beyond them)."""
        points = self.points
        for point in points:
            if point.micro_batch_size == micro_batch_size:
                return point
        right = next((i for i, p in enumerate(points) if p.micro_batch_size > micro_batch_size), len(points) - 1)
        low, high = points[max(0, right - 1)], points[max(1, right)]
        share = (micro_batch_size - low.micro_batch_size) / (high.micro_batch_size - low.micro_batch_size)
        values = {name: int(getattr(low, name) + share * (getattr(high, name) - getattr(low, name)))
                  for name in ("peak_bytes", "ddp_peak_bytes", "activation_bytes")}
        return dataclasses.replace(low, micro_batch_size=micro_batch_size, **values)

    @property
    def root_parameter_bytes(self) -> int:
        return self.points[0].root_parameter_bytes

    def max_micro_batch(self, capacity_bytes: int, *, data_parallel: str = "ddp", world_size: int = 1,
                        tensor_parallel_size: int = 1, accumulating: bool = True, limit: int = 1 << 16,
                        exact: bool = False) -> int:
        """Largest micro-batch up to `limit` whose peak fits `usable_bytes(capacity_bytes)`; 0 when not
        even one fits. exact measures every micro-batch the bisection tries (a fake step each)."""
        usable = usable_bytes(capacity_bytes, self.spec.device_type)
        fits = lambda m: self.peak_bytes(m, data_parallel=data_parallel, world_size=world_size,  # noqa: E731
                                         tensor_parallel_size=tensor_parallel_size, accumulating=accumulating,
                                         exact=exact) <= usable
        if not fits(1):
            return 0
        low, high = 1, 2
        while high <= limit and fits(high):
            low, high = high, high * 2
        high = min(high, limit + 1)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


def usable_bytes(capacity_bytes: int, device_type: DeviceType) -> int:
    """What a worker's allocator can use of a device with `capacity_bytes`."""
    return int(capacity_bytes * (1 - ALLOCATOR_SLACK)) - RUNTIME_RESERVE_BYTES[device_type]


def profile(config: JobConfig, *, device_type: DeviceType = "cuda") -> MemoryProfile:
    """The job's profile up to its [train] micro_batch_size (no plan gives a worker more)."""
    return profile_for(StepSpec.for_job(config, device_type=device_type), config.train.micro_batch_size)


def profile_for(spec: StepSpec, micro_batch_limit: int) -> MemoryProfile:
    """Fake steps at 1, half the limit and the limit (one model, one warm-up step for all three)."""
    sizes = tuple(sorted({1, max(2, micro_batch_limit // 2), max(2, micro_batch_limit)}))
    return MemoryProfile(spec=spec, points=tuple(measure_steps(spec, sizes)))
