"""`archipelago export RUN --hf OUT`: a run's newest committed weights as a model transformers loads.

    archipelago export runs/sft --hf exported/sft
    model = AutoModelForCausalLM.from_pretrained("exported/sft")      # the trained model, its logits
    archipelago export runs/qat --hf exported/qat --quantized         # a [train] qat run, really quantized

Writes config.json and model.safetensors (transformers' own save_pretrained), and the tokenizer files
the run had: those beside [model] hf_dir (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) or the tokenizers file its data was prepared with (the copy the dataset keeps, or
[data] tokenizer's file, with the identity the dataset's manifest gave, which report.json records; byte-level
data has none). kind = "hf" saves the trained
transformers model itself; kind = "llama" (built-in) is cut back into the architecture of its hf_dir
(LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM), or without one a LlamaForCausalLM (a
Qwen2ForCausalLM with [model] qkv_bias): q/k rows and biases turned back from interleaved pairs to
halves (workers/models/hf_weights.py). The model is rebuilt from the config in the run's report.json and
loaded from the newest intact checkpoint on this machine's CPU (of a run still training, the newest again
when [checkpoint] keep_last deletes the one being read); OUT is written beside itself and renamed into place,
so an interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from core.config import JobConfig, ModelConfig
from core.errors import CheckpointError, ConfigError
from core.hf_config import read_hf_config
from orchestrator.accounting.report import RunReport
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import load_checkpoint, step_damage
from storage.fs import Location
from storage.tokenizers import DATASET_COPY, ByteTokenizer, HFJsonTokenizer, load_tokenizer
from workers.models import make_workload
from workers.models.hf_weights import llama_layout, stack_for_export
from workers.models.layers import repeated_layers
from workers.qat import base_config, quantize_ptq

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WHERE = "archipelago export --hf"
ATTEMPTS = 3
"""Times export looks for the newest step of a run that keeps deleting the one being read (load_newest_intact)."""


def export_run(run: str | Path, out: str | Path, *, quantized: bool = False) -> Exported:
    """Exports the newest intact committed checkpoint of the run directory `run` to `out` (quantized: see
    write_hf). The run is only read: a damaged newer step is left where it is and named in the result."""
    report = RunReport.load(run)  # fit writes it when the run starts: the job as it ran, its data's tokenizer
    config = JobConfig.from_dict(report.config)
    check_exportable(config, out, quantized=quantized)
    tokenizer = data_tokenizer(config, report.tokenizer_identity)
    directory = RunDirectory(Path(run).resolve().parent, Path(run).resolve().name, config.checkpoint.storage)
    model = make_workload(config.model).build()
    step, skipped = load_newest_intact(directory, model)
    written = write_hf(model, config, out, quantized=quantized, tokenizer=tokenizer)
    return Exported(written, step, skipped, _tokenizer_note(config, tokenizer, written))


@dataclass(frozen=True, slots=True)
class Exported:
    out: Path
    step: int
    """The checkpoint's step."""
    skipped: list[str]
    """Newer committed steps left out because their files are damaged: what is wrong with each."""
    tokenizer_note: str = ""
    """Why OUT has no tokenizer file (or no eos_token_id), for the export's output; empty when it has both."""


@dataclass(frozen=True, slots=True)
class DataTokenizer:
    """The tokenizer the run's data was made with, as export found it."""

    identity: str
    """As the dataset's manifest names it (report.json records it): "bytes" or "hf-json:<sha256 prefix>"."""
    found: ByteTokenizer | HFJsonTokenizer | None
    """None: none of the tokenizers files the run names is that one."""
    looked_in: list[str]
    """The tokenizers files the run names."""


def data_tokenizer(config: JobConfig, identity: str) -> DataTokenizer:
    """The tokenizer of `identity` (an identity, or a [data] tokenizer as the config gives it: "bytes", "hf:PATH")
    among those the run names: the bytes tokenizer, or the file the dataset keeps, or [data] tokenizer's, whichever
    has that content."""
    named = [config.data.tokenizer.removeprefix("hf:")] if config.data.tokenizer.startswith("hf:") else []
    looked_in = [str(Path(config.data.path) / DATASET_COPY), *named]
    for spec in ["bytes", *(f"hf:{path}" for path in looked_in if Path(path).is_file())]:
        tokenizer = load_tokenizer(spec)
        if identity in (tokenizer.name, spec):
            return DataTokenizer(identity, tokenizer, looked_in)
    return DataTokenizer(identity, None, looked_in)


