"""The squared norm of this rank's own gradient, read from DDP's buckets just before they are reduced.

    probe = LocalGradientNorm()
    ddp.register_comm_hook(state, probe.wrap(hook))   # any of workers/comm/hooks.py
    …backward…
    probe.take()     # Σ over buckets of |bucket|², a 0-dim fp32 tensor on the device (no host sync)

Against the reduced gradient's norm (which clipping computes anyway) it gives the gradient noise
scale (core/noise_scale.py) without an extra backward: one more read of each bucket while it is
hot, and no collective (the window's all-reduce of its metrics carries it).
"""

import torch
import torch.distributed as dist

from workers.comm.hooks import Hook


class LocalGradientNorm:
    def __init__(self) -> None:
        self._sq: torch.Tensor | None = None
        self.enabled = True
        """False: buckets pass unread (benchmarks price the read this way)."""

    def wrap(self, hook: Hook) -> Hook:
        # Real annotations (no `from __future__ import annotations`): DDP checks the hook's signature.
        def measured(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if not self.enabled:
                return hook(state, bucket)
            # Before the hook: hooks divide or compress the buffer in place.
            sq = torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float32).square()
            self._sq = sq if self._sq is None else self._sq + sq
            return hook(state, bucket)

        return measured

    def take(self) -> torch.Tensor | None:
        """The last reduction's Σ|bucket|² (None when no bucket was reduced since the last take)."""
        sq, self._sq = self._sq, None
        return sq
