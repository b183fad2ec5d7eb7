"""`archipelago export RUN --hf OUT`: a run's newest committed weights as a model transformers loads.

    archipelago export runs/sft --hf exported/sft
    model = AutoModelForCausalLM.from_pretrained("exported/sft")      # the trained model, its logits
    archipelago export runs/qat --hf exported/qat --quantized         # a [train] qat run, really quantized

Writes config.json and model.safetensors (transformers' own save_pretrained), and the tokenizer files
the run had: those beside [model] hf_dir (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) or the dataset's "hf:PATH" tokenizers file. kind = "hf" saves the trained
transformers model itself; kind = "llama" (built-in) is cut back into a LlamaForCausalLM (or the
MistralForCausalLM of its hf_dir): q/k rows turned back from interleaved pairs to halves
(workers/models/hf_weights.py). The model is rebuilt from the run's job.json and loaded from the
checkpoint on this machine's CPU; OUT is written beside itself and renamed into place, so an
interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from core.config import JobConfig, ModelConfig
from core.errors import ConfigError
from core.hf_config import read_hf_config
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import load_checkpoint
from workers.models import make_workload
from workers.models.hf_weights import llama_layout, stack_for_export
from workers.models.layers import repeated_layers
from workers.qat import base_config, quantize_ptq

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WHERE = "archipelago export --hf"


def export_run(run: str | Path, out: str | Path, *, quantized: bool = False) -> Path:
    """Exports the newest committed checkpoint of the run directory `run` to `out` (quantized: see
    write_hf); returns `out`."""
    config = run_config(run)
    directory = RunDirectory(Path(run).resolve().parent, Path(run).resolve().name, config.checkpoint.storage)
    latest = directory.checkpoint_to_resume()
    workload = make_workload(config.model)
    model = workload.build()
    state = {"model": get_model_state_dict(model)}
    load_checkpoint(state, latest, reader="posix")
    set_model_state_dict(model, state["model"])
    return write_hf(model, config, out, quantized=quantized)


def run_config(run: str | Path) -> JobConfig:
    path = Path(run) / "job.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist", where=WHERE,
                          fix="give a run directory that `archipelago fit` made (runs/<name>), after it started")
    return JobConfig.from_dict(json.loads(path.read_text()))


def write_hf(model: torch.nn.Module, config: JobConfig, out: str | Path, *, quantized: bool = False) -> Path:
    """Saves `model` (what config's workload built, trained) as a transformers model directory at `out`.

    quantized: the really quantized model of the run's [train] qat scheme: the layers QAT trained
    fake-quantized are quantized as its convert step does (torchao's post-training config on the
    trained weights), config.json names the quantization (transformers' TorchAoConfig) and the weights
    go to pytorch_model.bin (torchao's tensors do not go into safetensors)."""
    if quantized and not config.train.qat:
        raise ConfigError("the run trained without quantization-aware training", where=f"{WHERE} --quantized",
                          fix='train with [train] qat = "int8-dynamic-act-int4-weight" (or "int8-weight"), '
                              "or export without --quantized")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty", where=WHERE, fix="choose another OUT, or delete it first")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        hf = _hf_model(model, config.model)
        if quantized:
            _save_quantized(hf, config, staging)
        else:
            hf.save_pretrained(staging)
        _copy_tokenizer(config, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return out


def _hf_model(model: torch.nn.Module, config: ModelConfig) -> torch.nn.Module:
    if config.kind == "hf":
        return model.hf
    if config.kind != "llama":
        raise ConfigError(f'kind = "{config.kind}" has no Hugging Face architecture to export to', where=WHERE,
                          fix='export --hf covers kind = "hf" and kind = "llama"')
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**(read_hf_config(config.hf_dir) if config.hf_dir else _llama_config(config)))
    weights = {key: tensor for name, tensor in model.state_dict().items() if name in (layout := llama_layout(config))
               for key, tensor in stack_for_export(layout[name], tensor.detach()).items()}
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf.load_state_dict(weights, strict=not config.tie_embeddings)
    if config.tie_embeddings:
        hf.tie_weights()
    return hf


def _save_quantized(hf: torch.nn.Module, config: JobConfig, out: Path) -> None:
    from transformers import TorchAoConfig

    train = config.train
    quantize_ptq(hf, repeated_layers(hf), train.qat, train.qat_group_size)
    hf.config.quantization_config = TorchAoConfig(quant_type=base_config(train.qat, train.qat_group_size))
    hf.config.save_pretrained(out)
    torch.save(hf.state_dict(), out / "pytorch_model.bin")


def _llama_config(config: ModelConfig) -> dict:
    """The LlamaConfig of a built-in Llama trained from scratch."""
    rope = ({"rope_type": "llama3", "factor": config.rope_scaling, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192, "rope_theta": config.rope_theta} if config.rope_scaling
            else {"rope_type": "default", "rope_theta": config.rope_theta})
    return {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.n_embd,
            "intermediate_size": config.hidden_dim, "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head, "num_key_value_heads": config.kv_heads,
            "head_dim": config.n_embd // config.n_head, "rms_norm_eps": config.norm_eps,
            "max_position_embeddings": config.seq_len, "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def _copy_tokenizer(config: JobConfig, out: Path) -> None:
    """The run's tokenizer files: those beside hf_dir's config.json, else the dataset's tokenizers file."""
    sources = [Path(config.model.hf_dir) / name for name in TOKENIZER_FILES] if config.model.hf_dir else []
    copied = [shutil.copy(source, out / source.name) for source in sources if source.is_file()]
    if not copied and config.data.tokenizer.startswith("hf:"):
        shutil.copy(config.data.tokenizer.removeprefix("hf:"), out / "tokenizer.json")
