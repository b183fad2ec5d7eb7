"""Ops the memory estimate's fake step runs as CUDA runs them, where the CPU's kernels keep other tensors.

The fake step (planning/memory.py) runs on CPU fake tensors, so torch picks CPU implementations. For most
ops that keeps the same tensors for backward as CUDA does; torch.rms_norm does not. CUDA runs it as one
fused kernel (aten._fused_rms_norm) that keeps its input and one reciprocal RMS a row; the CPU decomposes it
into ops whose autograd also keeps an fp32 copy of the normalised input. At the Llama-3.2-1B shape (B = 4,
T = 2048, 32 block norms) that copy put the estimate 2.0 GiB above the H200's eager step (36.16 against 34.16
GiB, 2026-12-05, benchmarks/RESULTS.md); `cuda_ops()` swaps in a stand-in that keeps what the fused kernel
keeps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kernels.loss import rms_norm_backward, rms_norm_rows


class FusedRMSNorm(torch.autograd.Function):
    """torch.rms_norm computed as the CUDA kernel computes it (fp32 inside, the input's dtype out), keeping
    for backward only the input, the weight and the fp32 reciprocal RMS a row. The arithmetic is the fused
    loss's RMSNorm (kernels/loss.py) over rows of the normalised dimensions flattened into one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None,
                eps: float | None) -> torch.Tensor:
        width = math.prod(normalized_shape)
        eps = torch.finfo(x.dtype).eps if eps is None else eps  # torch.rms_norm's default
        scale = x.new_ones(width) if weight is None else weight.reshape(width)
        out, rstd = rms_norm_rows(x.reshape(-1, width), scale, eps)
        ctx.save_for_backward(x, scale, rstd)
        ctx.weight_shape = None if weight is None else weight.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, scale, rstd = ctx.saved_tensors
        width = scale.numel()
        grad_x, grad_scale = rms_norm_backward(grad.reshape(-1, width), x.reshape(-1, width), rstd, scale)
        grad_weight = None if ctx.weight_shape is None else grad_scale.view(ctx.weight_shape)
        return grad_x.view(x.shape), None, grad_weight, None


class _CudaOps(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm or func is torch.rms_norm:
            return FusedRMSNorm.apply(*_rms_norm_arguments(*args, **kwargs))
        return func(*args, **kwargs)


def _rms_norm_arguments(input, normalized_shape, weight=None, eps=None):
    return input, tuple(normalized_shape), weight, eps


def cuda_ops() -> TorchFunctionMode:
    """A mode under which rms_norm keeps for backward what CUDA's fused kernel keeps."""
    return _CudaOps()
