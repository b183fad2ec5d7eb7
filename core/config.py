"""Job configuration: one small typed dataclass per component, loaded from TOML.

    config = JobConfig.from_toml("examples/cpu-tiny.toml")

Every field has a default that runs. Unknown keys, wrong types and impossible values raise
`ConfigError` naming the file, the section and key, and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core import rules
from core.errors import ConfigError
from core.hf_config import CONFIG_FILE, builtin_llama_refusal, read_hf_config, shape_of


def _check(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(problem, where=key, fix=fix)


def _positive(section: str, **values: int | float) -> None:
    for name, value in values.items():
        _check(value > 0, f"[{section}] {name}", f"must be positive, got {value}", f"set {name} to a number above 0")


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-1b": dict(kind="llama", n_layer=16, n_embd=2048, n_head=32, n_kv_head=8, ffn_dim=8192,
                      vocab_size=128256, rope_theta=500000.0, rope_scaling=32.0, tie_embeddings=True),
    "llama3-3b": dict(kind="llama", n_layer=28, n_embd=3072, n_head=24, n_kv_head=8, ffn_dim=8192,
                      vocab_size=128256, rope_theta=500000.0, rope_scaling=32.0, tie_embeddings=True),
    "llama3-8b": dict(kind="llama", n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_dim=14336,
                      vocab_size=128256, rope_theta=500000.0, rope_scaling=8.0, tie_embeddings=False),
}
"""Published shapes (the config.json of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B): a [model] table
naming a preset starts from these, and the keys it gives itself win (seq_len is always the table's)."""


_ZERO_MEANS = {"n_kv_head": "as many as n_head", "ffn_dim": "8/3 of n_embd", "rope_scaling": "no scaling"}
LLAMA_SIZES = ("n_kv_head", "ffn_dim", "rope_theta", "rope_scaling", "norm_eps")
"""[model] keys only the llama model reads (hf_dir's config.json sets them for kind = "hf"; qkv_bias too,
which ModelConfig refuses on gpt with its own fix)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    kind: Literal["gpt", "llama", "custom", "hf"] = "gpt"
    """gpt: the built-in GPT-2-style transformer (workers/models/gpt.py); llama: the built-in Llama-3
    family (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; workers/models/llama.py);
    custom: the nn.Module (or workload) that `factory` returns; hf: the transformers causal LM that
    `hf_dir`'s config.json describes (workers/models/hf.py)."""
    hf_dir: str = ""
    """A local directory holding a Hugging Face model's config.json, and its *.safetensors weights when
    it has any (a sharded model's index too), seen by every node. kind = "hf": that model, from its
    weights or initialised; kind = "llama": the built-in Llama shaped from it and started from its
    weights (Llama, Mistral and Qwen2 shapes). The shape keys (n_layer, n_embd, vocab_size, …, qkv_bias)
    come from the file."""
    preset: str = ""
    """A named shape to start from: llama3-1b, llama3-3b or llama3-8b (MODEL_PRESETS)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_kv_head: int = 0
    """llama: key/value heads (grouped-query attention); must divide n_head. 0 = n_head."""
    n_embd: int = 128
    """Width of the residual stream."""
    ffn_dim: int = 0
    """llama: width of the SwiGLU hidden layer. 0 = 8/3 of n_embd rounded up to a multiple of 64 (a
    SwiGLU with as many weights as GPT's 4x MLP)."""
    seq_len: int = 128
    """Tokens per training sample (the model's context length)."""
    vocab_size: int = 257
    """Embedding rows; at least the dataset tokenizer's vocabulary (257 for bytes + end-of-document).
    Rounding up to a multiple of 64 is faster on GPUs."""
    dropout: float = 0.0
    """gpt: dropout probability in attention and MLP outputs."""
    bias: bool = False
    """gpt: bias terms in linear layers and layer norms."""
    qkv_bias: bool = False
    """llama: bias terms on the query, key and value projections (Qwen2's attention; none on the output
    projection or the MLP). hf_dir's config.json sets it: true for model_type qwen2."""
    rope_theta: float = 500000.0
    """llama: base of the rotary embeddings' frequencies."""
    rope_scaling: float = 0.0
    """llama: Llama-3.1's frequency scaling factor for long contexts (8 for Llama-3.1, 32 for -3.2;
    low/high frequency factors 1 and 4 over an original context of 8192, as published); 0 = none."""
    tie_embeddings: bool = True
    """The output projection shares the token embedding's weight (always for gpt)."""
    norm_eps: float = 1e-5
    """llama: RMSNorm epsilon."""
    factory: str = ""
    """custom: "package.module:function" called with this [model] table (a dict); it returns an
    nn.Module whose forward takes token ids (batch, seq) and returns logits (batch, seq, vocab), or a
    workload (core/workload.py) when the model needs its own loss or block list."""
    options: dict[str, Any] = field(default_factory=dict)
    """custom: the [model] keys archipelago does not know, passed to the factory as they are."""

    def __post_init__(self) -> None:
        _positive("model", n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                  seq_len=self.seq_len, vocab_size=self.vocab_size, norm_eps=self.norm_eps)
        _check(not self.preset or self.preset in MODEL_PRESETS, "[model] preset", f"{self.preset!r} is not a preset",
               f"use one of {', '.join(MODEL_PRESETS)}, or size the model with n_layer, n_embd, …")
        _check(self.kind in ("hf", "custom") or self.n_embd % self.n_head == 0, "[model] n_head",  # a factory's own
               f"n_embd = {self.n_embd} is not divisible by n_head = {self.n_head}",
               "pick n_head so that n_embd / n_head is a whole number (e.g. 64 per head)")
        _check(0.0 <= self.dropout < 1.0, "[model] dropout", f"must be in [0, 1), got {self.dropout}",
               "set dropout = 0.0 for pretraining")
        for name in ("n_kv_head", "ffn_dim", "rope_scaling"):
            value = getattr(self, name)
            _check(value >= 0, f"[model] {name}", f"must be 0 or more, got {value}",
                   f"leave {name} out for its default (0: {_ZERO_MEANS[name]})")
        _check(self.rope_theta > 0, "[model] rope_theta", f"must be above 0, got {self.rope_theta}",
               "leave rope_theta out for Llama-3's 500000")
        if self.kind == "gpt":
            _check(self.tie_embeddings, "[model] tie_embeddings", "the gpt model always ties its head to the embedding",
                   'leave tie_embeddings out, or use kind = "llama" for an untied head')
        if self.kind == "llama":
            _check(self.n_head % self.kv_heads == 0, "[model] n_kv_head",
                   f"n_head = {self.n_head} is not a multiple of n_kv_head = {self.kv_heads}",
                   "pick n_kv_head dividing n_head (8 in the Llama-3 presets)")
            _check((self.n_embd // self.n_head) % 2 == 0, "[model] n_head", "rotary embeddings need an even head "
                   f"size; n_embd / n_head = {self.n_embd // self.n_head}", "pick n_head so that each head is even")
            _check(not self.bias and self.dropout == 0, "[model]", "the llama model has no dropout, and bias terms "
                   "only on its query, key and value projections", "set bias = false and dropout = 0.0 (qkv_bias = true "
                   "gives the query, key and value projections biases, as Qwen2's)")
        _check(self.kind != "gpt" or not self.qkv_bias, "[model] qkv_bias", "is a llama key: the gpt model's biases "
               "are all or none", "set bias = true for gpt's biases, and leave qkv_bias out")
        self._check_hf_dir()
        _check(self.kind == "custom" or (not self.factory and not self.options), "[model] factory",
               f'kind = "{self.kind}" builds its own model', 'set kind = "custom" to train the factory\'s model')
        _check(self.kind != "custom" or bool(self.factory), "[model] factory", 'kind = "custom" needs a factory',
               'set factory = "package.module:function" (a function of the [model] table returning an nn.Module)')

    def _check_hf_dir(self) -> None:
        _check(self.kind != "hf" or bool(self.hf_dir), "[model] hf_dir", 'kind = "hf" needs a model directory',
               'set hf_dir = "path/to/model" (a directory holding its config.json)')
        _check(not self.hf_dir or self.kind in ("hf", "llama"), "[model] hf_dir",
               f'kind = "{self.kind}" does not load a Hugging Face model',
               'use kind = "hf" (the transformers model) or kind = "llama" (the built-in, Llama shapes)')
        if self.kind == "llama" and self.hf_dir:
            refusal = builtin_llama_refusal(read_hf_config(self.hf_dir), f"{self.hf_dir}/{CONFIG_FILE}", self.seq_len)
            _check(refusal is None, "[model] hf_dir", refusal or "", "or leave hf_dir out to train the built-in from scratch")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is 0."""
        return self.n_kv_head or self.n_head

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU's hidden width: ffn_dim, or 8/3 · n_embd rounded up to a multiple of 64."""
        return self.ffn_dim or -(-8 * self.n_embd // 3 // 64) * 64

    def tensor_split_sizes(self) -> dict[str, int]:
        """What tensor parallelism gives each rank an equal share of: the (key/value) heads, the
        hidden units and, for the sequence-parallel norms, the positions."""
        heads = {"[model] n_kv_head": self.kv_heads} if self.kind == "llama" else {"[model] n_head": self.n_head}
        hidden = self.hidden_dim if self.kind == "llama" else 4 * self.n_embd
        return {**heads, "the hidden width": hidden, "[model] seq_len": self.seq_len}


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = "data/stdlib-bytes"
    """Directory of a prepared token dataset (manifest.parquet + shards), relative to the working directory,
    or a pyarrow.fs URI ("s3://bucket/datasets/web?region=us-east-1") read with byte-range requests."""
    prepare_from: str = ""
    """When `path` holds no dataset yet, prepare it from this source first: a directory of files, or
    "stdlib" (the .py files of the running Python's standard library: the demo's corpus). Empty (the
    default) requires a prepared dataset at `path`: a path that holds none is an error naming it."""
    source_format: Literal["text", "jsonl", "parquet", "arrow", "chat", "instruction"] = "text"
    """What `prepare_from` holds: text files (one document each), JSON Lines (one document per line),
    a Parquet / Arrow IPC dataset (one document per row), or fine-tuning JSON Lines: conversations
    ("chat": {"messages": [{"role", "content"}, …]}) or pairs ("instruction": {"prompt", "response"}),
    stored with a loss mask over the responses and packed into samples of [model] seq_len (storage/chat.py)."""
    pattern: str = ""
    """Glob (matched recursively) selecting the files of `prepare_from`; empty is *.py for text,
    *.jsonl, *.parquet or *.arrow for the other formats."""
    text_column: str = "text"
    """The JSON field or Parquet/Arrow column holding each document's text."""
    tokenizer: str = "bytes"
    """"bytes" (256 byte values + end-of-document, vocab 257) or "hf:PATH" for a tokenizers JSON file
    (e.g. a BPE tokenizer.json); recorded in the manifest and in every checkpoint."""
    val_percent: float = 5.0
    """Share of documents (chosen by a hash of a stable key, so deterministic) held out for validation."""
    shard_tokens: int = 16 * 2**20
    """Tokens per shard file."""
    prepare_workers: int = 0
    """Processes tokenizing in parallel during prepare; 0 uses every core."""
    shard_checksums_percent: float = 100.0
    """Share of the shards whose payload each worker checks (crc32 against the manifest, every token id below the
    vocabulary size) the first time it reads from them, chosen by a hash of the name; 100 checks every one. A bad
    shard stops the run at once with one line naming it. Each batch's token ids are checked against the
    vocabulary whatever this says (host readers)."""
    verify_checksums: bool = False
    """Before training, check every shard's crc32 on the driver (reads the whole dataset once);
    `archipelago verify DIR` does the same on its own."""
    reader: Literal["auto", "kvikio", "posix", "remote"] = "auto"
    """How workers read shards: auto takes kvikio (GPU-direct) on GPU workers where it can run, the
    POSIX reader for other local datasets, and pyarrow.fs byte ranges for URIs; the choice and the
    reason are in the run's start event."""
    reader_threads: int = 8
    """IO threads per worker for the posix and remote readers (kvikio's thread pool for kvikio)."""
    prefetch_steps: int = 2
    """Steps whose input is read ahead while the current step trains (2 = double buffering)."""

    def __post_init__(self) -> None:
        _check(bool(self.path), "[data] path", "is empty", 'set path to a dataset directory, e.g. "data/stdlib-bytes"')
        _check(self.tokenizer == "bytes" or (self.tokenizer.startswith("hf:") and len(self.tokenizer) > 3),
               "[data] tokenizer", f"{self.tokenizer!r} is not a tokenizer",
               'use "bytes" or "hf:path/to/tokenizer.json"')
        check_prepare_settings(shard_tokens=self.shard_tokens, workers=self.prepare_workers,
                               val_percent=self.val_percent, text_column=self.text_column, as_flags=False)
        _positive("data", reader_threads=self.reader_threads, prefetch_steps=self.prefetch_steps)
        _check(0.0 <= self.shard_checksums_percent <= 100.0, "[data] shard_checksums_percent",
               f"must be in [0, 100], got {self.shard_checksums_percent}", "set shard_checksums_percent = 100.0")


def check_prepare_settings(*, shard_tokens: int, workers: int, val_percent: float, text_column: str,
                           as_flags: bool) -> None:
    """The preparation settings, as [data] keys of a job or as flags of `archipelago prepare`: one set of
    rules for both, checked before anything is read or written. `as_flags` names the flags in the error."""
    checks = [(shard_tokens >= 1, "shard_tokens", "shard-tokens", f"must be 1 or more, got {shard_tokens}",
               "give the tokens per shard file, e.g. 16777216"),
              (workers >= 0, "prepare_workers", "workers", f"must be 0 or more, got {workers}",
               "give a number of processes, or 0 for every core"),
              (0.0 < val_percent < 100.0, "val_percent", "val-percent", f"must be in (0, 100), got {val_percent}",
               "hold out a share of the documents, e.g. 5"),
              (bool(text_column), "text_column", "text-column", "is empty", 'name the text field, e.g. "text"')]
    for ok, key, flag, problem, fix in checks:
        _check(ok, f"--{flag} / [data] {key}" if as_flags else f"[data] {key}", problem, fix)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps to train for (the total, counting steps done before a resume)."""
    global_batch_size: int = 32
    """Samples per optimizer step across all workers; stays fixed when workers come and go. With
    batch_size = "adaptive": the first batch, and the one `lr` is tuned for."""
    batch_size: Literal["fixed", "adaptive"] = "fixed"
    """adaptive: the global batch follows the gradient noise scale between min_batch_size and
    max_batch_size, re-split over the running workers at a step boundary, and the learning rate
    follows it by `lr_scaling` (core/adaptive_batch.py); the run trains steps × global_batch_size
    samples, and the schedule (warmup, decay) counts them in steps of global_batch_size."""
    min_batch_size: int = 0
    """adaptive: the smallest global batch (0 = global_batch_size)."""
    max_batch_size: int = 0
    """adaptive: the largest global batch (0 = global_batch_size)."""
    lr_scaling: Literal["adascale", "sqrt"] = "adascale"
    """adaptive: how the learning rate follows the batch B: adascale multiplies it by AdaScale's gain
    (1 + φ/global_batch_size) / (1 + φ/B), φ the measured noise scale; sqrt by sqrt(B / global_batch_size)."""
    micro_batch_size: int = 16
    """Samples per worker per forward pass; gradient accumulation makes up the rest."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms or biases)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = 0
    """Seeds model init and the data order."""
    log_every: int = 10
    """Steps between metric reports from the workers to the driver."""
    eval_every: int = 100
    """Steps between validation passes (and one at the end)."""
    eval_samples: int = 64
    """Validation samples per pass, split across workers."""
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """auto is bf16 on GPUs that support it and fp32 on CPU; fp16 adds loss scaling; fp8 trains the
    linear layers in float8 through torchao (GPUs with compute capability ≥ 8.9)."""
    float8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe, used when precision = "fp8"."""
    bf16_weights: bool = False
    """With precision bf16: forward and backward run on a bf16 copy of the model (no autocast), and
    the fp32 weights are kept as masters that AdamW updates, checkpoints save and evaluation uses
    (workers/compute_copy.py); on GPUs the AdamW step runs from the bf16 gradients in one pass
    (kernels/adamw.py). On one H200 the engine's step was 3.4 % faster than with autocast on GPT-2
    124M and 2.5 % on 1.3B, with 1.2 / 3.1 GiB less peak memory, and the one-pass step 2.4 % / 2.5 %
    faster again (benchmarks/RESULTS.md); gradients accumulate and all-reduce in bf16. Over 200 steps
    the loss stayed on autocast's curve (within 0.5 % at 1.3B, 2.6 % at 124M, inside the noise
    between two seeds). DDP with the allreduce or hierarchical hook only."""
    loss_kernel: Literal["fused", "plain", "chunked"] = "fused"
    """How the output projection and cross-entropy run. fused: one kernel makes each row's loss and
    its gradient in the forward pass (kernels.loss; 4.4 -> 2.3 ms for GPT-2 124M's logits on an
    H200; fp16 takes the plain loss, its gradient would underflow before the loss scale). plain:
    F.cross_entropy over fp32 logits. chunked: in row chunks, so the full (tokens ×
    vocab) logits never exist: saves about 1 GiB at GPT-2 124M, B=32, but cost 5 % of the step
    there (benchmarks/RESULTS.md)."""

    qat: Literal["", "int8-dynamic-act-int4-weight", "int8-weight"] = ""
    """Quantization-aware training (workers/qat.py, torchao): the linear layers train fake-quantized as
    they will run once quantized, and `archipelago export RUN --hf OUT --quantized` writes the really
    quantized model. "int8-dynamic-act-int4-weight": int8 activations per token, int4 weights per group
    of qat_group_size; "int8-weight": int8 weights per row. "" trains in full precision. The planner's
    memory estimate does not count the fake quantization's temporaries."""
    qat_group_size: int = 32
    """Input features sharing one int4 weight scale (int8-dynamic-act-int4-weight); layers whose width it
    does not divide stay in full precision."""

    def __post_init__(self) -> None:
        _check(not self.qat or (self.precision != "fp8" and not self.bf16_weights), "[train] qat",
               f"fake quantization does not combine with precision = {self.precision!r} / bf16_weights",
               'use precision "fp32", "bf16" or "auto" without bf16_weights for quantization-aware training')
        _positive("train", steps=self.steps, global_batch_size=self.global_batch_size,
                  micro_batch_size=self.micro_batch_size, lr=self.lr, log_every=self.log_every,
                  eval_every=self.eval_every, eval_samples=self.eval_samples)
        _check(0 <= self.min_lr <= self.lr, "[train] min_lr", f"must be in [0, lr = {self.lr}], got {self.min_lr}",
               "set min_lr to about lr / 10")
        _check(self.warmup_steps >= 0, "[train] warmup_steps", f"must be 0 or more, got {self.warmup_steps}",
               "set warmup_steps = 0 to disable warmup")
        _check(self.weight_decay >= 0, "[train] weight_decay", f"must be 0 or more, got {self.weight_decay}",
               "set weight_decay = 0.1")
        _check(self.grad_clip >= 0, "[train] grad_clip", f"must be 0 or more, got {self.grad_clip}",
               "set grad_clip = 1.0, or 0 to disable clipping")
        self._check_adaptive()

    def _check_adaptive(self) -> None:
        _check(self.lr_scaling in ("adascale", "sqrt"), "[train] lr_scaling", f"{self.lr_scaling!r} is not a rule",
               'set lr_scaling = "adascale" or "sqrt"')
        if self.batch_size != "adaptive":
            _check(self.min_batch_size == self.max_batch_size == 0, "[train] min_batch_size",
                   "min_batch_size and max_batch_size only apply to an adaptive batch",
                   'set batch_size = "adaptive", or leave them out')
            return
        self.min_batch_size = self.min_batch_size or self.global_batch_size
        self.max_batch_size = self.max_batch_size or self.global_batch_size
        _positive("train", min_batch_size=self.min_batch_size)
        _check(self.min_batch_size <= self.max_batch_size, "[train] min_batch_size",
               f"{self.min_batch_size} is above max_batch_size = {self.max_batch_size}",
               "set min_batch_size at most max_batch_size")
        _check(self.min_batch_size <= self.global_batch_size <= self.max_batch_size, "[train] global_batch_size",
               f"the first batch {self.global_batch_size} is outside [min_batch_size, max_batch_size] = "
               f"[{self.min_batch_size}, {self.max_batch_size}]", "set global_batch_size inside the range")


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    enable: bool = False
    """Compile the model with torch.compile (needs a C++ compiler on CPU)."""
    mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"] = "default"
    """torch.compile mode."""
    fullgraph: bool = True
    """Demand one graph where the wrapping allows it (one worker, or FSDP2's per-block compile);
    DDP's optimizer splits the graph at bucket boundaries by design."""
    check_tolerance: float = 1e-3
    """Largest relative difference allowed between the first micro-batch's loss from the compiled
    model and from the same model run eagerly; a larger one stops the run with a CompileError
    before any weight changes. Near the initial weights a wrong kernel moves the loss little: torch
    2.11's Inductor fed the 1.3B model's fused loss a wrong input once 0.4 % off and once 0.025 %
    off (under this tolerance; the model diverged), hence gradient_tolerance. 0 skips the check (and
    the gradients'); it is not made with dropout (the masks differ) or float8."""
    gradient_tolerance: float = 3e-2
    """Largest relative difference (L2 norm of the difference over the eager gradient's) allowed
    between any parameter's first-micro-batch gradient from the compiled step and from the same
    model run eagerly. bf16 rounds to 0.4 %, and reordered sums leave correct compiled gradients on an
    H200 up to 1.4 % away (GPT 124M's pos_emb 1.04 %, Llama-1B from transformers 0.84 %, with bf16
    weights 1.40 %); a 1 % tolerance stopped those runs. A gradient further than this from eager's
    under autocast is checked once more against the micro-batch run in full precision, and passes if
    it is no further from that than twice eager bf16's own distance (workers/compile_check.py).
    Compared by a worker alone only: DDP and FSDP reduce gradients inside
    backward. The eager pass recomputes its activations, so it needs less memory than the step, and
    keeps its gradients on the host until compared."""
    ddp_mode: Literal["auto", "ddp_optimizer", "compiled_autograd"] = "auto"
    """How compile meets DDP: Dynamo's DDPOptimizer (graph split per bucket, comm hooks work) or
    compiled autograd (one backward graph, comm captured in it; no comm hooks). auto takes
    DDPOptimizer: compiled autograd failed over two NCCL ranks in torch 2.11 (benchmarks/RESULTS.md)."""

    @property
    def uses_compiled_autograd(self) -> bool:
        """Whether compiled DDP runs under compiled autograd: only when asked for. "auto" takes
        DDPOptimizer: on two H200s it hides 98-99 % of the all-reduce and keeps pace with plain DDP +
        compile, while compiled autograd over two NCCL ranks failed in torch 2.11 ("Attempt to trace
        generator" in the compiled backward; benchmarks/RESULTS.md, multi-GPU section). Under
        compiled autograd DDP runs no comm hook."""
        return self.enable and self.ddp_mode == "compiled_autograd"

    def __post_init__(self) -> None:
        _check(self.check_tolerance >= 0, "[compile] check_tolerance", f"must be 0 or more, got {self.check_tolerance}",
               "set check_tolerance = 0 to skip the check, or e.g. 1e-3")
        _check(self.gradient_tolerance > 0, "[compile] gradient_tolerance",
               f"must be more than 0, got {self.gradient_tolerance}",
               "set gradient_tolerance to e.g. 3e-2; check_tolerance = 0 skips the whole check")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "hsdp", "auto"] = "ddp"
    """ddp replicates the model on every worker; fsdp (FSDP2, one shard group per block) shards
    parameters, gradients and optimizer state for models that do not fit one device; hsdp shards
    inside each NVLink island and replicates across islands (all-gathers on NVLink, one all-reduce
    of a shard across). auto lets the planner cost all three and take the best (Plan.data_parallel
    says which). With tensor parallelism the data-parallel side runs on FSDP2 whatever this says
    (DDP does not take DTensor parameters): ddp there is FSDP2 with shards of one rank."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto is nccl on GPUs, gloo on CPUs."""
    activation_checkpointing: Literal["off", "selective", "full"] = "off"
    """Recompute block activations in backward to fit larger micro-batches."""
    comm_hook: Literal["allreduce", "auto", "bf16", "powersgd", "topk", "hierarchical"] = "allreduce"
    """How DDP averages gradients (see workers/comm/hooks.py); hierarchical follows NVLink islands.
    auto lets the plan pick bf16 where it predicts a step at least 5 % shorter than plain
    all-reduce's (not with bf16_weights or compiled autograd), allreduce otherwise; the plan says
    which (Plan.comm_hook).
    The planner costs each hook's bytes on the wire and its own compute (planning/
    comm_hooks.py), and where plain all-reduce leaves the step waiting, its notes say what each
    compressing hook would do. Over a 3.4 GB/s link between two H200s, GPT-2 124M's step went from
    174 ms (allreduce) to 116 (bf16), 85 (powersgd) and 62 (topk), but only bf16 reached allreduce's
    loss sooner (1.8x, 200 steps); over NVSwitch none beat allreduce (benchmarks/RESULTS.md).
    powersgd needs nccl: over gloo it hangs, and is refused."""
    bucket_mb: float = 25.0
    """DDP gradient bucket size when the plan does not choose one."""
    comm_warmup_steps: int = 10
    """Plain all-reduce steps before powersgd or topk start compressing."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank approximation."""
    topk_ratio: float = 0.01
    """Share of gradient entries the topk hook sends each step (the rest waits in the residual)."""
    topk_ramp_steps: int = 0
    """Compressed steps over which the share the topk hook sends falls exponentially from 25% to
    topk_ratio (Deep Gradient Compression's sparsity warm-up); 0 sends topk_ratio from the first.
    On the tiny text model at 3% of entries, 300 steps ended 23% above plain all-reduce's loss
    without it and 4.8% above with 100 (tests/unit/test_engine.py)."""
    topk_wire: Literal["elias_fano", "offsets"] = "elias_fano"
    """How the topk hook sends its entries' places: Elias–Fano coded (kernels.wire: 1.05 bytes an
    entry at 1 % of the bucket, 0.65 at 10 %, against 2 as offsets; the wire 29 % smaller at 1 %,
    45 % at 10 %), or "offsets", the payload as compress made it, which saves an encode and a
    decode of every rank's payload a step. On two H200s with GPT-2 124M that work cost about 0.4 ms of
    a 64 ms step over NVSwitch at 1 % (one call) (2.0 ms while a ramp sends 25 % down to 5 %), and nothing
    measurable over a 3.4 GB/s link, where the all-gather hid behind backward either way
    (benchmarks/RESULTS.md). The planner costs both, and the plan's notes name the other where it
    is predicted faster: Elias–Fano pays where the all-gather is exposed, on slow links."""

    overlap: Literal["off", "next_forward"] = "off"
    """next_forward lets the gradient reduction run on into the next step's forward
    (workers/comm/overlap.py): buckets that backward fills after `overlap_backward_share` of the
    step's bytes are sent once it ends, the first layers' first, and each bucket's optimizer update
    is applied just before the next forward first uses its parameters. For links slower than
    backward; DDP with comm_hook "allreduce" or "bf16", no gradient clipping (grad_clip = 0), not
    fp16, bf16_weights or compiled autograd. Blocks are compiled one by one, as under FSDP.
    On two H200s over a 3.4 GB/s link: GPT 1.3B with bf16 807 ms a step against 915, in fp32
    (share 0.12) 1,850 against 1,973; GPT-2 124M no faster (its tied embedding, a third of the
    bytes, is the last bucket out of backward and the first the forward needs), nor over NVSwitch,
    where nothing waits (benchmarks/RESULTS.md)."""
    overlap_backward_share: float = 0.0
    """With overlap = "next_forward": the share of a step's gradient bytes sent while backward still
    runs, in the order its buckets fill. 0 takes it from the plan: its predicted backward time
    (two thirds of compute) over its predicted communication time, at most 1."""

    def __post_init__(self) -> None:
        _positive("parallel", bucket_mb=self.bucket_mb, powersgd_rank=self.powersgd_rank)
        _check(0.0 <= self.overlap_backward_share <= 1.0, "[parallel] overlap_backward_share",
               f"must be in [0, 1], got {self.overlap_backward_share}", "set it to 0 to take it from the plan")
        _check(0.0 < self.topk_ratio <= 0.5, "[parallel] topk_ratio", f"must be in (0, 0.5], got {self.topk_ratio}",
               "set topk_ratio = 0.01 (send 1% of entries per step)")
        _check(self.comm_warmup_steps >= 0, "[parallel] comm_warmup_steps",
               f"must be 0 or more, got {self.comm_warmup_steps}", "set comm_warmup_steps = 10")
        _check(self.topk_ramp_steps >= 0, "[parallel] topk_ramp_steps",
               f"must be 0 or more, got {self.topk_ramp_steps}", "set topk_ramp_steps = 0 (no ramp) or e.g. 100")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 100
    """Steps between committed checkpoints (and one at the end)."""
    keep_last: int = 3
    """Committed checkpoints kept; older ones are deleted once a newer one is committed."""
    storage: str = ""
    """Where checkpoints go: empty is the run directory (<runs_dir>/<name>/step_*); otherwise a directory
    or pyarrow.fs URI ("s3://bucket/ckpt?endpoint_override=host:9000&scheme=http") that gets <name>/step_*."""
    async_save: bool = False
    """Copy the state to host memory and write it in the background while training goes on; a step is
    reported committed only once written."""
    reader: Literal["auto", "kvikio", "posix", "remote"] = "auto"
    """How a restore reads checkpoint files, and a fresh start [model] hf_dir's safetensors: auto reads
    straight into GPU memory with kvikio where it can."""

    def __post_init__(self) -> None:
        _positive("checkpoint", every_steps=self.every_steps, keep_last=self.keep_last)


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    address: str = ""
    """Ray cluster to join ("auto", "ray://host:10001", host:port); empty uses RAY_ADDRESS or starts
    an embedded local cluster."""
    num_workers: int = 2
    """Ray Train workers (one per GPU when use_gpu)."""
    use_gpu: bool = False
    """Give each worker one GPU."""
    cpus_per_worker: int = 1
    """CPU cores reserved per worker (and torch threads on CPU workers)."""
    connect_timeout_s: float = 30.0
    """How long joining the cluster at `address` may take before fit stops with one line saying so
    (`--connect-timeout` on the command line)."""

    def __post_init__(self) -> None:
        _positive("cluster", num_workers=self.num_workers, cpus_per_worker=self.cpus_per_worker)
        _check(math.isfinite(self.connect_timeout_s) and self.connect_timeout_s > 0, "[cluster] connect_timeout_s",
               f"must be a number of seconds above 0, got {self.connect_timeout_s:g}", "set connect_timeout_s = 30.0")


@dataclass(kw_only=True, slots=True)
class PlacementConfig:
    objective: Literal["fastest", "cheapest", "cheapest_under_deadline", "goodput", "cheapest_to_target"] = "fastest"
    """What the planner optimises: the shortest step, the fewest dollars per million tokens, the
    fewest dollars per million tokens among plans that finish `[train] steps` within deadline_hours,
    the most goodput (tokens a second times the statistical efficiency of the plan's global batch at
    the gradient noise scale, core/adaptive_batch.py), or the fewest dollars to train tokens_to_target
    tokens' worth of progress. The two last also choose the global batch among [train] min_batch_size
    … max_batch_size when batch_size = "adaptive" (planning/goodput.py); with a fixed batch they rank
    as fastest and cheapest do."""
    deadline_hours: float = 0.0
    """Wall-clock limit for the whole job; needed by cheapest_under_deadline, ignored otherwise."""
    noise_scale: float | None = None
    """goodput, cheapest_to_target: the gradient noise scale B_noise (samples) to plan with until the run
    has measured one (an elastic re-plan takes the run's measured value), e.g. the noise_scale an
    earlier run's metrics.jsonl ends with. Left out: every batch is costed as equally useful per
    sample (efficiency 1), and the plan's notes say so."""
    tokens_to_target: int = 0
    """cheapest_to_target: tokens the run needs to reach its target loss when trained at [train]
    global_batch_size (an earlier run's report gives the tokens at each [bill] targets loss); at batch
    B it needs (B_noise + B) / (B_noise + global_batch_size) times as many."""
    min_gpus: int = 1
    """Fewest GPUs (or MIG slices) the plan may use."""
    max_gpus: int = 0
    """Most GPUs (or MIG slices) the plan may use; 0 means every one in the cluster. The planner
    uses fewer when more would be slower (fastest) or cost more per token (cheapest)."""
    tensor_parallel_size: int = 1
    """GPUs that split each layer between them (DTensor, Megatron-style with sequence parallelism);
    each group stays inside one NVLink island of whole GPUs (never MIG slices). 1 means data
    parallelism only; 0 lets the planner cost every size up to the largest island that divides the
    model's heads and take the best (Plan.tensor_parallel_size says which)."""
    nccl_nics: bool = True
    """Tell NCCL which NICs sit next to each worker's GPU (NCCL_IB_HCA for InfiniBand/RoCE,
    NCCL_SOCKET_IFNAME for Ethernet, from the topology's NIC map), per worker, in the plan; false
    leaves NCCL to pick its own."""
    use_mig: bool = True
    """Let the planner place workers on MIG slices."""
    pricing: Literal["on_demand", "spot"] = "on_demand"
    """Which price column the dollars are computed from."""
    prices: dict[str, float] = field(default_factory=dict)
    """Dollars per device-hour in the chosen pricing column, by GPU model as the topology names it
    (e.g. "H100-SXM5-80GB" = 2.10), or per core-hour for "cpu"; overrides planning/prices.py's table.
    A MIG slice costs its parent's price times its share of the SMs. The planner refuses a name that is
    neither a catalog key nor a device of the cluster (it would price nothing)."""
    calibration_file: str = ""
    """A JSON table of measured collective costs by link class, {"nvswitch": {"alpha_us": 30.1,
    "bus_gb_per_s": 323.1}}, as benchmarks/multigpu.py writes it (calibration.json) from an all-reduce
    sweep, and of compute efficiency by device model, "compute_efficiency": {"cpu": 0.94}, as
    `archipelago calibrate RUN...` fits it from finished runs (planning/calibration.py); rows it gives
    replace planning/collectives.py's and planning/compute.py's defaults. A link row may also give
    ddp_compute_slowdown (a share; the link class's figure when left out). Empty: `fit` and `plan` read
    <runs_dir>/calibration.json when there is one. Relative paths are from the working directory."""

    def __post_init__(self) -> None:
        _positive("placement", min_gpus=self.min_gpus)
        _check(self.tensor_parallel_size >= 0, "[placement] tensor_parallel_size",
               f"must be 0 (the planner picks) or more, got {self.tensor_parallel_size}",
               "set tensor_parallel_size = 1 for data parallelism only, or 0 to let the planner pick")
        _check(self.max_gpus == 0 or self.max_gpus >= self.min_gpus, "[placement] max_gpus",
               f"{self.max_gpus} is below min_gpus = {self.min_gpus}", "raise max_gpus, or set it to 0 for no limit")
        _check(self.deadline_hours >= 0, "[placement] deadline_hours", f"must be 0 or more, got {self.deadline_hours}",
               "give the job's wall-clock limit in hours, e.g. deadline_hours = 12.0")
        _check(self.objective != "cheapest_under_deadline" or self.deadline_hours > 0, "[placement] deadline_hours",
               "cheapest_under_deadline needs a deadline", "set deadline_hours, e.g. deadline_hours = 12.0")
        _check(self.noise_scale is None or (math.isfinite(self.noise_scale) and self.noise_scale >= 0),
               "[placement] noise_scale", f"must be a number of samples ≥ 0, got {self.noise_scale}",
               "give the gradient noise scale a run measured (metrics.jsonl's noise_scale), or leave it out")
        _check(self.tokens_to_target >= 0, "[placement] tokens_to_target", f"must be 0 or more, got {self.tokens_to_target}",
               "give the tokens the run needs to reach its target loss, e.g. tokens_to_target = 2000000000")
        _check(self.objective != "cheapest_to_target" or self.tokens_to_target > 0, "[placement] tokens_to_target",
               "cheapest_to_target needs the tokens to reach the target", "set tokens_to_target to the tokens the run "
               "needs at [train] global_batch_size (a finished run's report gives them at each [bill] targets loss), "
               'or use objective = "goodput"')
        for model, price in self.prices.items():
            _check(price >= 0, f"[placement] prices.{model}", f"must be 0 or more, got {price}",
                   "give dollars per device-hour, e.g. 2.10")


@dataclass(kw_only=True, slots=True)
class DeviceSpec:
    """A GPU model described by hand, for GPUs the device catalog lacks (or to replace its figures):

        [devices."NVIDIA GeForce RTX 3090"]     # the name `nvidia-smi -L` prints, or a catalog key
        bf16_tflops = 71.0                       # dense, per GPU (fp16 if it has no bf16; fp32 if neither)
        memory_gib = 24.0
        price = 0.35                             # dollars per GPU-hour, in the [placement] pricing column
        memory_gb_per_s = 936.0                  # optional: memory bandwidth, GB/s

    The planner uses these over measured and catalog figures; every field but the bandwidth is needed."""

    bf16_tflops: float | None = None
    """Dense bf16 tensor TFLOP/s of one GPU (the rate the planner's utilisation is a share of)."""
    memory_gib: float | None = None
    """Memory of one GPU, GiB; replaces what the map says (nvidia-smi texts carry no memory)."""
    price: float | None = None
    """Dollars per GPU-hour in the [placement] pricing column; [placement] prices still override it."""
    memory_gb_per_s: float | None = None
    """Memory bandwidth of one GPU, GB/s, from its data sheet: what a compiled step's memory traffic
    runs at (planning/compute.py). Without it, an A100's 2,000 GB/s."""


DEVICE_FIELDS = ("bf16_tflops", "memory_gib", "price")
_DEVICE_EXAMPLE = {"bf16_tflops": "bf16_tflops = 71.0", "memory_gib": "memory_gib = 24.0", "price": "price = 0.35"}


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """How the job rides out workers coming and going (see orchestrator/coordinator.py).

    On every start of the worker group (the first, and each restart after a failure, a preemption
    or a resize) the driver plans again for the workers Ray actually granted; the global batch and
    the learning-rate schedule stay as [train] says, and training resumes at the exact next sample
    of the newest committed checkpoint."""

    min_workers: int = 0
    """Fewest workers the job runs on: Ray Train starts or restarts it with anything from min_workers
    to the planned size ([cluster] num_workers on CPUs, the plan's GPUs on GPUs) and grows it again
    when capacity returns. 0 keeps the size fixed."""
    max_failures: int = 3
    """Worker failures (a process or node that dies) the run recovers from, restarting from the newest
    committed checkpoint each time; one more stops the run with a FailureBudgetError. -1 = no limit."""
    max_preemption_failures: int = -1
    """Preemptions (a node drained with notice, e.g. a spot reclaim) the run recovers from, counted
    apart from max_failures. -1 = no limit, 0 = none."""
    preemption_grace_s: float = 0.0
    """Seconds the surviving workers may run past a preemption deadline (to finish the checkpoint
    taken on notice) before Ray Train tears them down."""
    preemption_check_steps: int = 10
    """Steps between polls of Ray's preemption notice; on notice every worker commits a checkpoint at
    once. Each poll blocks every worker's loop on a Ray barrier (7.5 ms median with 2 local workers),
    too much to pay every step; lower it when steps are long next to the cloud's notice (~30 s or more)."""
    resize_check_s: float = 60.0
    """Seconds between Ray Train's checks for capacity to grow a running elastic job (Ray's
    elastic_resize_monitor_interval_s); a grow restarts the workers from the newest checkpoint."""
    sample_ledger: bool = False
    """Record, in every checkpoint, the global sample ids of every committed step (8 bytes per sample
    trained so far), so a test can prove each sample was used exactly once (storage/ledger.py)."""
    health_check_timeout_s: float = 120.0
    """Seconds a worker may leave Ray Train's health check unanswered (a process frozen or stopped, a
    machine swapping) before it counts as failed and the group restarts from the newest committed
    checkpoint; its peers wait in their collectives meanwhile. Ray's own default is 600 s
    (RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, which this sets for the run)."""

    def __post_init__(self) -> None:
        _check(self.min_workers >= 0, "[elastic] min_workers", f"must be 0 or more, got {self.min_workers}",
               "set min_workers = 0 for a fixed size, or the fewest workers the job may run on")
        for name in ("max_failures", "max_preemption_failures"):
            value = getattr(self, name)
            _check(value >= -1, f"[elastic] {name}", f"must be -1 (no limit) or more, got {value}",
                   f"set {name} = -1 for no limit, 0 to stop at the first, or a count")
        _check(self.preemption_grace_s >= 0, "[elastic] preemption_grace_s",
               f"must be 0 or more, got {self.preemption_grace_s}", "set preemption_grace_s = 0.0")
        _positive("elastic", preemption_check_steps=self.preemption_check_steps)
        _check(self.resize_check_s >= 0, "[elastic] resize_check_s", f"must be 0 or more, got {self.resize_check_s}",
               "set resize_check_s = 60.0")
        _positive("elastic", health_check_timeout_s=self.health_check_timeout_s)


@dataclass(kw_only=True, slots=True)
class AlertsConfig:
    """Alerts printed on the driver while training runs and listed in the report (orchestrator/accounting/alerts.py).
    Each is on by default; 0 (or false) turns one off."""

    cost_rise_percent: float = 25.0
    """Alert when the dollars per 1,000 steps over the last `cost_window_steps` steps exceed those of
    the window before by more than this percentage (slower steps, a resize to pricier devices,
    steps redone after a restart); an adaptive batch's steps are compared per sample."""
    cost_window_steps: int = 100
    """Steps in each of the two windows the cost alert compares."""
    val_patience_steps: int = 1000
    """Alert when the validation loss has not improved on its best for this many steps."""
    loss_rise_percent: float = 20.0
    """Alert when the mean training loss over the last `loss_window_steps` steps is more than this
    percentage above the lowest such mean so far: a diverging run (a learning rate too high, a
    faulty kernel) keeps its speed, and its bill, while it unlearns."""
    loss_window_steps: int = 50
    """Steps the training-loss alert averages over (one step's loss on real text moves by ~15 %)."""
    mfu_floor: float = 0.2
    """Alert when a log window's model FLOPs utilisation on GPUs falls below this share of peak
    (CPU workers' MFU is against a nominal peak and is not held to it)."""
    skipped_steps: bool = True
    """Alert when steps are skipped because their gradients held inf/NaN (fp16 loss scaling), or a
    reported loss is not finite."""
    recompilations: bool = True
    """Alert when torch.compile recompiles after the first log window (shapes or guards changing
    mid-run cost a compile each time)."""

    def __post_init__(self) -> None:
        for name in ("cost_rise_percent", "mfu_floor", "loss_rise_percent"):
            _check(getattr(self, name) >= 0, f"[bill.alerts] {name}", f"must be 0 or more, got {getattr(self, name)}",
                   f"set {name} = 0 to turn this alert off")
        _check(self.mfu_floor < 1, "[bill.alerts] mfu_floor", f"is a share of peak below 1, got {self.mfu_floor}",
               "write a share, e.g. mfu_floor = 0.2 for 20%")
        _positive("bill.alerts", cost_window_steps=self.cost_window_steps, loss_window_steps=self.loss_window_steps)
        _check(self.val_patience_steps >= 0, "[bill.alerts] val_patience_steps",
               f"must be 0 or more, got {self.val_patience_steps}", "set val_patience_steps = 0 to turn this alert off")


@dataclass(kw_only=True, slots=True)
class BillConfig:
    """Cost and convergence accounting: targets, alerts and exports (orchestrator/accounting/bill.py, report.py)."""

    targets: list[float] = field(default_factory=list)
    """Validation losses to price, e.g. [3.0, 2.5, 2.2]: the report gives the dollars and GPU-hours at
    which the run first reached each, and projects the cost of the first one not reached yet."""
    prices_file: str = ""
    """A TOML or JSON file of device prices per hour that replaces rows of planning/prices.py's table:
    "H100-SXM5-80GB" = { on_demand = 2.49, spot = 1.25 } (a column left out keeps the default);
    `[placement] prices` override it in turn; a row naming neither a catalog key nor a device of the
    cluster is refused, as a price there is. Relative paths are from the working directory."""
    tensorboard: bool = True
    """Write the bill's per-step numbers as TensorBoard events into <run>/tensorboard/."""
    prometheus: bool = True
    """Export loss, tokens/s, MFU and dollars as Prometheus metrics through Ray's metrics agent
    (ray.util.metrics; scraped from each node's metrics export port)."""
    mlflow: bool = False
    """Track the run in MLflow too (pip install 'archipelago[mlflow]'): the job config as params, the
    bill's per-step numbers (TensorBoard's names) as metrics, and at the end the plan, the bill and
    the report as artifacts; a resumed run continues its MLflow run."""
    mlflow_uri: str = ""
    """The MLflow tracking URI: a server ("https://mlflow.example.com"), "sqlite:///mlflow.db", or
    "" for a local file store at <runs_dir>/mlruns (`mlflow ui --backend-store-uri runs/mlruns`)."""
    alerts: AlertsConfig = field(default_factory=AlertsConfig)

    def __post_init__(self) -> None:
        _check(not self.mlflow or importlib.util.find_spec("mlflow") is not None, "[bill] mlflow",
               "MLflow is not installed", "pip install 'archipelago[mlflow]', or set mlflow = false")
        for i, target in enumerate(self.targets):
            _check(0 < target < float("inf"), f"[bill] targets[{i}]", f"must be a positive loss, got {target}",
                   "list validation losses to reach, e.g. targets = [3.0, 2.5]")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    name: str = "run"
    """Run name: outputs go to <runs_dir>/<name>/."""
    runs_dir: str = "runs"
    """Directory holding one folder per run (metrics, report, checkpoints)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    bill: BillConfig = field(default_factory=BillConfig)
    devices: dict[str, DeviceSpec] = field(default_factory=dict)
    """GPU models described by hand, by the name nvidia-smi prints: [devices."NVIDIA GeForce RTX 3090"]."""

    def __post_init__(self) -> None:
        for refusal in self._refusals():
            if refusal is not None:
                raise refusal.error()
        self._check_devices()
        # DDP's first bucket is 1 MiB; Dynamo's DDPOptimizer, which splits the compiled DDP graph at
        # bucket boundaries, asserts that no bucket is smaller (torch 2.11, found on two H200s).
        _check(not (self.compile.enable and self.parallel.strategy == "ddp" and self.parallel.overlap == "off"
                    and not self.compile.uses_compiled_autograd and self.parallel.bucket_mb < 1.0),
               "[parallel] bucket_mb", f"{self.parallel.bucket_mb:g} is below the 1 MiB that compiled DDP "
               "(Dynamo's DDPOptimizer) accepts", "set bucket_mb to 1 or more, or [compile] enable = false")
        _check(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "name",
               f"{self.name!r} is not a usable run name", 'use letters, digits, "-" and "_", e.g. name = "cpu-tiny"')
        # A fixed number of CPU workers are identical slots that split the batch evenly; GPU jobs and
        # elastic jobs get their micro-batches from the planner for the workers they are granted.
        elastic = self.elastic.min_workers > 0
        _check(not elastic or self.elastic.min_workers <= self.cluster.num_workers, "[elastic] min_workers",
               f"{self.elastic.min_workers} is above [cluster] num_workers = {self.cluster.num_workers}",
               "set min_workers to at most num_workers, or 0 for a fixed size")
        tp = self.placement.tensor_parallel_size
        _check(not elastic or tp <= 1, "[elastic] min_workers",
               f"Ray Train restarts an elastic group on any worker count from {self.elastic.min_workers} up, and "
               f"tensor_parallel_size = {tp} runs only on multiples of {tp}",
               "set [placement] tensor_parallel_size = 0 (each re-plan takes a size that divides the workers "
               "granted), or min_workers = 0 for a fixed size")
        if self.train.batch_size == "adaptive":
            self._check_adaptive_batch()
        if self.cluster.use_gpu:
            return
        world_sizes = range(self.elastic.min_workers if elastic else self.cluster.num_workers,
                            self.cluster.num_workers + 1)
        if self.train.batch_size == "adaptive":  # its ends must split; the batches between are picked among those that do
            for key in ("min_batch_size", "max_batch_size"):
                self._check_batch_splits(world_sizes, getattr(self.train, key), key)
        if elastic:
            self._check_batch_splits(world_sizes, self.train.global_batch_size, "global_batch_size")
            return
        per_pass = self.train.micro_batch_size * self.cluster.num_workers
        _check(self.train.global_batch_size % per_pass == 0, "[train] global_batch_size",
               f"{self.train.global_batch_size} is not a multiple of micro_batch_size × num_workers = "
               f"{self.train.micro_batch_size} × {self.cluster.num_workers} = {per_pass}",
               f"set global_batch_size to a multiple of {per_pass} (e.g. {per_pass * max(1, round(self.train.global_batch_size / per_pass))})")

    def _refusals(self) -> Iterator[rules.Refusal | None]:
        """The rules (core/rules.py) that judge several sections together, in the order they are told."""
        train, parallel = self.train, self.parallel
        compiled_autograd = self.compile.uses_compiled_autograd
        if train.bf16_weights:
            yield rules.bf16_weights_refusal(train.precision, use_gpu=self.cluster.use_gpu, strategy=parallel.strategy)
        yield rules.precision_refusal(train.precision, use_gpu=self.cluster.use_gpu, compile=self.compile.enable)
        yield rules.comm_hook_refusal(parallel.comm_hook, backend=self.gradient_backend, strategy=parallel.strategy,
                                      compiled_autograd=compiled_autograd, bf16_weights=train.bf16_weights)
        if parallel.overlap == "next_forward":
            yield rules.overlap_refusal(strategy=parallel.strategy, hook=parallel.comm_hook, grad_clip=train.grad_clip,
                                        precision=train.precision, bf16_weights=train.bf16_weights,
                                        compiled_autograd=compiled_autograd, builtin_model=self.model.kind != "custom")
        yield self.tensor_parallel_refusal(self.placement.tensor_parallel_size)

    def tensor_parallel_refusal(self, size: int) -> rules.Refusal | None:
        """Whether this job's layers can be split over `size` GPUs: its own tensor_parallel_size, or each
        size the planner weighs under tensor_parallel_size = 0."""
        train, parallel = self.train, self.parallel
        return rules.tensor_parallel_refusal(size, use_gpu=self.cluster.use_gpu,
                                             builtin_model=self.model.kind in ("gpt", "llama"),
                                             hook=parallel.comm_hook, overlap=parallel.overlap, precision=train.precision,
                                             bf16_weights=train.bf16_weights, qat=train.qat,
                                             divisible=self.model.tensor_split_sizes())

    def _check_devices(self) -> None:
        """Every [devices."NAME"] table gives every figure, each a finite number ≥ 0 (a figure above 0
        for the TFLOP/s and memory, and for the bandwidth where it gives one)."""
        for name, spec in self.devices.items():
            _check(bool(name.strip()), "[devices]", "a device table has an empty name",
                   'name it as `nvidia-smi -L` prints the GPU, e.g. [devices."NVIDIA GeForce RTX 3090"]')
            for key in DEVICE_FIELDS:
                value = getattr(spec, key)
                where = f'[devices."{name}"] {key}'
                _check(value is not None, where, "is missing", f"every device table needs {', '.join(DEVICE_FIELDS)}: "
                       f"add {_DEVICE_EXAMPLE[key]}")
                _check(math.isfinite(value) and value >= 0 and (value > 0 or key == "price"), where,
                       f"must be a {'number ≥ 0' if key == 'price' else 'positive number'}, got {value}",
                       f"give the GPU's figure from its data sheet, e.g. {_DEVICE_EXAMPLE[key]}")
            bandwidth = spec.memory_gb_per_s
            _check(bandwidth is None or (math.isfinite(bandwidth) and bandwidth > 0), f'[devices."{name}"] memory_gb_per_s',
                   f"must be a positive number, got {bandwidth}",
                   "give the GPU's memory bandwidth from its data sheet, e.g. memory_gb_per_s = 936.0, or leave it out")

    @property
    def gradient_backend(self) -> str:
        """The process-group backend this config asks for: [parallel] backend, or for "auto" gloo on CPU
        workers and nccl on GPUs (the planner may still take gloo for several MIG slices of one GPU)."""
        if self.parallel.backend != "auto":
            return self.parallel.backend
        return "nccl" if self.cluster.use_gpu else "gloo"

    def _check_adaptive_batch(self) -> None:
        """An adaptive batch is measured from each replica's gradient bucket (or each micro-batch's
        gradient on one worker) and re-split between steps; these setups have neither."""
        unsupported = [(self.parallel.strategy == "fsdp", 'strategy = "fsdp" (no whole local gradient to measure)',
                        '[parallel] strategy = "ddp"'),
                       (self.parallel.overlap != "off", "overlap = \"next_forward\" (its own hook)",
                        '[parallel] overlap = "off"'),
                       (self.compile.uses_compiled_autograd, "compiled autograd (no comm hook runs)",
                        '[compile] ddp_mode = "auto"'),
                       (self.placement.tensor_parallel_size > 1, "tensor parallelism (partial local gradients)",
                        "[placement] tensor_parallel_size = 1"),
                       (self.train.precision == "fp16", "fp16 (the buckets hold loss-scaled gradients)",
                        '[train] precision = "bf16"')]
        for refused, what, fix in unsupported:
            _check(not refused, "[train] batch_size", f'"adaptive" does not run with {what}',
                   f'set {fix}, or batch_size = "fixed"')

    def _check_batch_splits(self, world_sizes: range, batch: int, key: str) -> None:
        """Every worker count in `world_sizes` can split `batch` ([train] `key`): some accumulation
        count a leaves batch / a samples per micro-step, between one and micro_batch_size per worker."""
        micro = self.train.micro_batch_size
        bad = [w for w in world_sizes
               if not any(batch % a == 0 and w <= batch // a <= w * micro for a in range(1, batch + 1))]
        if not bad:
            return
        lcm = math.lcm(*world_sizes)
        _check(False, f"[train] {key}",
               f"{batch} samples cannot be split over {' or '.join(map(str, bad))} workers of at most "
               f"micro_batch_size = {micro} (the [elastic] range is {world_sizes.start}–{world_sizes.stop - 1} workers)",
               f"make {key} a multiple of {lcm} (e.g. {lcm * max(1, round(batch / lcm))}), raise "
               "micro_batch_size, or narrow the range with [elastic] min_workers")

    @property
    def grad_accum_steps(self) -> int:
        """Accumulation on num_workers identical CPU workers (for GPU and elastic jobs the plan decides)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.cluster.num_workers)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.model.seq_len

    @classmethod
    def from_toml(cls, path: str | Path) -> JobConfig:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError("config file not found", where=str(path),
                              fix="check the path; examples/ holds ready-made configs such as examples/cpu-tiny.toml") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file: {e.strerror}", where=str(path)) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"malformed TOML: {e}", where=str(path), fix="fix the TOML syntax at that line") from None
        if not data:  # most likely the wrong file: training every default would spend the user's money on a guess
            raise ConfigError("the config sets nothing (no table, no key)", where=str(path),
                              fix="name what to train, e.g. start from examples/cpu-tiny.toml")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(e.what, where=f"{path}: {e.where}" if e.where else str(path), fix=e.fix) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        return _build(cls, data, section="")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain values; a key left at None is left out (TOML has no null), which reads back as None."""
        return _without_none(dataclasses.asdict(self))


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    return {key: _without_none(value) if isinstance(value, dict) else value
            for key, value in table.items() if value is not None}


_RENAMED = {"train.chunked_loss": 'it is now loss_kernel: write loss_kernel = "chunked" (or "fused", the default, or "plain")'}
"""Keys that were renamed: the error for the old name says what to write instead."""


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if cls is ModelConfig:
        data = _model_table(data, names)
    kwargs = {}
    for key, value in data.items():
        where = f"[{section}] {key}" if section else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(names)}"
            fix = _RENAMED.get(f"{section}.{key}", fix)
            raise ConfigError("unknown key", where=where, fix=fix)
        kwargs[key] = _convert(value, hints[key], where, key, f"{section}.{key}" if section else key)
    return cls(**kwargs)


def _model_table(data: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The [model] table with its preset's shape under the keys it gives, and, for kind = "custom",
    the keys archipelago does not know gathered into `options` for the factory."""
    preset = data.get("preset")
    if isinstance(preset, str) and preset in MODEL_PRESETS:
        shape_kind = MODEL_PRESETS[preset]["kind"]
        _check(data.get("kind", shape_kind) in (shape_kind, "custom"), "[model] kind",
               f"preset {preset!r} is a {shape_kind} shape, and kind = {data.get('kind')!r} would train another model "
               "sized by part of it",
               f'leave kind out (the preset sets kind = "{shape_kind}"), or leave the preset out')
        data = {**MODEL_PRESETS[preset], **data}
    if data.get("kind", "gpt") == "gpt":
        # A saved config (to_dict) writes every key with its default: only a value that would change a Llama counts.
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        given = [key for key in LLAMA_SIZES if key in data and data[key] != defaults[key]]
        if given:
            raise ConfigError("is a llama key: the gpt model (the default kind) does not read it",
                              where=f"[model] {given[0]}", fix=f'set kind = "llama" to train a Llama, or leave {", ".join(given)} out')
    if isinstance(data.get("hf_dir"), str) and data["hf_dir"]:
        data = _with_hf_shape(data)
    if data.get("kind") == "custom":
        unknown = {key: value for key, value in data.items() if key not in names}
        data = {key: value for key, value in data.items() if key in names}
        data["options"] = {**data.get("options", {}), **unknown}
    return data


