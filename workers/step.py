"""One optimizer step: micro-batches with gradient accumulation, DDP sync on the last one, clip, AdamW.

`TrainStep` runs without Ray: give it a model, an optimizer and a device (benchmarks and GPU
tests do); the Ray Train loop builds one per worker after the process group is up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import JobConfig
from workers.optim import set_lr


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None means plain fp32. bf16 is the default on GPUs that have it; CPUs train in fp32 unless asked."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


class TrainStep:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: JobConfig,
                 device: torch.device):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.grad_clip = config.train.grad_clip
        self.dtype = autocast_dtype(config.train.precision, device)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
            if distributed else None
        wrapped = self.ddp or model
        self.forward = torch.compile(wrapped, mode=config.compile.mode) if config.compile.enable else wrapped

    def __call__(self, micro_batches: Sequence[torch.Tensor], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Trains on `micro_batches` (each (B, seq_len + 1) tokens); returns (mean loss, grad norm) as tensors."""
        set_lr(self.optimizer, lr)
        total_loss = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            inputs, targets = batch[:, :-1], batch[:, 1:]
            # Only the last micro-batch all-reduces gradients; the others accumulate locally.
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
            with sync:
                with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                    loss = self.forward(inputs, targets) / len(micro_batches)
                loss.backward()
            total_loss += loss.detach()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss, grad_norm

    @torch.no_grad()
    def evaluate(self, batches: Sequence[torch.Tensor]) -> tuple[float, int]:
        """Summed loss and token count over `batches`, on the unwrapped model in eval mode."""
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for batch in batches:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = self.model(inputs, targets)
            loss_sum += float(loss) * targets.numel()
            tokens += targets.numel()
        self.model.train()
        return loss_sum, tokens
