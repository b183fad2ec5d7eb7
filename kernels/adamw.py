"""AdamW's step in one pass over each parameter, with torch's fused CUDA AdamW's numbers, in two forms.

From bf16 gradients onto fp32 master weights, writing the bf16 weights in the same pass:

    adamw = AdamWFromBf16(optimizer, masters, copies)   # optimizer: the torch.optim.AdamW of `masters`
    adamw.step([c.grad for c in copies], grad_scale)    # one step, from the copies' bf16 gradients

does what these do, with the same numbers:

    for master, copy in zip(masters, copies):
        master.grad = copy.grad.float()
    optimizer.grad_scale = grad_scale                   # fused AdamW divides the gradients by it
    optimizer.step()
    torch._foreach_copy_(copies, masters)               # bf16(master) into the copies

With bf16 weights (workers/compute_copy.py) those are three passes over every parameter, and fp32
master gradients held in memory between them. On CUDA one Triton kernel (kernels/triton_adamw.py)
reads the bf16 gradient, the master and both moments and writes the master, the moments and the
bf16 weight: 28 bytes a parameter against 44 (the cast 6; fused AdamW 32, as with a grad_scale it
writes the unscaled gradients back; the pull 6), and the clip's norm reads 2 bytes instead of 4.
On an H200 the 1.3B GPT's engine step with bf16 weights took 242.7 ms instead of 248.8, and GPT-2
124M's 54.6 instead of 55.9 (benchmarks/RESULTS.md). Other devices run the torch twin below.

From fp32 gradients onto the fp32 parameters themselves, the gradients only read:

    adamw = AdamWFromFp32(optimizer)                    # its parameters' .grad are fp32
    adamw.step(grad_scale)

is `optimizer.grad_scale = grad_scale; optimizer.step()` with the same parameters and moments, but
the gradients are left as they were: torch's fused AdamW, given a grad_scale, stores each gradient
divided by it (what GradScaler's callers expect), 32 bytes a parameter where the step needs 28. The
engine clips through grad_scale (workers/engine.py), so that store is 4 bytes a parameter of traffic
for gradients that zero_grad drops next (on an H200 at the Llama-3.2-3B shape, fused AdamW took
30.9 ms a step with the clip as grad_scale against 26.2 without, benchmarks/RESULTS.md).

The numbers are torch's fused CUDA AdamW's, bit for bit (`_fused_adamw_`; its arithmetic is in
aten/src/ATen/native/cuda/fused_adam_utils.cuh, the same in torch 2.11 and 2.13; foreach and
for-loop AdamW round otherwise, a few fp32 ulps apart). All of it is fp32, the group's lr, betas,
eps and weight decay rounded to fp32 first, with its fused multiply-adds:

    bias_correction1 = 1 - beta1 ** step                     step: the fp32 count after += 1 (**)
    bias_correction2_sqrt = sqrt(1 - beta2 ** step)
    step_size = lr / bias_correction1
    g = g / grad_scale
    p = fma(-(lr * weight_decay), p, p)                      where weight_decay != 0 (*)
    m = fma(beta1, m, fma(-beta1, g, g))                     beta1 m + (1 - beta1) g
    v = fma(beta2, v, fma(-beta2, g * g, g * g))
    p = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)
    copy = bf16(p)                                           round to nearest even (from bf16 only)

(*) The source says `p -= lr * weight_decay * p`, which nvcc makes an fma: on an H200 with torch
2.11 the fma matched fused AdamW's masters bit for bit, the separate multiply and subtract not.
(**) By CUDA's powf, which is not correctly rounded: the kernel takes ** from torch's CUDA pow.
On that H200 the kernel from bf16 matched fused AdamW bit for bit (tests/gpu/test_adamw_gpu.py):
masters, moments and copies of five tensors over 5 steps, masters at each of 300 steps, and the
engine's losses and masters over 20 steps. The form from fp32 is the same kernel reading an fp32
gradient and writing no copy.

The optimizer keeps its state as torch's own AdamW keeps it (`step`, `exp_avg`, `exp_avg_sq` in
optimizer.state[master], made lazily as torch makes them), so checkpoints are unchanged and a run
can move between these steps and optimizer.step() at any step. optimizer.step()'s hooks do not run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.backend import use_triton


class AdamWTensors(NamedTuple):
    """What one parameter's step reads and writes."""
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    copy: torch.Tensor | None
    """The bf16 weight written from the stepped master; None when stepping from fp32 gradients."""
    group: int
    """Index of the master's param group in optimizer.param_groups."""


