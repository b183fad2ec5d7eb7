"""Linear + cross-entropy in chunks, so the full (tokens × vocab) fp32 logits never exist.

For GPT-2 124M at B=32, T=1024 the plain loss materialises 32768 × 50304 fp32 logits (6.6 GB)
plus their gradient. Here the hidden states are cut into row chunks; each chunk's logits are
made, turned into the loss and into the gradients for the hidden states and the head weight,
and dropped before the next chunk. Gradients are computed in the forward pass (as Liger's
fused linear cross-entropy does), so backward only scales them by the incoming gradient and
nothing of size vocab × tokens is kept for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.loss import IGNORE_INDEX, counted_rows


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int):
        rows = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk_rows):
            h = hidden[start:start + chunk_rows]
            t = targets[start:start + chunk_rows]
            logits = (h @ weight.t()).float()
            loss_sum += F.cross_entropy(logits, t, reduction="sum")
            # d(sum CE)/d logits = softmax - one_hot, 0 for an ignored row; scaled below for the mean.
            counted = (t != IGNORE_INDEX)[:, None]
            grad_logits = torch.softmax(logits, dim=-1)
            grad_logits[torch.arange(t.shape[0], device=t.device), t.masked_fill(~counted[:, 0], 0)] -= counted[:, 0].float()
            grad_logits = (grad_logits * counted).to(h.dtype)
            grad_hidden[start:start + chunk_rows] = grad_logits @ weight
            grad_weight += (grad_logits.t() @ h).float()
        scale = 1.0 / counted_rows(targets)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.scale = scale
        ctx.weight_dtype = weight.dtype
        return loss_sum * scale

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        factor = grad_output * ctx.scale
        return (grad_hidden * factor.to(grad_hidden.dtype), (grad_weight * factor).to(ctx.weight_dtype), None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_rows: int = 4096) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` over the targets that count (not
    kernels.loss.IGNORE_INDEX); hidden is (N, C), targets (N,).

    Matches `plain_cross_entropy(hidden @ weight.T, targets)` and its gradients; the
    matmuls run in hidden's dtype (bf16 under autocast), softmax and the loss in fp32.
    """
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        # Evaluation: the same chunking, without computing gradients nobody will use.
        total = sum(F.cross_entropy((hidden[i:i + chunk_rows] @ weight.t()).float(), targets[i:i + chunk_rows],
                                    reduction="sum") for i in range(0, hidden.shape[0], chunk_rows))
        return total / counted_rows(targets)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows)
