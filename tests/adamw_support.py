"""What the one-pass AdamW tests share (CPU, interpreter and GPU)."""

import torch


def bucket_views(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients copied into one flat buffer, each at an odd offset, as DDP's buckets may hold them:
    views with no 16-byte alignment (the kernel takes its narrow loads)."""
    flat = torch.empty(sum(g.numel() + 1 for g in grads), dtype=grads[0].dtype, device=grads[0].device)
    views, offset = [], 1
    for g in grads:
        views.append(flat[offset:offset + g.numel()].view(g.shape).copy_(g))
        offset += g.numel() + 1
    return views