def load_newest_intact(directory: RunDirectory, model: torch.nn.Module) -> tuple[int, list[str]]:
    """Loads the newest intact committed step into `model`: its step, and what is wrong with the newer ones.

    A run still training may commit a newer step meanwhile and [checkpoint] keep_last delete the one being read:
    a step that fails once a newer one has been committed was deleted, not damaged, and the newest is looked for
    again."""
    for _ in range(ATTEMPTS):
        newest = _newest_step(directory)
        try:
            step, where, skipped = newest_intact(directory)
            state = {"model": get_model_state_dict(model)}
            load_checkpoint(state, where, reader="posix")
        except CheckpointError:
            if _newest_step(directory) == newest:
                raise
            continue
        set_model_state_dict(model, state["model"])
        return step, skipped
    raise CheckpointError(f"the run committed a newer step and deleted the one being read, {ATTEMPTS} times over",
                          where=str(directory.checkpoints.root),
                          fix="export again, or once the run has stopped (or keep more steps: [checkpoint] keep_last)")


def _newest_step(directory: RunDirectory) -> int | None:
    committed = directory.checkpoints.committed()
    return committed[-1][0] if committed else None


def newest_intact(directory: RunDirectory) -> tuple[int, Location, list[str]]:
    """The newest committed step whose files check out (storage/checkpoint_io.step_damage) and what is wrong with
    the newer ones; nothing is moved, unlike a resume."""
    skipped = []
    for step, where in reversed(directory.checkpoints.committed()):
        problem = step_damage(where)
        if problem is None:
            return step, where, skipped
        skipped.append(f"step {step}: {problem}")
    raise CheckpointError("no intact committed checkpoint to export" + (f" ({'; '.join(skipped)})" if skipped else ""),
                          where=str(directory.checkpoints.root),
                          fix="export a run that has committed a checkpoint ([checkpoint] every_steps)")


