"""A Hugging Face model directory's config.json, read as plain JSON (no transformers in core).

    hf = read_hf_config("models/llama-1b")          # ConfigError naming the file when it is not there
    shape_of(hf)                                     # the [model] keys it fixes: n_layer, n_embd, vocab_size, …
    builtin_llama_refusal(hf, path, seq_len=2048)    # why the built-in Llama cannot take these weights, or None

`[model] hf_dir` names such a directory. With kind = "hf" the transformers model it describes trains;
with kind = "llama" the built-in Llama is shaped from it and starts from its weights. Either way the
[model] table's shape keys come from the file, so the planner, the bill and the dataset check see the
real model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import ConfigError

CONFIG_FILE = "config.json"
WHERE = "[model] hf_dir"
BUILTIN_LLAMA_TYPES = ("llama", "mistral", "qwen2")
"""model_type values whose weights the built-in Llama takes (Meta's layout: RMSNorm, rotary, GQA, SwiGLU;
Qwen2's with biases on the query, key and value projections: [model] qkv_bias)."""
QKV_BIAS_TYPES = ("qwen2",)
"""model_type values whose query, key and value projections, and no other, have biases."""
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3.1 frequency scaling the built-in implements (workers/models/llama.py)."""


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The directory's config.json as a dict; ConfigError naming the file and the fix otherwise."""
    path = Path(hf_dir) / CONFIG_FILE
    if not Path(hf_dir).is_dir():
        raise ConfigError(f"{hf_dir} is not a directory", where=WHERE,
                          fix="point hf_dir at a local directory holding a Hugging Face model's config.json "
                              "(download it first, e.g. with `hf download NAME --local-dir DIR`)")
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist", where=WHERE,
                          fix="hf_dir must hold the model's config.json (and its *.safetensors weights, when it "
                              "has any); save one with model.config.save_pretrained(DIR)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not JSON ({e})", where=WHERE, fix="restore the file from the model's source") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ConfigError(f"{path} names no model_type", where=WHERE,
                          fix="use the config.json transformers wrote for the model (it names model_type)")
    return values


def rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base: top-level rope_theta (transformers 4) or rope_parameters.rope_theta (5)."""
    parameters = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or parameters.get("rope_theta") or 10000.0)


def rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The frequency scaling table, None for plain rotary embeddings."""
    table = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    if not table or table.get("rope_type", table.get("type", "default")) == "default":
        return None
    return table


def shape_of(hf: dict[str, Any]) -> dict[str, Any]:
    """The [model] keys the config fixes, in archipelago's names (keys the config does not give are left out)."""
    names = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
             "num_key_value_heads": "n_kv_head", "intermediate_size": "ffn_dim", "vocab_size": "vocab_size",
             "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}
    shape = {ours: hf[theirs] for theirs, ours in names.items() if hf.get(theirs) is not None}
    shape["rope_theta"] = rope_theta(hf)
    scaling = rope_scaling(hf)
    shape["rope_scaling"] = float(scaling.get("factor", 0.0)) if scaling else 0.0
    shape["qkv_bias"] = hf["model_type"] in QKV_BIAS_TYPES
    return shape


def builtin_llama_refusal(hf: dict[str, Any], path: str, seq_len: int) -> str | None:
    """Why the built-in Llama cannot take this model's weights exactly at `seq_len` tokens a sample, or None."""
    model_type = hf["model_type"]
    if model_type not in BUILTIN_LLAMA_TYPES:
        return f'{path}: model_type {model_type!r} is not a Llama shape; train it as kind = "hf"'
    head_dim, window = hf.get("head_dim"), sliding_window(hf)
    problems = [
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r} (the built-in's SwiGLU uses silu)"),
        # Llama's attention_bias puts a bias on o_proj as well; the built-in has Qwen2's (q, k and v) only.
        (bool(hf.get("attention_bias")), "attention_bias (biases on o_proj too, where the built-in takes biases on "
                                         "the query, key and value projections only)"),
        (bool(hf.get("mlp_bias")), "mlp_bias (bias terms in the MLP)"),
        (head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"],
         f"head_dim {head_dim} apart from hidden_size / num_attention_heads"),
        (0 < (window or seq_len) < seq_len,
         f"sliding-window attention over {window} tokens, fewer than [model] seq_len = {seq_len}"),
        (_other_rope(hf), f"rope scaling {rope_scaling(hf)} (the built-in implements Llama-3.1's only)"),
    ]
    found = [text for bad, text in problems if bad]
    if found:
        return f'{path}: {"; ".join(found)}: the built-in Llama would compute another model; train it as kind = "hf"'
    return None


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window in tokens, None for full attention: Mistral's sliding_window, Qwen2's only
    with use_sliding_window (its config.json names a window it does not use otherwise)."""
    return hf.get("sliding_window") if hf.get("use_sliding_window", True) else None


def _other_rope(hf: dict[str, Any]) -> bool:
    scaling = rope_scaling(hf)
    if scaling is None:
        return False
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return True
    return any(float(scaling.get(key, value)) != value for key, value in LLAMA3_ROPE.items())
