"""Job configuration: one small typed dataclass per component, loaded from TOML.

    config = JobConfig.from_toml("examples/cpu-tiny.toml")

Every field has a default that runs. Unknown keys, wrong types and impossible values raise
`ConfigError` naming the file, the section and key, and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from orchestrator.errors import ConfigError


def _check(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(problem, where=key, fix=fix)


def _positive(section: str, **values: int | float) -> None:
    for name, value in values.items():
        _check(value > 0, f"[{section}] {name}", f"must be positive, got {value}", f"set {name} to a number above 0")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    seq_len: int = 128
    """Tokens per training sample (the model's context length)."""
    vocab_size: int = 257
    """Embedding rows; at least the dataset tokenizer's vocabulary (257 for bytes + end-of-document).
    Rounding up to a multiple of 64 is faster on GPUs."""
    dropout: float = 0.0
    """Dropout probability in attention and MLP outputs."""
    bias: bool = False
    """Bias terms in linear layers and layer norms."""

    def __post_init__(self) -> None:
        _positive("model", n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                  seq_len=self.seq_len, vocab_size=self.vocab_size)
        _check(self.n_embd % self.n_head == 0, "[model] n_head",
               f"n_embd = {self.n_embd} is not divisible by n_head = {self.n_head}",
               "pick n_head so that n_embd / n_head is a whole number (e.g. 64 per head)")
        _check(0.0 <= self.dropout < 1.0, "[model] dropout", f"must be in [0, 1), got {self.dropout}",
               "set dropout = 0.0 for pretraining")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = "data/stdlib-bytes"
    """Directory of a prepared token dataset (manifest.parquet + shards), relative to the working directory,
    or a pyarrow.fs URI ("s3://bucket/datasets/web?region=us-east-1") read with byte-range requests."""
    prepare_from: str = "stdlib"
    """When `path` holds no dataset yet, prepare it from this source first: "stdlib" (the .py files of
    the running Python's standard library), a directory of files, or "" to require a prepared one."""
    source_format: Literal["text", "jsonl", "parquet", "arrow"] = "text"
    """What `prepare_from` holds: text files (one document each), JSON Lines (one document per line),
    or a Parquet / Arrow IPC dataset (one document per row)."""
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
        _check(0.0 < self.val_percent < 100.0, "[data] val_percent", f"must be in (0, 100), got {self.val_percent}",
               "set val_percent = 5.0")
        _check(self.tokenizer == "bytes" or (self.tokenizer.startswith("hf:") and len(self.tokenizer) > 3),
               "[data] tokenizer", f"{self.tokenizer!r} is not a tokenizer",
               'use "bytes" or "hf:path/to/tokenizer.json"')
        _check(bool(self.text_column), "[data] text_column", "is empty", 'name the text field, e.g. "text"')
        _check(self.prepare_workers >= 0, "[data] prepare_workers", f"must be 0 or more, got {self.prepare_workers}",
               "set prepare_workers = 0 to use every core")
        _positive("data", shard_tokens=self.shard_tokens, reader_threads=self.reader_threads,
                  prefetch_steps=self.prefetch_steps)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps to train for (the total, counting steps done before a resume)."""
    global_batch_size: int = 32
    """Samples per optimizer step across all workers; stays fixed when workers come and go."""
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
    chunked_loss: bool = True
    """Compute the loss in chunks so the full (tokens × vocab) fp32 logits never exist."""

    def __post_init__(self) -> None:
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


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    enable: bool = False
    """Compile the model with torch.compile (needs a C++ compiler on CPU)."""
    mode: Literal["default", "max-autotune", "reduce-overhead"] = "default"
    """torch.compile mode."""
    fullgraph: bool = True
    """Demand one graph where the wrapping allows it (one worker, or FSDP2's per-block compile);
    DDP's optimizer splits the graph at bucket boundaries by design."""
    ddp_mode: Literal["ddp_optimizer", "compiled_autograd"] = "ddp_optimizer"
    """How compile meets DDP: Dynamo's DDPOptimizer (graph split per bucket, comm hooks work) or
    compiled autograd (one backward graph, comm captured in it; no comm hooks)."""


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp replicates the model on every worker; fsdp (FSDP2, one shard group per block) shards
    parameters, gradients and optimizer state for models that do not fit one device."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto is nccl on GPUs, gloo on CPUs."""
    activation_checkpointing: Literal["off", "selective", "full"] = "off"
    """Recompute block activations in backward to fit larger micro-batches."""
    comm_hook: Literal["allreduce", "bf16", "powersgd", "topk", "hierarchical"] = "allreduce"
    """How DDP averages gradients (see workers/comm/hooks.py); hierarchical follows NVLink islands."""
    bucket_mb: float = 25.0
    """DDP gradient bucket size when the plan does not choose one."""
    comm_warmup_steps: int = 10
    """Plain all-reduce steps before powersgd or topk start compressing."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank approximation."""
    topk_ratio: float = 0.01
    """Share of gradient entries the topk hook sends each step (the rest waits in the residual)."""

    def __post_init__(self) -> None:
        _positive("parallel", bucket_mb=self.bucket_mb, powersgd_rank=self.powersgd_rank)
        _check(0.0 < self.topk_ratio <= 0.5, "[parallel] topk_ratio", f"must be in (0, 0.5], got {self.topk_ratio}",
               "set topk_ratio = 0.01 (send 1% of entries per step)")
        _check(self.comm_warmup_steps >= 0, "[parallel] comm_warmup_steps",
               f"must be 0 or more, got {self.comm_warmup_steps}", "set comm_warmup_steps = 10")
        _check(self.strategy == "ddp" or self.comm_hook == "allreduce", "[parallel] comm_hook",
               f"{self.comm_hook!r} is a DDP comm hook; FSDP reduce-scatters its own gradients",
               'use strategy = "ddp" with this hook, or comm_hook = "allreduce" with fsdp')


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
    """How a restore reads checkpoint files: auto reads straight into GPU memory with kvikio where it can."""

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

    def __post_init__(self) -> None:
        _positive("cluster", num_workers=self.num_workers, cpus_per_worker=self.cpus_per_worker)


@dataclass(kw_only=True, slots=True)
class PlacementConfig:
    objective: Literal["fastest", "cheapest", "cheapest_under_deadline"] = "fastest"
    """What the planner optimises: the shortest step, the fewest dollars per million tokens, or the
    fewest dollars per million tokens among plans that finish `[train] steps` within deadline_hours."""
    deadline_hours: float = 0.0
    """Wall-clock limit for the whole job; needed by cheapest_under_deadline, ignored otherwise."""
    min_gpus: int = 1
    """Fewest GPUs (or MIG slices) the plan may use."""
    max_gpus: int = 0
    """Most GPUs (or MIG slices) the plan may use; 0 means every one in the cluster. The planner
    uses fewer when more would be slower (fastest) or cost more per token (cheapest)."""
    tensor_parallel_size: int = 1
    """GPUs that split each layer between them; each group stays inside one NVLink island of whole
    GPUs (never MIG slices). 1 means data parallelism only."""
    use_mig: bool = True
    """Let the planner place workers on MIG slices."""
    pricing: Literal["on_demand", "spot"] = "on_demand"
    """Which price column the dollars are computed from."""
    prices: dict[str, float] = field(default_factory=dict)
    """Dollars per device-hour in the chosen pricing column, by GPU model as the topology names it
    (e.g. "H100-SXM5-80GB" = 2.10), or per core-hour for "cpu"; overrides orchestrator/cost.py's table.
    A MIG slice costs its parent's price times its share of the SMs."""

    def __post_init__(self) -> None:
        _positive("placement", min_gpus=self.min_gpus, tensor_parallel_size=self.tensor_parallel_size)
        _check(self.max_gpus == 0 or self.max_gpus >= self.min_gpus, "[placement] max_gpus",
               f"{self.max_gpus} is below min_gpus = {self.min_gpus}", "raise max_gpus, or set it to 0 for no limit")
        _check(self.deadline_hours >= 0, "[placement] deadline_hours", f"must be 0 or more, got {self.deadline_hours}",
               "give the job's wall-clock limit in hours, e.g. deadline_hours = 12.0")
        _check(self.objective != "cheapest_under_deadline" or self.deadline_hours > 0, "[placement] deadline_hours",
               "cheapest_under_deadline needs a deadline", "set deadline_hours, e.g. deadline_hours = 12.0")
        for model, price in self.prices.items():
            _check(price >= 0, f"[placement] prices.{model}", f"must be 0 or more, got {price}",
                   "give dollars per device-hour, e.g. 2.10")


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """How the job rides out workers coming and going (see orchestrator/elastic.py)."""


@dataclass(kw_only=True, slots=True)
class BillConfig:
    """Cost and convergence accounting: targets, alerts and exports (see orchestrator/report.py)."""


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

    def __post_init__(self) -> None:
        _check(self.train.precision != "fp8" or self.compile.enable, "[train] precision",
               "float8 requires compile (eager float8 is slower than bf16)", "set [compile] enable = true")
        _check(not (self.compile.enable and self.compile.ddp_mode == "compiled_autograd"
                    and self.parallel.comm_hook != "allreduce"), "[compile] ddp_mode",
               "compiled autograd captures DDP's all-reduce itself, so comm hooks cannot run",
               'use ddp_mode = "ddp_optimizer" with a comm hook, or comm_hook = "allreduce"')
        _check(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "name",
               f"{self.name!r} is not a usable run name", 'use letters, digits, "-" and "_", e.g. name = "cpu-tiny"')
        # CPU workers are num_workers identical slots; GPU jobs get their worker count and
        # micro-batches from the planner, which refuses a global batch it cannot split.
        per_pass = self.train.micro_batch_size * self.cluster.num_workers
        _check(self.cluster.use_gpu or self.train.global_batch_size % per_pass == 0, "[train] global_batch_size",
               f"{self.train.global_batch_size} is not a multiple of micro_batch_size × num_workers = "
               f"{self.train.micro_batch_size} × {self.cluster.num_workers} = {per_pass}",
               f"set global_batch_size to a multiple of {per_pass} (e.g. {per_pass * max(1, round(self.train.global_batch_size / per_pass))})")

    @property
    def grad_accum_steps(self) -> int:
        """Accumulation on num_workers identical CPU workers (for GPU jobs the plan decides)."""
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
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(e.what, where=f"{path}: {e.where}" if e.where else str(path), fix=e.fix) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        return _build(cls, data, section="")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"[{section}] {key}" if section else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError("unknown key", where=where, fix=fix)
        kwargs[key] = _convert(value, hints[key], where, key)
    return cls(**kwargs)


def _convert(value: Any, hint: Any, where: str, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"must be a table, got {type(value).__name__}", where=key, fix=f"write it as a [{key}] section")
        return _build(hint, value, section=key)
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{value!r} is not one of {', '.join(map(repr, choices))}", where=where,
                              fix=f"set it to one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert(value, next(a for a in typing.get_args(hint) if a is not type(None)), where, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"must be a table, got {value!r}", where=where, fix=f"write it as {key} = {{ name = value }}")
        return {name: _convert(item, typing.get_args(hint)[1], f"{where}.{name}", key) for name, item in value.items()}
    expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[hint]
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"must be {expected}, got {value!r} ({type(value).__name__})", where=where,
                          fix=f"write it as {expected}")
    return value
