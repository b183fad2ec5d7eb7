"""Mixed precision: which autocast dtype, loss scaling for fp16, and float8 training through torchao.

- bf16 (the default on GPUs that have it) needs no loss scaling.
- fp16 needs a GradScaler: gradients are unscaled before clipping (so the clip threshold means
  what it says), and a step whose gradients hold inf/NaN is skipped and counted, not applied.
- fp8 converts the model's linear layers with torchao (an optional extra, imported only when
  asked) and runs the rest in bf16; it needs a GPU with fp8 tensor cores (compute capability ≥ 8.9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    """fp32, bf16, fp16 or fp8, as the plan says."""
    autocast_dtype: torch.dtype | None

    @property
    def needs_loss_scaling(self) -> bool:
        return self.name == "fp16"

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)


def precision_on(name: str, device: torch.device) -> Precision:
    """The plan's precision (resolved by the planner, never "auto") on this worker's device. The
    planner refuses what the catalog says a device cannot do; this checks the device itself (a GPU
    the catalog does not know, a worker placed on other hardware than planned)."""
    if name == "fp32":
        return Precision("fp32", None)
    if name in ("fp16", "fp8") and device.type != "cuda":
        raise ConfigError(f"{name} training needs a CUDA GPU; this worker runs on {device.type}",
                          where="[train] precision", fix='use "fp32" or "bf16" on CPU workers')
    if name == "fp8":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"float8 needs compute capability 8.9 or newer, this GPU has {major}.{minor}",
                              where="[train] precision", fix='use "bf16" on this GPU')
        return Precision("fp8", torch.bfloat16)
    return Precision(name, torch.float16 if name == "fp16" else torch.bfloat16)


def convert_to_float8(model: torch.nn.Module, recipe: str) -> int:
    """Swaps eligible nn.Linear layers for torchao's Float8Linear; returns how many were converted.

    A linear layer whose weight another module shares (a head tied to the embedding) is skipped: the
    embedding table cannot be float8."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("float8 training needs torchao", where="[train] precision = \"fp8\"",
                          fix="pip install 'archipelago[fp8]' (torchao), or use bf16") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    shared = _shared_parameters(model)
    converted: list[str] = []

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        # fp8 matmuls need both dimensions divisible by 16.
        ok = (isinstance(module, torch.nn.Linear) and id(module.weight) not in shared
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return len(converted)


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (tied weights)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return {key for key, count in holders.items() if count > 1}


class LossScaler:
    """A GradScaler for fp16, a no-op otherwise; counts the steps it skipped.

    The count lives on the device: reading the scale every step would block the host once per step."""

    def __init__(self, precision: Precision, device: torch.device):
        self.enabled = precision.needs_loss_scaling
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.enabled)
        self._skipped: torch.Tensor | int = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients by the scale in place; call before clipping."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | bool:
        """Applies the step unless the gradients held inf/NaN; returns whether it was applied (a device
        bool tensor with fp16: test it only where a wait is acceptable)."""
        if not self.enabled:
            optimizer.step()
            return True
        scale_before = self.scaler._get_scale_async().clone()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler._get_scale_async() < scale_before  # the scale shrinks exactly when a step is skipped
        self._skipped = self._skipped + skipped.int()
        return ~skipped

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far; waits for the device (read it once per metrics window)."""
        return int(self._skipped)
