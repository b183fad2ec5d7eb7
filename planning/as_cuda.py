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

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class FusedRMSNorm(torch.autograd.Function):
    """torch.rms_norm computed as the CUDA kernel computes it (fp32 inside, the input's dtype out, promoted
    with the weight's), keeping for backward only the input, the weight and the fp32 reciprocal RMS a row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None,
                eps: float | None) -> torch.Tensor:
        dims = tuple(range(-len(normalized_shape), 0))
        eps = torch.finfo(x.dtype).eps if eps is None else eps  # torch.rms_norm's default
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        out = x.float() * rstd
        out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        if weight is not None:
            out = out * weight.float()
        ctx.dims = dims
        ctx.save_for_backward(x, weight, rstd)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normalized = x.float() * rstd
        grad = grad.float()
        grad_weight = None
        if weight is not None:
            if ctx.needs_input_grad[2]:
                batch_dims = tuple(range(x.dim() - len(ctx.dims)))
                grad_weight = (grad * normalized).sum(batch_dims).to(weight.dtype)
            grad = grad * weight.float()
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        grad_x = rstd * (grad - normalized * (grad * normalized).mean(ctx.dims, keepdim=True))
        return grad_x.to(x.dtype), None, grad_weight, None


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
