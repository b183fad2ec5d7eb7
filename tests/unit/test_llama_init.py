"""The built-in Llama starts where workers/models/llama.py says: every projection N(0, 0.02), the two that
write into the residual stream (wo, w2) 1/sqrt(2 · n_layer) of that, embeddings N(0, 0.02), an untied head
N(0, 1/sqrt(n_embd)), biases zero, norms one. Measured on a mid-size model from a fixed seed."""

from __future__ import annotations

import math

import pytest
import torch

from core.config import ModelConfig
from workers.models.llama import Llama

N_LAYER, N_EMBD = 8, 256
TOLERANCE = 0.03
"""Relative: the smallest matrix (wo, 65,536 weights) estimates its std within ~0.3% (one sigma)."""


def mid_size(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**{**dict(kind="llama", n_layer=N_LAYER, n_head=8, n_kv_head=4, n_embd=N_EMBD,
                                        ffn_dim=768, seq_len=64, vocab_size=2048, tie_embeddings=False,
                                        qkv_bias=True), **overrides}))


@torch.no_grad()
def test_each_layer_s_weights_have_the_documented_std():
    model = mid_size()
    residual = 0.02 / math.sqrt(2 * N_LAYER)  # 0.005 at 8 layers
    for i, layer in enumerate(model.layers):
        weights = {layer.attention.wqkv: 0.02, layer.feed_forward.w13: 0.02,
                   layer.attention.wo: residual, layer.feed_forward.w2: residual}
        for linear, std in weights.items():
            assert float(linear.weight.std()) == pytest.approx(std, rel=TOLERANCE), f"layer {i}: {linear}"
            assert abs(float(linear.weight.mean())) < 0.05 * std  # centred (its estimate's sigma: under 0.004·std)
        assert torch.all(layer.attention.wqkv.bias == 0)
        assert torch.all(layer.attention_norm.weight == 1) and torch.all(layer.ffn_norm.weight == 1)
    assert float(model.tok_embeddings.weight.std()) == pytest.approx(0.02, rel=TOLERANCE)
    assert float(model.output.weight.std()) == pytest.approx(N_EMBD ** -0.5, rel=TOLERANCE)


@torch.no_grad()
def test_a_tied_head_is_the_embedding_at_its_std():
    model = mid_size(tie_embeddings=True, n_layer=1)
    assert model.output.weight is model.tok_embeddings.weight
    assert float(model.output.weight.std()) == pytest.approx(0.02, rel=TOLERANCE)