class AdamWHyper(NamedTuple):
    """One param group's settings (the kernels round them to fp32, as the fused kernel does)."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


class _OnePassAdamW:
    """What both forms share: the optimizer's state and settings gathered at each step, and the choice
    between the Triton kernel (CUDA) and its torch twin (elsewhere)."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor],
                 copies: list[torch.Tensor] | None):
        if not isinstance(optimizer, torch.optim.AdamW):
            raise TypeError(f"{type(self).__name__} steps a torch.optim.AdamW, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.masters, self.copies = masters, copies
        self._index = {id(m): i for i, m in enumerate(masters)}
        self._tables = None  # the Triton kernel's tables on the GPU (kernels.triton_adamw), at the first CUDA step

    def _step(self, grads: list[torch.Tensor | None], grad_scale: torch.Tensor | None) -> None:
        if len(grads) != len(self.masters):
            raise ValueError(f"{len(grads)} gradients for {len(self.masters)} masters")
        tensors, hyper = self._gather(grads)
        if not tensors:
            return
        if use_triton(tensors[0].master):
            from kernels import triton_adamw
            if self._tables is None:
                self._tables = triton_adamw.DeviceTables()
            triton_adamw.adamw_step(self._tables, tensors, hyper, grad_scale)
        else:
            advance_steps(tensors)
            for t in tensors:
                adamw_twin(t, hyper[t.group], grad_scale)

    def _gather(self, grads: list[torch.Tensor | None]) -> tuple[list[AdamWTensors], list[AdamWHyper]]:
        """The tensors of every master with a gradient, in the optimizer's order, and each group's settings.
        Read at every step: set_lr writes the groups, load_state_dict replaces them and the state."""
        tensors, hyper = [], []
        for group_index, group in enumerate(self.optimizer.param_groups):
            if group["amsgrad"] or group["maximize"] or group["differentiable"]:
                raise ValueError(f"{type(self).__name__} takes AdamW without amsgrad, maximize or differentiable")
            beta1, beta2 = group["betas"]
            hyper.append(AdamWHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                                    float(group["weight_decay"])))
            for master in group["params"]:
                i = self._index.get(id(master))
                if i is None:
                    raise ValueError("the optimizer steps a parameter that is not among the masters")
                if grads[i] is not None:
                    state = _state(self.optimizer, group, master)
                    tensors.append(AdamWTensors(master, grads[i], state["exp_avg"], state["exp_avg_sq"],
                                                state["step"], None if self.copies is None else self.copies[i],
                                                group_index))
        return tensors, hyper


class AdamWFromBf16(_OnePassAdamW):
    def __init__(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], copies: list[torch.Tensor]):
        """masters: fp32 parameters of `optimizer`; copies: a bf16 tensor of the same shape for each,
        overwritten with the stepped master at every step."""
        if ([(m.shape, m.dtype) for m in masters] != [(c.shape, torch.float32) for c in copies]
                or any(c.dtype != torch.bfloat16 for c in copies)):
            raise ValueError("masters must be fp32 and each copy a bf16 tensor of its master's shape")
        super().__init__(optimizer, masters, copies)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None], grad_scale: torch.Tensor | None = None) -> None:
        """One AdamW step of every master whose gradient (grads[i], in bf16, for masters[i]) is not None,
        each gradient divided by grad_scale (a 1-element fp32 tensor on the masters' device) if given;
        copies[i] becomes bf16(masters[i]). Masters without a gradient are left alone, as torch does."""
        self._step(grads, grad_scale)


class AdamWFromFp32(_OnePassAdamW):
    def __init__(self, optimizer: torch.optim.Optimizer):
        """Steps the parameters of `optimizer` (fp32, their gradients fp32) in place."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("AdamWFromFp32 steps fp32 parameters; the optimizer holds "
                             f"{sorted({str(p.dtype) for p in params})}")
        super().__init__(optimizer, params, None)

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None) -> None:
        """One AdamW step of every parameter with a gradient, each gradient divided by grad_scale (a
        1-element fp32 tensor on the parameters' device) as it is read; the gradients are not written."""
        self._step([p.grad for p in self.masters], grad_scale)


def _state(optimizer: torch.optim.Optimizer, group: dict, master: torch.Tensor) -> dict:
    """optimizer.state[master], made as torch.optim.Adam._init_group makes it when it is empty."""
    state = optimizer.state[master]
    if not state:
        on_device = group["fused"] or group["capturable"]  # torch keeps the step on the CPU otherwise
        dtype = torch.float32 if on_device or torch.get_default_dtype() != torch.float64 else torch.float64
        state["step"] = torch.zeros((), dtype=dtype, device=master.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def advance_steps(tensors: list[AdamWTensors]) -> None:
    """Each step count += 1, as fused AdamW does before its kernel (once the inputs are checked, so
    that a refused step leaves the state as it was)."""
    torch._foreach_add_([t.step for t in tensors], 1)


def adamw_twin(t: AdamWTensors, hyper: AdamWHyper, grad_scale: torch.Tensor | None) -> None:
    """The Triton kernel's twin on one parameter (its step count already advanced): the module
    docstring's arithmetic in torch ops, an fma made as fp64 product and sum rounded to fp32 (which
    rounds twice, so rarely, an ulp apart)."""
    lr, beta1, beta2, eps, weight_decay = (torch.tensor(x, dtype=torch.float32) for x in hyper)
    step = t.step.float()
    bias_correction1 = 1 - _pow(beta1, step)
    bias_correction2_sqrt = (1 - _pow(beta2, step)).sqrt()
    step_size = lr / bias_correction1
    grad = t.grad.float()
    if grad_scale is not None:
        grad = grad / grad_scale.float()
    if hyper.weight_decay != 0:
        t.master.copy_(_fma(-(lr * weight_decay), t.master, t.master))
    t.exp_avg.copy_(_fma(beta1, t.exp_avg, _fma(-beta1, grad, grad)))
    square = grad * grad
    t.exp_avg_sq.copy_(_fma(beta2, t.exp_avg_sq, _fma(-beta2, square, square)))
    t.master.sub_(step_size * t.exp_avg / (t.exp_avg_sq.sqrt() / bias_correction2_sqrt + eps))
    if t.copy is not None:
        t.copy.copy_(t.master)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c for fp32 tensors, rounded once to fp32 (but for a second rounding in fp64)."""
    return (a.double() * b.double() + c.double()).float()


def _pow(base: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """fp32 base ** exponent by torch's pow, on CUDA the fused kernel's powf (kernels.triton_adamw)."""
    return torch.pow(base.to(exponent.device).expand_as(exponent), exponent)
