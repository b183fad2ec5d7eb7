"""Tiny Hugging Face model directories written by the tests: config.json and safetensors saved by
transformers itself (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
"""A 2-layer model over the bytes tokenizer's 257 tokens (and some spare)."""


def architectures() -> dict[str, tuple[type, type]]:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    return {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM)}


def write_model(directory: Path, architecture: str, *, seed: int = 1, weights: bool = True, **overrides):
    """Saves a tiny `architecture` model (its config.json, and its weights unless weights=False) into
    `directory`; returns the transformers model. Its biases (Qwen2's q, k and v) are drawn, not
    transformers' zeros, so a bias put in the wrong place changes the logits."""
    config_class, model_class = architectures()[architecture]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SHAPE, **overrides}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(std=0.5)
    if weights:
        model.save_pretrained(directory)
    else:
        model.config.save_pretrained(directory)
    return model.eval()


def hf_loss(model, batch: torch.Tensor) -> float:
    """transformers' own mean cross-entropy of `model` on (samples, seq + 1) tokens."""
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()))