def _with_hf_shape(data: dict[str, Any]) -> dict[str, Any]:
    """The [model] table with the shape its hf_dir's config.json fixes (a key the table gives too must
    agree), and hf_dir made absolute: the workers read its weights, and export its tokenizer, from
    wherever they run."""
    data = {**data, "hf_dir": str(Path(data["hf_dir"]).resolve())}
    shape = shape_of(read_hf_config(data["hf_dir"]))
    for key, value in shape.items():
        _check(key not in data or data[key] == value, f"[model] {key}",
               f"{data.get(key)!r} disagrees with {data['hf_dir']}/{CONFIG_FILE}, which says {value!r}",
               f"leave {key} out: hf_dir's config.json sizes the model")
    return {**data, **shape}


def _convert(value: Any, hint: Any, where: str, key: str, path: str) -> Any:
    """`value` as type `hint`; `path` is the dotted TOML name a nested section is written under ("bill.alerts")."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"must be a table, got {type(value).__name__}", where=path, fix=f"write it as a [{path}] section")
        return _build(hint, value, section=path)
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{value!r} is not one of {', '.join(map(repr, choices))}", where=where,
                              fix=f"set it to one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:  # to_dict's JSON (a report's config) writes a key left out as null
            return None
        return _convert(value, next(a for a in typing.get_args(hint) if a is not type(None)), where, key, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"must be a table, got {value!r}", where=where, fix=f"write it as {key} = {{ name = value }}")
        item_hint = typing.get_args(hint)[1]
        # A table of sections ([devices."NAME"]) names each section in its errors.
        sub = (lambda name: f'{path}."{name}"') if dataclasses.is_dataclass(item_hint) else (lambda name: path)
        return {name: _convert(item, item_hint, f"{where}.{name}", key, sub(name)) for name, item in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"must be a list, got {value!r}", where=where, fix=f"write it as {key} = [ ... ]")
        return [_convert(item, typing.get_args(hint)[0], f"{where}[{i}]", key, path) for i, item in enumerate(value)]
    if hint is Any:  # a custom model's own keys: the factory judges them
        return value
    expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[hint]
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"must be {expected}, got {value!r} ({type(value).__name__})", where=where,
                          fix=f"write it as {expected}")
    return value
