"""The worker engine: one worker's model, wrapping, precision and compiled training step.

    engine = Engine(spec, rank, device)                # after torch.distributed is up (or alone)
    loss, grad_norm = engine(micro_batches, lr)        # one optimizer step
    engine.window_metrics()                            # comm bytes, exposed comm, overlap, skips, compile
    engine.settle()                                    # every update applied (next-forward overlap)

It needs no Ray: benchmarks and GPU tests build one directly (planning.uniform_spec
makes them a spec); the Ray Train loop builds one per worker. It decides nothing itself: the spec's
plan says how the model is spread and in which precision, its train and compile settings the rest.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core.errors import ConfigError
from core.plan import Plan
from core.spec import WorkerSpec
from kernels.adamw import AdamWFromFp32
from kernels.backend import use_triton
from storage.flags import unpack
from workers.comm.stats import CommStats
from workers.compile_check import CompileCheck
from workers.compiler import compile_stats
from workers.compute_copy import Bf16ComputeCopy
from workers.models.layers import draws_random_numbers
from workers.optim import build_optimizer, set_lr
from workers.parallel import attach_overlap, wrap
from workers.precision import LossScaler, convert_to_float8, precision_on
from workers.qat import prepare_qat


class Engine:
    def __init__(self, spec: WorkerSpec, rank: int, device: torch.device):
        self.spec = spec
        plan, train = spec.plan, spec.train
        self.device = device
        self.rank = rank
        self.worker = plan.worker(rank)
        self.precision = precision_on(plan.precision, device)
        self.workload = spec.workload
        torch.manual_seed(train.seed)  # every rank builds identical weights
        # The model the optimizer updates, checkpoints save and evaluation runs.
        self.model = self.workload.build().to(device)
        check_same_weights(self.model, spec.model.kind)
        self.qat_layers = (prepare_qat(self.model, self.workload.blocks(self.model), train.qat, train.qat_group_size)
                           if train.qat else 0)
        self.float8_layers = (convert_to_float8(self.model, train.float8_recipe)
                              if self.precision.name == "fp8" else 0)
        self.compute_copy = self._compute_copy()
        self.comm_stats = CommStats()
        trained = self.compute_copy.model if self.compute_copy is not None else self.model
        self.wrapped = wrap(trained, spec, self.precision, device, self.comm_stats)
        # After wrapping: FSDP2 replaces parameters with sharded DTensors the optimizer must see.
        self.optimizer = build_optimizer(self.model, train, device)
        self.scaler = LossScaler(self.precision, device)
        # With the next-forward overlap, each bucket's update is applied in the next step's forward.
        self.overlap = attach_overlap(self.wrapped, self.model, self.optimizer, plan, self.comm_stats)
        self.max_grad_norm = train.grad_clip if train.grad_clip > 0 else float("inf")
        # Fused AdamW divides each gradient by `grad_scale` as it reads it (the hook GradScaler uses),
        # so clipping can ride on the optimizer's own pass: the gradients are read once for the norm
        # instead of read for it and then read and written again to scale them (1.3B: ~10 GB a step).
        # Not with fp16, whose GradScaler owns grad_scale, nor FSDP's sharded DTensor gradients.
        self.clip_in_optimizer = (self.optimizer.defaults.get("fused") is True and not self.scaler.enabled
                                  and not self.wrapped.dtensor_parameters)
        # With bf16 weights, the step from the copy's bf16 gradients to the masters and back into the
        # copy runs as one Triton pass (Bf16ComputeCopy.step_masters): the same numbers as pushing fp32
        # gradients and stepping fused AdamW, moving 30 bytes a parameter instead of 48, norm included
        # (1.3B step on an H200: 242.7 ms instead of 248.8). Without triton, torch's fused AdamW is
        # faster than the kernel's torch twin. Tests (the twin on CPU) and benchmarks/step.py (the
        # unfused path) override it; jobs do not.
        one_pass = self.clip_in_optimizer and use_triton(next(self.model.parameters()))
        self.fused_bf16_step = self.compute_copy is not None and one_pass
        # Without them, the clip still rides on AdamW's pass, but torch's fused AdamW writes every
        # gradient back divided by grad_scale, which nothing reads: the same step in the Triton kernel
        # only reads them (kernels.adamw: 28 bytes a parameter instead of 32, the same numbers).
        self.adamw_from_fp32 = (AdamWFromFp32(self.optimizer)
                                if self.compute_copy is None and one_pass
                                and all(p.dtype == torch.float32 and p.is_contiguous()
                                        for p in self.model.parameters()) else None)
        self.trained = trained
        self._measures_noise = True
        self.local_gradient: tuple[torch.Tensor, int] | None = None
        """The last step's (|g|² of a smaller batch's mean gradient, that batch): this rank's own
        gradient, or on one worker its first micro-batch's; None where neither is seen."""
        self.replan(plan)
        # The first micro-batch's compiled step is checked against eager PyTorch's (workers/compile_check.py).
        compile_config = spec.compile
        self.compile_checker = (CompileCheck(trained, self.workload.blocks(trained),
                                             loss_tolerance=compile_config.check_tolerance,
                                             gradient_tolerance=compile_config.gradient_tolerance,
                                             compare_gradients=self.wrapped.ddp is None and not self.wrapped.fsdp)
                                if compile_config.enable and compile_config.check_tolerance > 0
                                and not draws_random_numbers(trained, spec.model.dropout)
                                and self.precision.name != "fp8"
                                # its eager rerun reads whole losses; under TP they are DTensors on shards
                                and not self.wrapped.tensor_parallel else None)

    @property
    def measures_noise(self) -> bool:
        """Whether steps read the smaller batch's gradient norm (the noise scale); benchmarks/goodput.py
        turns it off to price it."""
        return self._measures_noise

    @measures_noise.setter
    def measures_noise(self, on: bool) -> None:
        self._measures_noise = on
        if self.wrapped.local_norm is not None:
            self.wrapped.local_norm.enabled = on

    def seed_step(self, step: int) -> None:
        """Seeds the random numbers step `step` draws (dropout masks) from [train] seed, the step and this worker's
        replica: a resumed run draws what the uninterrupted one drew, and replicas draw apart (from the seed every
        rank builds the model with, they would all draw the same masks)."""
        entropy = [self.spec.train.seed, step, self.worker.data_parallel_rank]
        torch.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1))

    def replan(self, plan: Plan) -> None:
        """Takes another split of the batch over the same workers (an adaptive batch's change), between steps."""
        self.spec = self.spec.with_plan(plan)
        self.worker = plan.worker(self.rank)
        # Each micro-batch's mean loss is weighted by its share of the global batch, times the number
        # of replicas DDP/FSDP divide by: the reduced gradient is then the global batch's mean whatever
        # micro-batch each (possibly heterogeneous) worker got. Uniform plans give 1 / accumulation.
        replicas = len(plan.replica_micro_batch_sizes())
        self.micro_batch_weight = replicas * self.worker.micro_batch_size / plan.global_batch_size
        # Evaluation passes are collective under FSDP: every rank cuts the same number of chunks.
        self.eval_batch_size = min(plan.replica_micro_batch_sizes())

    def __call__(self, micro_batches: list[torch.Tensor], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Trains on `micro_batches` (each (B, seq_len + 1) tokens); returns (this rank's weighted loss,
        grad norm) as tensors: averaged over the ranks, the loss is the global batch's mean.

        With fp16, a step whose gradients hold inf/NaN is skipped (and counted) instead of applied."""
        set_lr(self.optimizer, lr)
        self.local_gradient = None
        if self.overlap is not None:
            self.overlap.begin_step(lr)
        if self.compute_copy is not None:
            self.compute_copy.pull_weights()
        total_loss = torch.zeros((), device=self.device)
        check = self.compile_checker if self.compile_checker is not None and self.compile_checker.pending else None
        arguments = [loss_arguments(batch, self.spec.data.token_flags) for batch in micro_batches]
        weights = self._micro_batch_weights(arguments)
        for i, (weight, (tokens, masks)) in enumerate(zip(weights, arguments)):
            forward = functools.partial(self._forward, tokens, masks)
            backward = functools.partial(self._backward, weight=weight)
            eager_loss = (check.run_eagerly(forward, backward, self._full_precision_forward(tokens, masks))
                          if check is not None and i == 0 else None)
            with self.wrapped.sync_gradients(i == len(micro_batches) - 1):
                loss = forward()
                if eager_loss is not None:
                    check.check_loss(loss, eager_loss)
                backward(loss)
                if eager_loss is not None and check.compare_gradients:
                    check.check_gradients()
            # Under tensor parallelism the gradients are DTensor splits: the one-worker read is not made there.
            if (i == 0 and len(micro_batches) > 1 and self._measures_noise and self.wrapped.ddp is None
                    and not self.wrapped.fsdp and not self.wrapped.tensor_parallel):
                self._first_micro_batch_norm(weight)
            total_loss += _whole(loss.detach()) * weight
        self._take_local_norm(sum(weights))
        if self.overlap is not None:  # the update follows in the next forward (or settle())
            return total_loss, self.overlap.end_step()
        grad_norm = self._fused_bf16_step() if self.fused_bf16_step else self._clip_and_step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss, grad_norm

    def _first_micro_batch_norm(self, weight: float | torch.Tensor) -> None:
        """One worker has no replica to compare with: its first micro-batch's mean gradient is the
        smaller batch (what the gradients hold before the second is added, over its loss weight)."""
        if self.scaler.enabled:  # loss-scaled gradients
            return
        grads = [p.grad for p in self.trained.parameters() if p.grad is not None]
        sq = torch.nn.utils.get_total_norm(grads, foreach=True).float().square()
        self.local_gradient = (sq / weight ** 2, self.worker.micro_batch_size)

    def _take_local_norm(self, bucket_weight: float | torch.Tensor) -> None:
        """This rank's mean gradient over its own samples, from DDP's buckets before the all-reduce."""
        probe = self.wrapped.local_norm
        sq = probe.take() if probe is not None else None
        if sq is None or self.scaler.enabled:
            return
        # The buckets hold Σ micro-batch weight × that micro-batch's mean = Σ weights × this rank's mean
        # (without a loss mask: replicas × samples / global batch; with one, its share of counted targets).
        samples = self.worker.micro_batch_size * self.worker.grad_accum_steps
        self.local_gradient = (sq / bucket_weight ** 2, samples)

    def _forward(self, tokens: tuple[torch.Tensor, torch.Tensor], masks: dict[str, torch.Tensor], *,
                 autocast: bool = True) -> torch.Tensor:
        """One micro-batch's mean loss (collective under DDP and FSDP: every rank makes it)."""
        with self._training_autocast() if autocast else contextlib.nullcontext(), self.wrapped.loss_context():
            return self.workload.loss(self.wrapped.forward, *tokens, loss_kernel=self.spec.train.loss_kernel, **masks)

    def _backward(self, loss: torch.Tensor, *, weight: float | torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, weighted by its share of the global batch (and scaled with fp16)."""
        with self.wrapped.backward_context():
            self.scaler.scale(loss * weight).backward()

    def _micro_batch_weights(self, arguments: list[tuple[tuple, dict]]) -> list[float | torch.Tensor]:
        """Each micro-batch's loss weight. Without a loss mask, its share of the global batch (times the
        replicas DDP/FSDP divide by). With one, each micro-batch's loss is the mean over its counted targets,
        and its weight its share of the global batch's counted targets (one all-reduce of a count a step),
        so the reduced gradient is the mean over every counted target of the global batch."""
        if not self.spec.data.token_flags:
            return [self.micro_batch_weight] * len(arguments)
        counts = [masks["loss_mask"].sum() for _, masks in arguments]
        total = torch.stack(counts).sum().float()
        if dist.is_initialized():
            dist.all_reduce(total)
            # The ranks of a tensor-parallel group read one micro-batch: each replica's count came tp times.
            total /= self.spec.plan.tensor_parallel_size
        replicas = len(self.spec.plan.replica_micro_batch_sizes())
        return [replicas * count / total.clamp_min(1) for count in counts]

    @property
    def compile_check(self) -> dict | None:
        """The first step's compiled-against-eager figures (workers/compile_check.py), once made."""
        return self.compile_checker.result if self.compile_checker is not None else None

    def _compute_copy(self) -> Bf16ComputeCopy | None:
        """The bf16 copy that trains under [train] bf16_weights (the rules let it run only in bf16)."""
        if not self.spec.train.bf16_weights:
            return None
        return Bf16ComputeCopy(self.model, self.workload.build().to(self.device, torch.bfloat16))

    def _full_precision_forward(self, tokens: tuple[torch.Tensor, torch.Tensor],
                                masks: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor] | None:
        """The compile check's second opinion: the loss without autocast, where the step trains under it
        (a bf16 compute copy's weights are bf16 themselves, so it has none)."""
        if self.precision.autocast_dtype is None or self.compute_copy is not None:
            return None
        return functools.partial(self._forward, tokens, masks, autocast=False)

    def _training_autocast(self):
        """Autocast for the training forward; none on a bf16 compute copy: its weights are bf16
        already, and autocast would run its layer norms, and so the residual stream, in fp32."""
        return contextlib.nullcontext() if self.compute_copy is not None else self.precision.autocast(self.device)

    def _clip_and_step(self) -> torch.Tensor:
        """Clips the global gradient norm to max_grad_norm and applies the optimizer step; returns the norm."""
        if self.compute_copy is not None:
            self.compute_copy.push_gradients()
        if self.clip_in_optimizer:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if self.adamw_from_fp32 is not None:
                self.adamw_from_fp32.step(self._clip_divisor(grad_norm))
            else:
                self.optimizer.grad_scale = self._clip_divisor(grad_norm)
                self.optimizer.step()
            return grad_norm
        self.scaler.unscale(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.scaler.step(self.optimizer)
        return grad_norm

    def _fused_bf16_step(self) -> torch.Tensor:
        """_clip_and_step for bf16 weights in one pass, from the copy's gradients; returns the norm."""
        grad_norm = self.compute_copy.gradient_norm()
        self.compute_copy.step_masters(self.optimizer, grad_scale=self._clip_divisor(grad_norm))
        return grad_norm

    def _clip_divisor(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """What fused AdamW divides the gradients by to clip them: clip_grad_norm_ multiplies them by
        min(1, max_norm / (norm + 1e-6)), so the inverse, at least 1."""
        return torch.clamp((grad_norm + 1e-6) / self.max_grad_norm, min=1.0)

    def settle(self) -> None:
        """Applies every optimizer update still in flight under the next-forward overlap (a no-op
        otherwise): call before reading the weights, the optimizer state or a step's grad norm."""
        if self.overlap is not None:
            self.overlap.settle()

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> tuple[float, int]:
        """Summed loss and token count over `batches`, in eval mode (collective under FSDP: call on every rank)."""
        self.settle()
        forward = self.model  # unwrapped for DDP; under FSDP2 the model itself is the sharded module
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for batch in batches:
            (inputs, targets), masks = loss_arguments(batch, self.spec.data.token_flags)
            with self.precision.autocast(self.device), self.wrapped.loss_context():
                loss = self.workload.loss(forward, inputs, targets, loss_kernel=self.spec.train.loss_kernel, **masks)
            counted = int(masks["loss_mask"].sum()) if masks else targets.numel()
            loss_sum += float(_whole(loss)) * counted
            tokens += counted
        self.model.train()
        return loss_sum, tokens

    def window_metrics(self) -> dict:
        """Numbers for the metrics row closing a log window."""
        metrics: dict = {"precision": self.precision.name}
        if self.wrapped.hook_state is not None:  # FSDP and compiled autograd move bytes no hook counts
            self.wrapped.hook_state.check()
            metrics["comm_bytes"] = self.comm_stats.take()
        if self.overlap is not None:  # DDP's timers see the hook's futures done at once
            exposed = self.overlap.exposed_seconds()
            if exposed is not None:
                metrics["exposed_comm_s"] = exposed
        else:
            metrics.update(_ddp_timing(self.wrapped.ddp))
        if self.scaler.enabled:
            metrics["skipped_steps"] = self.scaler.skipped_steps
            metrics["loss_scale"] = self.scaler.scaler.get_scale()
        if self.spec.compile.enable:
            metrics["compile"] = compile_stats().as_metrics()
            if self.compile_check is not None:
                metrics["compile"]["eager_check"] = self.compile_check
        if self.float8_layers:
            metrics["float8_layers"] = self.float8_layers
        if self.qat_layers:
            metrics["qat_layers"] = self.qat_layers
        return metrics


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: under tensor parallelism it is a replicated DTensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def loss_arguments(batch: torch.Tensor, token_flags: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """((inputs, targets), the loss mask and positions as keyword arguments) of a (B, seq_len + 1)
    micro-batch; the keywords only for a fine-tuning dataset's flagged words (storage/flags.py), so a
    workload written for pretraining data alone is called as before."""
    if not token_flags:
        return (batch[:, :-1], batch[:, 1:]), {}
    unpacked = unpack(batch)
    return (unpacked.inputs, unpacked.targets), {"loss_mask": unpacked.loss_mask, "positions": unpacked.positions}


SAME_WEIGHTS_TOLERANCE = 1e-6
"""Relative difference between two ranks' weight fingerprints taken as the same weights (sums in
float64 over different GPU models may round differently; different initialisations differ by ~1e-3)."""


def check_same_weights(model: torch.nn.Module, kind: str) -> None:
    """Every rank built the same weights: FSDP2 shards whatever each rank built (DDP would broadcast
    rank 0's and hide it). Compares each rank's sum and sum of squares of its weights, in float64."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        mine = torch.stack([torch.stack([p.sum(dtype=torch.float64), p.square().sum(dtype=torch.float64)])
                            for p in model.parameters()]).sum(0)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    apart = max(float(((other - gathered[0]).abs() / gathered[0].abs().clamp_min(1e-30)).max()) for other in gathered)
    if apart > SAME_WEIGHTS_TOLERANCE:
        where = "[model] factory" if kind == "custom" else "[model]"
        raise ConfigError(f"the workers built different initial weights (their fingerprints are {apart:.2e} apart)",
                          where=where, fix="draw the initial weights from torch's random generator only (archipelago "
                                           "seeds it with [train] seed on every worker), not random, numpy or the clock")


def _ddp_timing(ddp) -> dict:
    """Exposed communication and overlap of the last sampled step, from DDP's own timers.

    DDP times backward compute and communication (CUDA events on GPUs, wall clock on CPUs) and
    how long they overlapped; communication starts during backward, so what did not overlap is
    what the step waited for. (Its *_time_end fields are host clock readings taken as the events
    were recorded, not when the GPU reached them: their difference said 0.2 ms where the step
    waited 130 ms for a 3.4 GB/s link; benchmarks/RESULTS.md.)"""
    if ddp is None:
        return {}
    data = ddp._get_ddp_logging_data()
    comm_ns = data.get("backward_comm_time", 0)
    if not comm_ns:
        return {}
    overlap_ns = data.get("backward_compute_comm_overlap_time", 0)
    return {"comm_s": comm_ns / 1e9, "exposed_comm_s": max(0, comm_ns - overlap_ns) / 1e9,
            "overlap_ratio": round(overlap_ns / comm_ns, 4)}