def write_hf(model: torch.nn.Module, config: JobConfig, out: str | Path, *, quantized: bool = False,
             tokenizer: DataTokenizer | None = None) -> Path:
    """Saves `model` (what config's workload built, trained) as a transformers model directory at `out`.

    tokenizer: the run's data's (data_tokenizer; None: the one [data] tokenizer names). A model of an hf_dir keeps
    the token ids of its config.json; a built-in trained from scratch ends generation on the data's
    end-of-document token and starts with none (the data has no begin-of-document token).

    quantized: the really quantized model of the run's [train] qat scheme: the layers QAT trained
    fake-quantized are quantized as its convert step does (torchao's post-training config on the
    trained weights), config.json names the quantization (transformers' TorchAoConfig) and the weights
    go to pytorch_model.bin (torchao's tensors do not go into safetensors)."""
    out = check_exportable(config, out, quantized=quantized)
    tokenizer = tokenizer or data_tokenizer(config, config.data.tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A directory of this export's own, so a name the user gave something beside OUT is never touched; the
    # model directory inside it is made with the usual permissions (mkdtemp's are the owner's alone).
    holder = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.partial-"))
    try:
        staging = holder / out.name
        hf = _hf_model(model, config.model, tokenizer)
        if quantized:
            _save_quantized(hf, config, staging)
        else:
            hf.save_pretrained(staging)
        _copy_tokenizer(config, tokenizer, staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return out


def check_exportable(config: JobConfig, out: str | Path, *, quantized: bool) -> Path:
    """Refuses, before any weights are read, an export this run cannot have: a model without a Hugging Face
    architecture, --quantized of a run without QAT, an OUT that holds files. Returns OUT as a Path."""
    if config.model.kind not in ("hf", "llama"):
        raise ConfigError(f'kind = "{config.model.kind}" has no Hugging Face architecture to export to', where=WHERE,
                          fix='export --hf covers kind = "hf" and kind = "llama"')
    if quantized and not config.train.qat:
        raise ConfigError("the run trained without quantization-aware training", where=f"{WHERE} --quantized",
                          fix='train with [train] qat = "int8-dynamic-act-int4-weight" (or "int8-weight"), '
                              "or export without --quantized")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory", where=WHERE,
                          fix="choose another OUT, or delete it first")
    return out


def _hf_model(model: torch.nn.Module, config: ModelConfig, tokenizer: DataTokenizer) -> torch.nn.Module:
    if config.kind == "hf":
        return model.hf
    from transformers import AutoConfig, AutoModelForCausalLM

    values = read_hf_config(config.hf_dir) if config.hf_dir else _llama_config(config, tokenizer)
    hf_config = AutoConfig.for_model(**values)
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


def _llama_config(config: ModelConfig, tokenizer: DataTokenizer) -> dict:
    """The LlamaConfig of a built-in Llama trained from scratch, or with qkv_bias the Qwen2Config (Llama's
    own attention_bias would put a bias on o_proj too), with the token ids of the run's data (transformers'
    defaults, 1 and 2, are bytes there)."""
    rope = ({"rope_type": "llama3", "factor": config.rope_scaling, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192, "rope_theta": config.rope_theta} if config.rope_scaling
            else {"rope_type": "default", "rope_theta": config.rope_theta})
    architecture = ({"model_type": "qwen2"} if config.qkv_bias
                    else {"model_type": "llama", "attention_bias": False, "mlp_bias": False})
    return {**architecture, "vocab_size": config.vocab_size, "hidden_size": config.n_embd,
            "intermediate_size": config.hidden_dim, "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head, "num_key_value_heads": config.kv_heads,
            "head_dim": config.n_embd // config.n_head, "rms_norm_eps": config.norm_eps,
            "max_position_embeddings": config.seq_len, "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": rope, "hidden_act": "silu", "bos_token_id": None,
            "eos_token_id": tokenizer.found.eos_id if tokenizer.found else None}


def _copy_tokenizer(config: JobConfig, tokenizer: DataTokenizer, out: Path) -> None:
    """The run's tokenizer files: those beside hf_dir's config.json, else the data's tokenizers file, with a
    tokenizer_config.json naming its end-of-document token (so AutoTokenizer's eos_token_id is config.json's)."""
    copied = [shutil.copy(source, out / source.name) for source in _hf_dir_tokenizer_files(config)]
    if not copied and isinstance(tokenizer.found, HFJsonTokenizer):
        shutil.copy(tokenizer.found.path, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                               "eos_token": tokenizer.found.eos_token}, indent=2) + "\n")


def _hf_dir_tokenizer_files(config: JobConfig) -> list[Path]:
    if not config.model.hf_dir:
        return []
    return [path for name in TOKENIZER_FILES if (path := Path(config.model.hf_dir) / name).is_file()]


def _tokenizer_note(config: JobConfig, tokenizer: DataTokenizer, out: Path) -> str:
    """What the export's output says of a model without a tokenizer file or an end-of-document id."""
    if _hf_dir_tokenizer_files(config) or isinstance(tokenizer.found, HFJsonTokenizer):
        return ""
    if isinstance(tokenizer.found, ByteTokenizer):
        return (f"the run's data is byte-level (token i is byte i, {tokenizer.found.eos_id} ends a document): "
                "there is no tokenizer file to copy")
    looked = f"none of {', '.join(tokenizer.looked_in)} is it" if tokenizer.looked_in else "the run names no file"
    # A model of an hf_dir keeps that config.json's token ids; a built-in from scratch has only the data's.
    lacks, fix = (("no tokenizer", "") if config.model.hf_dir else
                  ("no tokenizer and no eos_token_id", " and set eos_token_id in config.json and "
                                                      "generation_config.json to its end-of-document token"))
    return (f"the tokenizers file the run's data was prepared with ({tokenizer.identity}) is not found ({looked}): "
            f"{out} has {lacks}; copy that file into it as tokenizer.json{fix}")
