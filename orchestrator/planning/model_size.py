"""How big the job's model is: parameters, training FLOPs per token and parameter shapes, counted
on the meta device from the model the workers build."""

from __future__ import annotations

import torch

from core.config import ModelConfig
from workers.models.gpt import GPT


def model_size(model: ModelConfig) -> tuple[int, int]:
    """(parameters, training FLOPs per token) of the GPT the workers build."""
    parameters, flops_per_token, _ = _meta_model(model)
    return parameters, flops_per_token


def model_shapes(model: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes of the trained parameters (what DDP reduces gradients of), in the model's order."""
    return _meta_model(model)[2]


def _meta_model(model: ModelConfig) -> tuple[int, int, tuple[tuple[int, ...], ...]]:
    """Counted on the meta device, once per model config (initialising a 1.3B model's weights even
    on meta takes 0.4 s)."""
    key = repr(model)
    if key not in _MODELS:
        with torch.device("meta"):
            gpt = GPT(model)
        shapes = tuple(tuple(p.shape) for p in gpt.parameters() if p.requires_grad)
        _MODELS[key] = (gpt.num_params(), gpt.flops_per_token(), shapes)
    return _MODELS[key]


_MODELS: dict[str, tuple[int, int, tuple[tuple[int, ...], ...]]] = {}
