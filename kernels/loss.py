"""Linear + cross-entropy whose gradient is made in the forward pass, by one kernel over the logits.

    loss = linear_cross_entropy(hidden, weight, targets)         # mean of CE(hidden @ weight.T, targets)
    loss = linear_cross_entropy(hidden, weight, targets, norm)   # the same of norm(hidden), norm inside
                                                                 # (a LayerNorm or an RMSNorm)
    targets = ignore_masked(targets, loss_mask)                  # rows a loss mask leaves out: IGNORE_INDEX

Rows whose target is IGNORE_INDEX (a fine-tuning batch's prompt tokens, padding) have no loss and no
gradient, and the mean is over the other rows (F.cross_entropy's ignore_index, without its NaN when
every row is ignored: the mean of no rows is 0 here).

The logits are made by one matmul in the autocast dtype (bf16; the op casts its fp32 inputs itself,
and runs the final layer norm when given one, see below). One kernel then writes each row's loss and
turns the logits, in place, into their gradient (softmax - one_hot) / rows, computed in fp32 and
rounded once, as the plain loss's backward would round it. Backward is two matmuls scaled by the
incoming gradient. Against `F.cross_entropy(logits.float(), targets)` compiled by Inductor, that is
one read of the logits and one write of their gradient instead of several passes (GPT-2 124M's 32768
x 50304 logits on an H200: 4.4 ms fwd + bwd down to 2.3; benchmarks/RESULTS.md), with the same
memory: the bf16 gradient is kept where the plain loss keeps the bf16 logits. Evaluation runs the
kernel's first read alone, so no fp32 logits exist then either.

CUDA tensors run the Triton kernel (kernels/triton_loss.py), anything else the torch twin below
(kernels.backend decides, as for the compression kernels).
It is a torch custom op, so torch.compile keeps it whole in the graph instead of breaking it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import use_triton

IGNORE_INDEX = -100
"""A target that does not count (F.cross_entropy's default ignore_index)."""


def ignore_masked(targets: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """targets with IGNORE_INDEX where loss_mask (bool, same shape) is False; targets itself without a mask."""
    return targets if loss_mask is None else targets.masked_fill(~loss_mask, IGNORE_INDEX)


def counted_rows(targets: torch.Tensor) -> torch.Tensor:
    """How many targets count, at least 1 (a mean of no rows is 0, not NaN), as an fp32 scalar."""
    return (targets != IGNORE_INDEX).sum().clamp_min(1).float()


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy over fp32 logits (rows, vocab): the mean over the rows whose target counts."""
    return F.cross_entropy(logits.float(), targets, reduction="sum") / counted_rows(targets)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         norm: torch.nn.LayerNorm | torch.nn.RMSNorm | None = None) -> torch.Tensor:
    """Mean cross-entropy of `norm(hidden) @ weight.T` against `targets` (no norm when None); hidden
    is (rows, C), weight (vocab, C), targets (rows,) class indices or IGNORE_INDEX. Matches
    `plain_cross_entropy(norm(hidden) @ weight.T, targets)` and its gradients, the matmuls in the
    autocast dtype where autocast is on; in fp16 it is that plain loss. In training the norm runs
    inside the op, so that no compiler fuses it with what makes the op's input (see below)."""
    dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else None
    training = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden, weight, *(norm.parameters() if norm is not None else ())))
    if not training or (dtype or hidden.dtype) == torch.float16:
        hidden = norm(hidden) if norm is not None else hidden
        if not training:
            # Evaluation: the losses alone, without fp32 logits (twice the bf16 logits' size).
            return _cross_entropy_rows(_logits(hidden, weight, dtype), targets).sum() / counted_rows(targets)
        # The fused gradient is made before a loss scale is known, and fp16 cannot hold it
        # unscaled (probabilities / rows fall below its range): fp16 takes the plain loss.
        return plain_cross_entropy(_logits(hidden, weight, dtype), targets)
    if norm is not None and norm.weight is None:
        raise ValueError("linear_cross_entropy runs a LayerNorm or RMSNorm with a weight (elementwise_affine=True); "
                         "apply one without it before the call and pass norm=None")
    rms = isinstance(norm, torch.nn.RMSNorm)
    norm_weight, norm_bias = (norm.weight, getattr(norm, "bias", None)) if norm is not None else (None, None)
    eps = 0.0 if norm is None else norm.eps if norm.eps is not None else torch.finfo(hidden.dtype).eps
    return _linear_cross_entropy(hidden, weight, targets, dtype or hidden.dtype, norm_weight, norm_bias, eps, rms)[0]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """hidden @ weight.T, both first cast to dtype unless it is None."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return hidden @ weight.t()


# The op takes hidden and weight as they are (fp32 under autocast) and makes every cast itself,
# the low-precision hidden that backward keeps included (so the hidden is cast once). It also runs
# the final norm, in eager PyTorch, where Inductor cannot fuse it: torch 2.11's Inductor fused the
# last residual add, the norm and the casts into one kernel whose last loop reads back what an
# earlier loop stored, with no barrier between (pytorch/pytorch#190517). With some autotuned block
# sizes a warp read values before another warp had written them: on an H200 at n_embd 2048, block
# size 2048 gave the op a hidden 6-22 % wrong (by up to 0.9) and the 1.3B model diverged, while
# 1024 trained; which one a compile got depended on timings. Before the norm moved in, the first-step
# loss was only 2.5e-4 off, under the compile check's tolerance.
# tests/gpu/test_inductor_configs_gpu.py runs every candidate block size of every kernel.
@torch.library.custom_op("archipelago::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                          norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
                          rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    """(mean loss over the counted rows, gradient of the mean over all rows with respect to the logits
    in dtype, the normed hidden in dtype for backward (see _kept_for_backward), the norm's mean and
    1/std: empty without a norm; an RMSNorm (rms) has no mean, and rows / counted rows, by which backward
    turns the gradient into the counted rows' mean's: 1 exactly when every row counts, so the
    unmasked loss rounds as the plain loss's backward does)."""
    normed, mean, rstd = _norm(hidden, norm_weight, norm_bias, eps, rms)
    low_hidden = normed.to(dtype)
    logits = low_hidden @ weight.to(dtype).t()
    scale = 1.0 / logits.shape[0]
    losses = _rows(logits, targets, scale)
    counted = counted_rows(targets)
    return (losses.sum() / counted, logits, _kept_for_backward(hidden, low_hidden), mean, rstd,
            logits.shape[0] / counted)


def _norm(hidden: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
          eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer norm of hidden's rows, their mean, their 1/std); for an RMSNorm (rms), no mean and
    1/root-mean-square; hidden itself and empty statistics without a norm."""
    if norm_weight is None:
        return hidden, hidden.new_empty(0), hidden.new_empty(0)
    if rms:
        normed, rstd = rms_norm_rows(hidden, norm_weight, eps)
        return normed, hidden.new_empty(0), rstd
    return torch.ops.aten.native_layer_norm(hidden, [hidden.shape[-1]], norm_weight, norm_bias, eps)


def rms_norm_rows(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden's rows divided by their root mean square and scaled by norm_weight, in hidden's dtype; the
    rows' fp32 1/RMS). In fp32 inside, as nn.RMSNorm computes low-precision inputs."""
    rstd = torch.rsqrt(hidden.float().square().mean(-1, keepdim=True) + eps)
    return (hidden.float() * rstd * norm_weight.float()).to(hidden.dtype), rstd


def rms_norm_backward(grad: torch.Tensor, hidden: torch.Tensor, rstd: torch.Tensor,
                      norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of hidden and of the weight of y = hidden · rstd · weight, in fp32 then their dtypes."""
    normalised = hidden.float() * rstd
    grad_weight = (grad.float() * normalised).sum(0)
    grad_normalised = grad.float() * norm_weight.float()
    grad_hidden = rstd * (grad_normalised - normalised * (grad_normalised * normalised).mean(-1, keepdim=True))
    return grad_hidden.to(hidden.dtype), grad_weight.to(norm_weight.dtype)


def _kept_for_backward(hidden: torch.Tensor, low_hidden: torch.Tensor) -> torch.Tensor:
    """The normed hidden in dtype, as the op returns it for backward: empty when it is the op's
    input itself (no norm, hidden in dtype already), since an op's output may not be its input."""
    return hidden.new_empty(0) if low_hidden is hidden else low_hidden


@_linear_cross_entropy.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
      norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
      rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The op's own norm, casts and matmul on fake tensors: the memory estimator (planning/memory.py),
    # which runs this, sees them alive beside the logits as they are in the op.
    normed, mean, rstd = _norm(hidden, norm_weight, norm_bias, eps, rms)
    low_hidden = _kept_for_backward(hidden, normed.to(dtype))
    scalar = hidden.new_empty((), dtype=torch.float32)
    return scalar, _logits(normed, weight, dtype), low_hidden, mean, rstd, scalar.clone()


def _save_for_backward(ctx, inputs, output) -> None:
    hidden, weight, _, _, norm_weight, norm_bias, _, rms = inputs
    _, grad_logits, low_hidden, mean, rstd, rows_per_counted = output
    ctx.hidden_dtype = hidden.dtype
    ctx.normed = norm_weight is not None
    ctx.rms = rms
    # The fp32 weight is a parameter, alive anyway: casting it again in backward keeps no copy.
    ctx.save_for_backward(low_hidden if low_hidden.numel() else hidden, weight, grad_logits, rows_per_counted,
                          *((hidden, mean, rstd, norm_weight, norm_bias) if ctx.normed else ()))


def _backward(ctx, grad_loss: torch.Tensor, *_grads_of_the_other_outputs: torch.Tensor):
    low_hidden, weight, grad_logits, rows_per_counted, *norm_saved = ctx.saved_tensors
    grad_loss = grad_loss * rows_per_counted
    # The matmuls in the logits' dtype; scaled in fp32 after them: grad_loss (a loss weight, a
    # loss scale) need not be exact in bf16. Scaled in place: with a 128 K vocabulary another fp32
    # copy of the weight's gradient (1 GB at Llama-3's 2048 wide) made the step's peak.
    grad_normed = (grad_logits @ weight.to(grad_logits.dtype)).float().mul_(grad_loss).to(ctx.hidden_dtype)
    grad_weight = (grad_logits.t() @ low_hidden).float().mul_(grad_loss).to(weight.dtype)
    if not ctx.normed:
        return grad_normed, grad_weight, None, None, None, None, None, None
    hidden, mean, rstd, norm_weight, norm_bias = norm_saved
    if ctx.rms:
        grad_hidden, grad_norm_weight = rms_norm_backward(grad_normed, hidden, rstd, norm_weight)
        return grad_hidden, grad_weight, None, None, grad_norm_weight, None, None, None
    grad_hidden, grad_norm_weight, grad_norm_bias = torch.ops.aten.native_layer_norm_backward(
        grad_normed, hidden, [hidden.shape[-1]], mean, rstd, norm_weight, norm_bias,
        [True, True, norm_bias is not None])
    return grad_hidden, grad_weight, None, None, grad_norm_weight, grad_norm_bias, None, None


_linear_cross_entropy.register_autograd(_backward, setup_context=_save_for_backward)


@torch.library.custom_op("archipelago::cross_entropy_rows", mutates_args=())
def _cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row losses (fp32), for evaluation: the logits are left as they are."""
    return _rows(logits, targets, None)


@_cross_entropy_rows.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


def _rows(logits: torch.Tensor, targets: torch.Tensor, gradient_scale: float | None) -> torch.Tensor:
    if use_triton(logits):
        from kernels import triton_loss
        return triton_loss.cross_entropy_rows(logits, targets, gradient_scale, ignore_index=IGNORE_INDEX)
    return cross_entropy_rows_twin(logits, targets, gradient_scale)


TWIN_CHUNK_BYTES = 8 * 2**20
"""The size of the twin's fp32 working copy of low-precision logits (or of one row, if larger): rows
are taken a block at a time, as the Triton kernel's programs take them, so no fp32 copy of all the
logits exists (twice the bf16 logits, which the memory estimator does not count)."""


def cross_entropy_rows_twin(logits: torch.Tensor, targets: torch.Tensor,
                            gradient_scale: float | None = None) -> torch.Tensor:
    """The Triton kernel's twin: per-row losses (fp32); with gradient_scale, logits become
    (softmax - one_hot) * gradient_scale. A row whose target is IGNORE_INDEX has loss 0 and gradient 0.
    fp32 logits are worked on in place, as the kernel does, and others a block of rows at a time
    through an fp32 copy of about TWIN_CHUNK_BYTES, so no (rows x vocab) temporary is made (the
    memory estimator counts none)."""
    rows_per_chunk = max(1, TWIN_CHUNK_BYTES // (4 * max(1, logits.shape[-1])))
    if logits.dtype == torch.float32 or logits.shape[0] <= rows_per_chunk:
        return _twin_rows(logits, targets, gradient_scale)
    return torch.cat([_twin_rows(logits[start:start + rows_per_chunk], targets[start:start + rows_per_chunk],
                                 gradient_scale) for start in range(0, logits.shape[0], rows_per_chunk)])


def _twin_rows(logits: torch.Tensor, targets: torch.Tensor, gradient_scale: float | None) -> torch.Tensor:
    """cross_entropy_rows_twin over one block of rows, through one fp32 copy unless they are fp32."""
    x = logits.float()  # logits themselves when they are fp32
    log_sum = torch.logsumexp(x, dim=-1)
    rows = torch.arange(len(targets), device=targets.device)
    counted = targets != IGNORE_INDEX
    safe_targets = targets.masked_fill(~counted, 0)
    losses = torch.where(counted, log_sum - x[rows, safe_targets], 0.0)
    if gradient_scale is None:
        return losses
    x.sub_(log_sum[:, None]).exp_()
    x[rows, safe_targets] -= counted.to(x.dtype)
    x.mul_(torch.where(counted, gradient_scale, 0.0)[:, None])
    if x is not logits:
        logits.copy_(x)
    return losses
