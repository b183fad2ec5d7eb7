"""The built-in Llama against a reference written here from Meta's published code, its presets against
the published models, and what the planner counts of it."""

import math

import pytest
import torch
import torch.nn.functional as F

from core.config import JobConfig, ModelConfig
from core.errors import ConfigError
from planning.model_size import model_facts
from workers.models import make_workload
from workers.models.llama import Llama


def tiny(**overrides) -> ModelConfig:
    values = dict(kind="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_dim=48, seq_len=16,
                  vocab_size=61, rope_theta=500000.0, rope_scaling=8.0, tie_embeddings=False)
    return ModelConfig(**{**values, **overrides})


def scaled_frequencies(head_dim: int, theta: float, factor: float) -> torch.Tensor:
    """Meta's llama3 apply_scaling, as published: one frequency at a time."""
    frequencies = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    low_freq_wavelength, high_freq_wavelength = 8192 / 1.0, 8192 / 4.0
    scaled = []
    for freq in frequencies:
        wavelength = 2 * math.pi / freq
        if not factor or wavelength < high_freq_wavelength:
            scaled.append(freq)
        elif wavelength > low_freq_wavelength:
            scaled.append(freq / factor)
        else:
            smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(scaled, dtype=torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's apply_rotary_emb: each interleaved pair is a complex number turned by its position's angle."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis[None, :, None, :]).flatten(-2)


def reference_logits(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """The forward of Meta's reference Llama 3 in float64, with the weights of `model`: separate q, k, v,
    w1 and w3 cut from its stacked matrices, repeated key/value heads and attention written out."""
    cfg = model.cfg
    heads, kv_heads, head_dim = cfg.n_head, cfg.kv_heads, cfg.n_embd // cfg.n_head
    B, T = tokens.shape
    angles = torch.outer(torch.arange(T, dtype=torch.float64), scaled_frequencies(head_dim, cfg.rope_theta,
                                                                                  cfg.rope_scaling))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    w = {name: p.detach().double() for name, p in model.named_parameters()}
    x = w["tok_embeddings.weight"][tokens]
    for i in range(cfg.n_layer):
        prefix = f"layers.{i}."
        grouped = w[prefix + "attention.wqkv.weight"].view(kv_heads, heads // kv_heads + 2, head_dim, -1)
        wq, wk, wv = grouped[:, :-2].reshape(heads * head_dim, -1), grouped[:, -2].flatten(0, 1), grouped[:, -1].flatten(0, 1)
        h = rms_norm(x, w[prefix + "attention_norm.weight"], cfg.norm_eps)
        q = rotate((h @ wq.T).view(B, T, heads, head_dim), freqs_cis)
        k = rotate((h @ wk.T).view(B, T, kv_heads, head_dim), freqs_cis)
        v = (h @ wv.T).view(B, T, kv_heads, head_dim)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
        scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(head_dim) + causal
        attended = (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(B, T, -1)
        x = x + attended @ w[prefix + "attention.wo.weight"].T
        h = rms_norm(x, w[prefix + "ffn_norm.weight"], cfg.norm_eps)
        w1, w3 = w[prefix + "feed_forward.w13.weight"][0::2], w[prefix + "feed_forward.w13.weight"][1::2]
        x = x + (F.silu(h @ w1.T) * (h @ w3.T)) @ w[prefix + "feed_forward.w2.weight"].T
    x = rms_norm(x, w["norm.weight"], cfg.norm_eps)
    return x @ w["output.weight" if not cfg.tie_embeddings else "tok_embeddings.weight"].T


@pytest.mark.parametrize("config", [tiny(), tiny(rope_scaling=0.0, tie_embeddings=True, n_kv_head=4)],
                         ids=["gqa-scaled-untied", "mha-tied"])
def test_the_forward_is_meta_s_reference_llama(config):
    torch.manual_seed(0)
    model = Llama(config)
    with torch.no_grad():
        for p in model.parameters():  # every norm weight away from 1, so the norms' weights are exercised
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    ours = model(tokens).double()
    assert torch.allclose(ours, reference_logits(model, tokens), atol=1e-5, rtol=1e-5)
    # The scaled frequencies cross all three bands of Llama-3.1's scaling at this head size.
    wavelengths = 2 * math.pi / scaled_frequencies(8, config.rope_theta, 0.0)
    if config.rope_scaling:
        assert wavelengths.min() < 2048 and wavelengths.max() > 8192 and ((wavelengths > 2048) & (wavelengths < 8192)).any()


def test_the_fused_plain_and_chunked_losses_agree_on_a_llama():
    torch.manual_seed(0)
    model = Llama(tiny())
    tokens = torch.randint(0, 61, (2, 17))
    losses = {kernel: model(tokens[:, :-1], tokens[:, 1:], loss_kernel=kernel) for kernel in ("plain", "fused", "chunked")}
    grads = {kernel: torch.autograd.grad(loss, model.norm.weight)[0] for kernel, loss in losses.items()}
    for kernel in ("fused", "chunked"):
        assert float(losses[kernel].detach()) == pytest.approx(float(losses["plain"].detach()), rel=1e-5)
        assert torch.allclose(grads[kernel], grads["plain"], atol=1e-6)


@pytest.mark.parametrize("preset, parameters", [("llama3-1b", 1_235_814_400), ("llama3-3b", 3_212_749_824),
                                                ("llama3-8b", 8_030_261_248)])
def test_presets_have_the_published_models_shapes(preset, parameters):
    """Parameter counts of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B as published."""
    config = JobConfig.from_dict({"model": {"preset": preset, "seq_len": 2048}}).model
    facts = model_facts(make_workload(config), config.seq_len)
    assert config.kind == "llama" and facts.parameters == parameters
    head = config.vocab_size * config.n_embd
    embedding_only = 0 if config.tie_embeddings else head  # a tied weight is a matmul; an untied embedding is not
    layers, width, seq = config.n_layer, config.n_embd, config.seq_len
    formula = 6 * (parameters - embedding_only - (2 * layers + 1) * width) + 12 * layers * width * seq
    assert facts.flops_per_token == pytest.approx(formula, rel=1e-6)  # counted, and the usual formula agrees


def test_a_preset_takes_the_keys_the_table_gives_and_refuses_an_unknown_one():
    model = JobConfig.from_dict({"model": {"preset": "llama3-8b", "n_layer": 2, "seq_len": 64}}).model
    assert (model.n_layer, model.n_embd, model.tie_embeddings, model.rope_scaling) == (2, 4096, False, 8.0)
    with pytest.raises(ConfigError, match=r"\[model\] preset.*'llama3-70b' is not a preset"):
        JobConfig.from_dict({"model": {"preset": "llama3-70b"}})
    with pytest.raises(ConfigError, match=r"\[model\] n_kv_head.*not a multiple"):
        JobConfig.from_dict({"model": {"kind": "llama", "n_head": 4, "n_kv_head": 3}})


def test_a_gpt_table_refuses_what_only_a_llama_reads_but_a_saved_gpt_config_loads_again():
    """kind = "gpt" (the default) with a Llama preset or a Llama key would train a GPT sized by part of it."""
    with pytest.raises(ConfigError, match=r"\[model\] kind.*'llama3-1b' is a llama shape.*leave kind out"):
        JobConfig.from_dict({"model": {"kind": "gpt", "preset": "llama3-1b"}})
    for key, value in (("n_kv_head", 2), ("rope_theta", 10000.0), ("ffn_dim", 512), ("rope_scaling", 8.0),
                       ("norm_eps", 1e-6)):
        with pytest.raises(ConfigError, match=rf"\[model\] {key}.*is a llama key.*kind = \"llama\""):
            JobConfig.from_dict({"model": {key: value}})
    saved = JobConfig.from_dict({"model": {"n_layer": 2}}).to_dict()  # every key, at its default
    assert JobConfig.from_dict(saved).model.kind == "gpt"
    assert JobConfig.from_dict({"model": {"preset": "llama3-1b", "kind": "custom", "factory": "x:y"}}).model.n_layer == 16


@pytest.mark.parametrize("key, value, said", [("n_kv_head", -1, "must be 0 or more, got -1"),
                                              ("ffn_dim", -8, "must be 0 or more, got -8"),
                                              ("rope_scaling", -8.0, "must be 0 or more, got -8.0"),
                                              ("rope_theta", 0.0, "must be above 0, got 0.0")])
def test_each_llama_size_out_of_range_is_named_with_its_value(key, value, said):
    with pytest.raises(ConfigError, match=rf"\[model\] {key}: {said}"):
        JobConfig.from_dict({"model": {"kind": "llama", key: value}})
