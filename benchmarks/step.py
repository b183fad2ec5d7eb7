"""Worker step throughput on one GPU: plain PyTorch (eager, torch.compile) against the archipelago engine.

    python3 benchmarks/step.py                                  # GPT-2 124M (B=32, T=1024) and 1.3B (B=8, T=2048)
    python3 benchmarks/step.py --models llama3-1b llama3-3b --skip-eager --variants "bf16 weights" fp8
                                                                # Llama-3.2-1B (B=4) and 3B (B=2) shapes, T=2048,
                                                                # with torchtitan's Llama where it imports
    python3 benchmarks/step.py --models gpt2-124m --steps 20 --json step.json
    python3 benchmarks/step.py --models gpt-1.3b --curve-steps 200      # engine bf16 and fp8, loss curves compared
    python3 benchmarks/step.py --models gpt-1.3b --curve-steps 200 --skip-plain --variants fp8 "seed 1"
    python3 benchmarks/step.py --variants "chunked loss" "cudnn attention+plain loss" --profile --json step.json
    python3 benchmarks/step.py --models gpt2-124m --ddp-modes           # compile + DDP on a 1-rank NCCL group
    python3 benchmarks/step.py --models hf hf-builtin --hf-dir models/Llama-3.2-1B --skip-eager --variants "bf16 weights"
                                                                # kind = "hf" against the built-in Llama from it

Every configuration of a model trains the same model (the built-in GPT, pre-norm with tied embeddings
and vocab 50304, or the built-in Llama at a preset's shape) in bf16 autocast with fused AdamW on the
same real text: the bytes of the Python standard library's source files as token ids, a fresh window
every step. The baselines drive the model from a plain PyTorch loop (eager, then torch.compile) with
the plain full-logits loss; for a Llama, torchtitan's own Llama-3 model too (its per-block compile,
its loss, tied like ours where the preset ties) when the torchtitan package imports; the engine is
workers.engine.Engine with its defaults and torch.compile; "engine fp8" adds precision = "fp8"
(torchao, where installed; the default for the 1.3B model). A variant ("+"-joined names from VARIANTS)
is the engine with those settings changed. Each row prints tokens/s, MFU against the GPU's dense bf16
peak from the device catalog and peak memory, and the engine's ratios against both baselines.

Step time: every step's start is marked with a CUDA event and the host runs ahead as in training (no
wait between steps); the median of the per-step intervals after the warm-up steps is reported, with
the median SM clock and board power over those steps (NVML) and the share of samples in which the
power cap or heat held the clocks down.
--profile adds a torch.profiler summary per row: device time per step by kernel group (matmul,
attention, loss, rotary embedding, elementwise/fused, optimizer, float8 scaling, memcpy/memset), idle
time on the device, host time per step, the top kernels overall and in each group, the largest idle
gaps, and the matmul and attention rates that imply.
Needs a CUDA GPU and no Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import JobConfig, ModelConfig  # noqa: E402
from core.schedule import LrSchedule  # noqa: E402
from planning.model_size import ModelFacts, model_facts  # noqa: E402
from planning.resolve import uniform_spec  # noqa: E402
from topology import catalog  # noqa: E402
from topology.nvml import Nvml  # noqa: E402
from kernels.loss import ignore_masked  # noqa: E402
from workers.comm.stats import CommStats  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.models import make_workload  # noqa: E402

MODELS = {  # name: ([model] table, micro-batch)
    "gpt2-124m": ({"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304}, 32),
    "gpt-1.3b": ({"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "vocab_size": 50304}, 8),
    "llama3-1b": ({"preset": "llama3-1b", "seq_len": 2048}, 4),
    "llama3-3b": ({"preset": "llama3-3b", "seq_len": 2048}, 2),
}
DEFAULT_MODELS = ("gpt2-124m", "gpt-1.3b")
HF_MODELS = {"hf": "hf", "hf-builtin": "llama"}
"""With --hf-dir (a Hugging Face Llama or Mistral directory): name -> [model] kind; "hf" trains transformers'
model, "hf-builtin" the built-in Llama shaped (and started) from the same directory: which is faster."""

LR = 3e-4
VARIANTS = {  # name: (JobConfig sections to override, SDPA backends in priority order or None)
    "chunked loss": ({"train": {"loss_kernel": "chunked"}}, None),
    "plain loss": ({"train": {"loss_kernel": "plain"}}, None),
    "cudnn attention": ({}, "cudnn"),
    "flash attention": ({}, "flash"),
    "reduce-overhead": ({"compile": {"mode": "reduce-overhead"}}, None),
    "max-autotune": ({"compile": {"mode": "max-autotune"}}, None),
    "max-autotune-no-cudagraphs": ({"compile": {"mode": "max-autotune-no-cudagraphs"}}, None),
    "constant lr": ({"train": {"warmup_steps": 0, "min_lr": LR}}, None),  # the plain loop's schedule
    "seed 1": ({"train": {"seed": 1}}, None),  # other initial weights: how far bf16 runs drift apart alone
    "no clip": ({"train": {"grad_clip": 0.0}}, None),
    "bf16 weights": ({"train": {"bf16_weights": True}}, None),  # a bf16 compute copy, fp32 masters
    # torch's fused AdamW, which writes the clipped gradients back; with bf16 weights, from fp32 gradients, then a pull
    "unfused step": ({}, None),
    "qat int8": ({"train": {"qat": "int8-weight"}}, None),  # fake-quantized int8 weights (torchao)
    "qat int4": ({"train": {"qat": "int8-dynamic-act-int4-weight"}}, None),
    "fp8": ({"train": {"precision": "fp8"}}, None),
    "fp8 rowwise": ({"train": {"precision": "fp8", "float8_recipe": "rowwise"}}, None),
}

DEVICE = "cuda"  # a CPU smoke run of this file (fake CUDA events) sets "cpu"


def model_config(name: str) -> ModelConfig:
    return JobConfig.from_dict({"model": MODELS[name][0]}).model


def facts(name: str) -> ModelFacts:
    """Parameters and FLOPs per token, counted as the planner and the bill count them."""
    cfg = model_config(name)
    return model_facts(make_workload(cfg), cfg.seq_len)


def peak_bf16_flops() -> float:
    model = catalog.lookup(torch.cuda.get_device_name())
    if model is None:
        sys.exit(f"no bf16 peak in the device catalog for {torch.cuda.get_device_name()!r}: MFU cannot be computed")
    return model.peak_tflops["bf16"] * 1e12


class TextBatches:
    """Windows of real text as token ids: the standard library's .py files, read in a fixed order."""

    def __init__(self, batch: int, seq_len: int, steps: int):
        need = batch * (seq_len + 1) * steps
        chunks, have = [], 0
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            chunks.append(path.read_bytes())
            have += len(chunks[-1])
            if have >= need:
                break
        data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        if data.numel() < need:
            data = data.repeat(-(-need // data.numel()))
        self.tokens = data[:need].to(DEVICE, torch.int64).view(steps, batch, seq_len + 1)

    def __getitem__(self, step: int) -> torch.Tensor:
        return self.tokens[step % self.tokens.shape[0]]


def reset_compiler() -> None:
    """Forget compiled graphs and Dynamo's counters, so each configuration reports its own compile."""
    torch._dynamo.reset()
    dynamo_utils.clear_compilation_metrics()
    dynamo_utils.counters.clear()


class ClockSampler:
    """The GPU's SM clock, board power and what held its clocks down, sampled every 20 ms while a row's
    timed steps run: the same kernels take longer in a row whose GPU ran at lower clocks."""

    def __init__(self, interval_s: float = 0.02):
        self.nvml = Nvml.open()[0] if DEVICE == "cuda" else None
        self.interval_s = interval_s
        self.samples: list[tuple[int, float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        handle = self.nvml.handle(torch.cuda.current_device())  # NVML counts every GPU; fine where all are visible
        while not self._stop.wait(self.interval_s):
            self.samples.append((self.nvml.sm_clock_mhz(handle), self.nvml.power_watts(handle),
                                 self.nvml.clock_limits(handle)))

    def __enter__(self) -> ClockSampler:
        if self.nvml is not None:
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        if self.nvml is not None:
            self._stop.set()
            self._thread.join()
            self.nvml.close()  # NVML counts its opens: one close for each row's open

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, watts, limits = zip(*self.samples)
        share = lambda reason: round(sum(reason in held for held in limits) / len(limits), 2)  # noqa: E731
        return {"sm_mhz": statistics.median(clocks), "power_w": round(statistics.median(watts)),
                "power_capped": share("power cap"), "thermal": share("thermal")}


def time_steps(step, data: TextBatches, warmup: int, steps: int) -> dict:
    """Per-step device intervals after `warmup` steps (which include compilation), host running ahead."""
    started = time.perf_counter()
    for i in range(warmup):
        step(data[i], i)
    torch.cuda.synchronize()
    warm = time.perf_counter() - started
    torch.cuda.reset_peak_memory_stats()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    losses, host = [], []
    with ClockSampler() as clocks:
        for i in range(steps):
            marks[i].record()
            begin = time.perf_counter()
            losses.append(step(data[warmup + i], warmup + i))
            host.append(time.perf_counter() - begin)
        marks[-1].record()
        torch.cuda.synchronize()
    intervals = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    return {"seconds": statistics.median(intervals), "warm": warm, "host_seconds": statistics.median(host),
            "losses": [float(x) for x in losses if x is not None], "clocks": clocks.summary()}


def user_step(loss_of, optimizer: torch.optim.Optimizer):
    """The step a user writes in plain PyTorch: the loss of a batch under bf16 autocast, backward, the
    optimizer, the gradients freed."""
    def step(tokens, _):
        with torch.autocast(DEVICE, torch.bfloat16):
            loss = loss_of(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def plain(name: str, compiled: bool, data: TextBatches, args, repeat: bool = False) -> tuple[dict, object]:
    """The baseline: the same model in a loop a user writes in plain PyTorch (full fp32 logits for the loss)."""
    torch.manual_seed(0)
    model = make_workload(model_config(name)).build().to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=DEVICE == "cuda")
    forward = torch.compile(model) if compiled else model

    step = user_step(lambda tokens: forward(tokens[:, :-1], tokens[:, 1:]), optimizer)

    timing = time_steps(step, data, args.warmup, args.steps)
    label = f"plain {'compile' if compiled else 'eager'}{' (repeat)' if repeat else ''}"
    return result(label, name, timing, data), step


def torchtitan(name: str, data: TextBatches, args) -> tuple[dict, object]:
    """torchtitan's Llama-3 (its model, init, per-block compile and loss) at the preset's shape, in the
    loop its trainer runs on one GPU: bf16 autocast, fused AdamW. Its head is tied to the embedding
    where the preset ties it (torchtitan 0.2 has no switch for that)."""
    without_its_data_stack()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    cfg = model_config(name)
    hidden = int(2 * 4 * cfg.n_embd / 3)
    model_args = TransformerModelArgs(
        dim=cfg.n_embd, n_layers=cfg.n_layer, n_heads=cfg.n_head, n_kv_heads=cfg.kv_heads, vocab_size=cfg.vocab_size,
        multiple_of=256, ffn_dim_multiplier=cfg.hidden_dim / hidden, norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=cfg.rope_scaling or 1.0), max_seq_len=cfg.seq_len)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Transformer(model_args)
    with torch.no_grad():  # as torchtitan's trainer calls it
        model.init_weights()
    if cfg.tie_embeddings:  # with its N(0, 1) embedding rows a tied head's logits start at std ~sqrt(width)
        torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
        model.output.weight = model.tok_embeddings.weight
    apply_compile(model, Compile(enable=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    tokens_per_step = data.tokens.shape[1] * (data.tokens.shape[2] - 1)

    step = user_step(lambda tokens: cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / tokens_per_step,
                     optimizer)

    timing = time_steps(step, data, args.warmup, args.steps)
    import torchtitan as package
    row = result(f"torchtitan {getattr(package, '__version__', '')}".strip(), name, timing, data)
    row["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    return row, step


def liger(name: str, data: TextBatches, args, everything: bool) -> tuple[dict, object]:
    """The plain compiled loop on the built-in Llama with liger-kernel's fused linear cross-entropy (run
    eagerly) in place of the full-logits loss; `everything` adds its RMSNorm and SwiGLU kernels. What a user would
    reach for to speed up the plain loop; the engine's own fused loss is the alternative."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    from workers.models.llama import FeedForward

    torch.manual_seed(0)
    model = make_workload(model_config(name)).build().to(DEVICE)
    fused_loss = LigerFusedLinearCrossEntropyLoss()

    # liger's fused loss reads a count with .item() and its addmm fails under fake tensors (torch 2.11, liger
    # 0.8.5, on the H200 2026-12-05), so it runs eagerly, as liger's own model patches run it, after the
    # compiled blocks.
    @torch.compiler.disable
    def head(x, targets, loss_kernel, loss_mask=None):  # liger's loss ignores kernels.loss.IGNORE_INDEX too
        x = model.norm(x)
        return fused_loss(model.output_weight(), x.reshape(-1, x.size(-1)), ignore_masked(targets, loss_mask).reshape(-1))

    model.head = head
    if everything:
        for norm in [model.norm, *(n for layer in model.layers for n in (layer.attention_norm, layer.ffn_norm))]:
            norm.forward = lambda x, norm=norm: LigerRMSNormFunction.apply(x, norm.weight, norm.eps)
        for ff in (m for m in model.modules() if isinstance(m, FeedForward)):
            ff.forward = lambda x, ff=ff: ff.w2(LigerSiLUMulFunction.apply(  # w13 interleaves gate and up rows
                *(half.contiguous() for half in ff.w13(x).unflatten(-1, (-1, 2)).unbind(dim=-1))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    forward = torch.compile(model)

    step = user_step(lambda tokens: forward(tokens[:, :-1], tokens[:, 1:]), optimizer)

    timing = time_steps(step, data, args.warmup, args.steps)
    label = "plain compile + liger loss" + (", norm, swiglu" if everything else "")
    return result(label, name, timing, data), step


def engine_config(name: str, B: int, overrides: dict, steps: int) -> JobConfig:
    sections = {"model": dataclasses.asdict(model_config(name)),
                "train": {"global_batch_size": B, "micro_batch_size": B, "precision": "bf16", "lr": LR,
                          "min_lr": LR / 10, "warmup_steps": 20, "steps": steps},
                "compile": {"enable": True}, "cluster": {"use_gpu": True}}
    for section, values in overrides.items():
        sections[section] = {**sections.get(section, {}), **values}
    return JobConfig.from_dict(sections)


def variant_settings(label: str) -> tuple[dict, str | None]:
    overrides, backend = {}, None
    for part in label.split("+"):
        part_overrides, part_backend = VARIANTS[part]
        for section, values in part_overrides.items():
            overrides[section] = {**overrides.get(section, {}), **values}
        backend = part_backend or backend
    return overrides, backend


def attention_backends(backend: str | None):
    """Puts an SDPA backend first for everything traced inside (compiled graphs keep the choice)."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    order = [first] + [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    return sdpa_kernel(order, set_priority=True)


def engine(name: str, label: str, data: TextBatches, args, steps: int) -> tuple[dict, object]:
    """The engine row; if it fails to compile as one graph, once more with fullgraph off (said in the row)."""
    try:
        return _engine(name, label, data, args, steps, {})
    except Exception as e:
        print(f"{name} engine {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}; again with fullgraph off",
              flush=True)
        reset_compiler()
        row, step = _engine(name, label, data, args, steps, {"compile": {"fullgraph": False}})
        row["fullgraph"] = False
        return row, step


def _engine(name: str, label: str, data: TextBatches, args, steps: int, extra: dict) -> tuple[dict, object]:
    B = data.tokens.shape[1]
    overrides, backend = variant_settings(label) if label else ({}, None)
    for section, values in extra.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    config = engine_config(name, B, overrides, args.warmup + steps)
    spec = uniform_spec(config, world_size=1, micro_batch_size=B, grad_accum_steps=1, use_gpu=DEVICE == "cuda")
    eng = Engine(spec, 0, torch.device(DEVICE, 0))
    if "unfused step" in label.split("+"):  # the paths before kernels.adamw, for comparison
        eng.fused_bf16_step = False
        eng.adamw_from_fp32 = None

    schedule = LrSchedule.for_train(config.train)

    def step(tokens, i):
        return eng([tokens], schedule.lr_at(i))[0]

    with attention_backends(backend):
        timing = time_steps(step, data, args.warmup, steps)
    stats = eng.window_metrics().get("compile", {})
    row = result(f"engine {label}".strip(), name, timing, data)
    row.update(graph_breaks=stats.get("graph_breaks"), recompilations=stats.get("recompilations"),
               float8_layers=eng.float8_layers or None, compile_check=eng.compile_check)
    return row, lambda tokens, i: _with(attention_backends(backend), step, tokens, i)


def _with(context, fn, *args):
    with context:
        return fn(*args)


def ddp_engine(name: str, mode: str, data: TextBatches, args) -> tuple[dict, object]:
    """The engine's DDP wrapping on a 1-rank NCCL group (one GPU): what each compile mode costs alone."""
    from workers.parallel import _wrap_ddp
    B = data.tokens.shape[1]
    config = engine_config(name, B, {"compile": {"ddp_mode": mode}}, args.warmup + args.steps)
    spec = uniform_spec(config, world_size=1, micro_batch_size=B, grad_accum_steps=1, use_gpu=DEVICE == "cuda")
    torch.manual_seed(0)
    model = make_workload(config.model).build().to(DEVICE)
    wrapped = _wrap_ddp(model, spec, torch.device(DEVICE, 0), 1, CommStats())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=DEVICE == "cuda")

    def step(tokens, _):
        with torch.autocast(DEVICE, torch.bfloat16):
            loss = wrapped.forward(tokens[:, :-1], tokens[:, 1:], loss_kernel=config.train.loss_kernel)
        with wrapped.backward_context():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    timing = time_steps(step, data, args.warmup, args.steps)
    row = result(f"ddp(1 rank) {mode}", name, timing, data)
    breaks = dynamo_utils.counters["graph_break"]
    row.update(graph_breaks=sum(breaks.values()),
               compiled_autograd_compiles=dynamo_utils.counters["compiled_autograd"].get("compiles", 0))
    return row, step


def result(what: str, name: str, timing: dict, data: TextBatches) -> dict:
    """A row: MFU from the FLOPs per token the planner and the bill count (planning/model_size.py)."""
    tokens = data.tokens.shape[1] * (data.tokens.shape[2] - 1)
    tok_s = tokens / timing["seconds"]
    counted = facts(name)
    return {"config": what, "model": name, "params_M": round(counted.parameters / 1e6, 1),
            "step_ms": round(timing["seconds"] * 1e3, 2), "host_ms": round(timing["host_seconds"] * 1e3, 2),
            "tokens_per_s": round(tok_s), "mfu": round(tok_s * counted.flops_per_token / peak_bf16_flops(), 4),
            "warmup_s": round(timing["warm"], 1), "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            **timing.get("clocks", {}), **loss_summary(timing["losses"]),
            "losses": [round(x, 4) for x in timing["losses"]]}


def loss_summary(losses: list[float]) -> dict:
    """The first loss timed and the mean of the last five: a step time is only worth printing for a
    run that trains (a fused loss once diverged at 1.3B while its step time looked fine)."""
    if len(losses) < 6:
        return {}
    last = sum(losses[-5:]) / 5
    return {"loss_first": round(losses[0], 3), "loss_last5": round(last, 3), "loss_fell": last < losses[0]}


GROUPS = (  # first match wins; names as CUDA, cuBLAS, cuDNN, flash-attention and Inductor give them
    ("attention", ("flash", "fmha", "attention", "sdpa", "fort_native")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "sm90_", "sm80_", "ampere", "splitk", "triton_tem")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_amp_")),
    ("loss", ("softmax", "nll", "cross_entropy", "logsumexp")),
    ("rotary embedding", ("_cos_", "_sin_")),  # Inductor's names join the fused ops with "_"
    ("float8 scaling", ("amax", "float8", "fp8", "e4m3", "reciprocal")),
    ("memcpy/memset", ("memcpy", "memset")),
    ("elementwise/fused (Inductor)", ("triton_",)),
)


def kernel_group(name: str) -> str:
    lowered = name.lower() + "_"  # so a fused op's name ends in "_" even when it ends the kernel's
    for group, needles in GROUPS:
        if any(n in lowered for n in needles):
            return group
    return "elementwise/reduce (eager)"


def trace_events(prof) -> list[dict]:
    """A finished torch.profiler session's events as its chrome trace holds them."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def device_kernels(events: list[dict]) -> list[dict]:
    """The events the device ran (kernels, copies, memsets), each with its start "ts" and "dur" in us."""
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def profile_row(step, data: TextBatches, name: str, start: int, steps: int = 2) -> dict:
    """Device time per step by kernel group, idle time between kernels, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile
    step(data[start], start)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(data[start + 1 + i], start + 1 + i)
        torch.cuda.synchronize()
    events = trace_events(prof)
    kernels = device_kernels(events)
    if not kernels:
        return {"error": "the profiler recorded no device kernels"}
    kernels.sort(key=lambda e: e["ts"])
    busy, end, gaps, before = 0.0, kernels[0]["ts"], [], kernels[0]["name"]
    for e in kernels:  # the union of kernel intervals: overlapping streams count once
        lo, hi = max(e["ts"], end), e["ts"] + e["dur"]
        if e["ts"] > end:
            gaps.append((e["ts"] - end, before, e["name"]))
        if hi > lo:
            busy += hi - lo
        if hi >= end:
            before = e["name"]
        end = max(end, hi)
    span = end - kernels[0]["ts"]
    # Host calls that synchronise or copy: a synchronise (or a copy from pageable memory) drains the
    # launch queue, and the device then idles until the host has launched again.
    waits: dict[str, int] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in e.get("name", "") or "Memcpy" in e.get("name", "")):
            waits[e["name"]] = waits.get(e["name"], 0) + 1
    groups: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        groups[kernel_group(e["name"])] = groups.get(kernel_group(e["name"]), 0.0) + e["dur"]
        by_name.setdefault(e["name"], []).append(e["dur"])
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731  per step
    tokens = data.tokens.shape[1] * (data.tokens.shape[2] - 1)
    cfg = model_config(name)
    attention_flops = 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len * tokens  # PaLM's count (causal work is half)
    matmul_flops = facts(name).flops_per_token * tokens - attention_flops
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    summary = {
        "span_ms": ms(span), "busy_ms": ms(busy), "idle_ms": ms(span - busy),
        "groups_ms": {g: ms(t) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": round(len(kernels) / steps),
        "sync_or_copy_calls_per_step": {n: c / steps for n, c in waits.items()},
        "top": [{"name": n[:110], "group": kernel_group(n), "ms": ms(sum(d)), "calls": round(len(d) / steps)}
                for n, d in top],
        "top_by_group": top_by_group(by_name, ms, steps),
        # Where the device waits, over all profiled steps. The first step starts after a synchronise,
        # so its first gaps are the host catching up, which a run whose host is ahead never shows.
        "largest_gaps": [{"us": round(g, 1), "after": a[:90], "before": b[:90]}
                         for g, a, b in sorted(gaps, reverse=True)[:8]],
    }
    if groups.get("matmul"):
        summary["matmul_TFLOPs"] = round(matmul_flops / (groups["matmul"] / 1e6 / steps) / 1e12)
    if groups.get("attention"):
        summary["attention_TFLOPs_palm"] = round(attention_flops / (groups["attention"] / 1e6 / steps) / 1e12)
    return summary


def top_by_group(by_name: dict[str, list[float]], ms, steps: int, per_group: int = 5) -> dict[str, list[dict]]:
    """The kernels that take most of each group's time, so a group's total can be read as kernels."""
    groups: dict[str, list[tuple[str, list[float]]]] = {}
    for n, d in by_name.items():
        groups.setdefault(kernel_group(n), []).append((n, d))
    return {g: [{"name": n[:110], "ms": ms(sum(d)), "calls": round(len(d) / steps)}
                for n, d in sorted(members, key=lambda kv: -sum(kv[1]))[:per_group]]
            for g, members in groups.items()}


def print_profile(row: dict) -> None:
    p = row.get("profile")
    if not p or "error" in p:
        return
    groups = ", ".join(f"{g} {t:.1f}" for g, t in p["groups_ms"].items())
    print(f"  profile {row['model']} / {row['config']}: span {p['span_ms']:.1f} ms, busy {p['busy_ms']:.1f}, "
          f"idle {p['idle_ms']:.1f}, host {row['host_ms']:.1f} ms/step; {groups}; matmul "
          f"{p.get('matmul_TFLOPs')} TFLOP/s, attention {p.get('attention_TFLOPs_palm')} (PaLM count)", flush=True)
    for k in p["top"][:8]:
        print(f"    {k['ms']:8.3f} ms x{k['calls']:<4} {k['group']:<28} {k['name'][:90]}", flush=True)
    for group, members in p.get("top_by_group", {}).items():
        if group in ("matmul", "attention"):
            continue
        print(f"    {group}:", "; ".join(f"{k['ms']:.3f} ms x{k['calls']} {k['name'][:60]}" for k in members), flush=True)
    print(f"    host synchronise/copy calls a step: {p.get('sync_or_copy_calls_per_step')}", flush=True)
    for gap in p.get("largest_gaps", [])[:5]:
        print(f"    idle {gap['us']:.0f} us after {gap['after'][:60]} before {gap['before'][:60]}", flush=True)


FAR_ABOVE_BEST_LOSS = 1.5
"""A row whose last losses end this many times above the best row's on the same batches has not
trained as the others did. The rows' schedules differ (the plain loop has no warm-up): over 20
steps a sound row ends within ~1.25x of the best; a 1.3B engine row that diverged ended 3.3x above."""


def training_warning(row: dict, best_loss_last5: float | None) -> str:
    """Empty for a row that trains; otherwise why its step time is not worth printing alone."""
    if not row.get("loss_fell", True):
        return " | LOSS DID NOT FALL: this run does not train"
    last = row.get("loss_last5")
    if last is not None and best_loss_last5 and last > FAR_ABOVE_BEST_LOSS * best_loss_last5:
        return (f" | LOSS FAR ABOVE THE BEST ROW'S ({last:.3f} against {best_loss_last5:.3f} on the same batches): "
                "this run does not train as the others do")
    return ""


def compare_curves(rows: list[dict]) -> list[dict]:
    """Smoothed (10-step mean) loss of every other engine row that kept its losses (fp8; "seed 1",
    which says how far two bf16 runs differing only in their initial weights drift apart) against
    the bf16 engine's over the same steps."""
    bf16 = next((r for r in rows if r.get("config") == "engine" and r.get("losses")), None)
    if not bf16:
        return []
    out = []
    for other in rows:
        if other is bf16 or not other.get("losses") or not other.get("config", "").startswith("engine"):
            continue
        a, b = bf16["losses"], other["losses"]
        n = min(len(a), len(b)) // 10 * 10
        if n == 0:
            continue
        means = [(sum(a[i:i + 10]) / 10, sum(b[i:i + 10]) / 10) for i in range(0, n, 10)]
        diffs = [abs(y - x) / x for x, y in means]
        out.append({"model": bf16["model"], "config": f"{other['config']} vs engine loss curve", "steps": n,
                    "bf16_windows": [round(x, 4) for x, _ in means], "other_windows": [round(y, 4) for _, y in means],
                    "max_rel_diff": round(max(diffs), 4), "final_rel_diff": round(diffs[-1], 4),
                    "windows_within_2pct": sum(d <= 0.02 for d in diffs), "windows": len(diffs),
                    "tokens_per_s_over_bf16": round(other["tokens_per_s"] / bf16["tokens_per_s"], 3)})
    return out


def without_its_data_stack() -> None:
    """torchtitan's Llama package imports its training recipe's data loaders and metrics writer (the
    `datasets`, `torchdata` and `tensorboard` packages) beside the model. A step that times the model
    alone uses none of them, and the GPU machine has none: stand-ins whose every attribute is an inert
    class take their place where they are missing. torchtitan's model, init, compile and loss code
    run as shipped."""
    import importlib.util
    import types

    class Inert:
        def __init__(self, *args, **kwargs):
            pass

        def __class_getitem__(cls, item):
            return cls

    missing = [name for name in ("datasets", "torchdata") if name not in sys.modules and importlib.util.find_spec(name) is None]
    if "tensorboard" not in sys.modules and importlib.util.find_spec("tensorboard") is None:
        missing.append("torch.utils.tensorboard")  # torch's writer needs the tensorboard package
    for name in missing + [f"{name}.{sub}" for name, sub in (("datasets", "distributed"),
                                                             ("torchdata", "stateful_dataloader")) if name in missing]:
        module = types.ModuleType(name)
        module.__getattr__ = _inert_attribute(Inert)
        module.__path__ = []
        sys.modules[name] = module


def _inert_attribute(inert: type):
    def attribute(name: str):
        if name.startswith("__"):  # what introspection asks a module for is not there
            raise AttributeError(name)
        return inert
    return attribute


def torchtitan_available() -> bool:
    try:
        without_its_data_stack()
        import torchtitan.models.llama3.model.model  # noqa: F401
    except Exception as e:  # not installed, or a torchtitan built for another torch
        print(f"torchtitan row skipped: its Llama-3 does not import ({type(e).__name__}: {e})", flush=True)
        return False
    return True


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # ImportError, or a torchao built for another torch
        print(f"float8 rows skipped: torchao.float8 does not import ({type(e).__name__}: {e})", flush=True)
        return False
    return True


def run_model(name: str, args, out: list[dict]) -> None:
    B, seq_len = MODELS[name][1], model_config(name).seq_len
    engine_steps = max(args.steps, args.curve_steps)
    data = TextBatches(B, seq_len, args.warmup + engine_steps + 4)
    labels = args.variants if args.variants is not None else (["fp8"] if name == "gpt-1.3b" else [])
    if not torchao_available():
        labels = [v for v in labels if "fp8" not in v]
    runs = [] if args.skip_plain or args.skip_eager else [("plain eager", lambda: plain(name, False, data, args))]
    runs += [] if args.skip_plain else [("plain compile", lambda: plain(name, True, data, args))]
    if "preset" in MODELS[name][0] and not args.skip_plain and not args.skip_torchtitan and torchtitan_available():
        runs += [("torchtitan", lambda: torchtitan(name, data, args))]
    if model_config(name).kind == "llama" and args.liger:
        runs += [(f"liger {everything}", lambda everything=everything: liger(name, data, args, everything))
                 for everything in (False, True)]
    runs += [(f"engine {v}".strip(), lambda v=v: engine(name, v, data, args, engine_steps))
             for v in ([""] if not args.skip_engine else []) + labels]
    runs += [(f"ddp {m}", lambda m=m: ddp_engine(name, m, data, args))
             for m in (("ddp_optimizer", "compiled_autograd") if args.ddp_modes else ())]
    # Clocks drift as the GPU warms over a run: the baseline again at the end brackets the engine rows.
    runs += [] if args.skip_plain or args.no_repeat else [("plain compile (repeat)",
                                                             lambda: plain(name, True, data, args, repeat=True))]
    group = []
    for what, run in runs:
        try:
            row, step = run()
            if args.profile:
                row["profile"] = profile_row(step, data, name, args.warmup + engine_steps - 4)
        except Exception as e:  # one failing configuration must not hide the others' numbers
            row = {"model": name, "config": what, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}",
                   "tokens_per_s": float("nan"), "mfu": float("nan")}
        step = None
        group.append(row)
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "losses")}), flush=True)
        print_profile(row)
        reset_compiler()
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    by = {r["config"]: r for r in group if "error" not in r}
    best = min((r["loss_last5"] for r in by.values() if "loss_last5" in r), default=None)
    for label, ours in by.items():
        if not label.startswith("engine") and not label.startswith("ddp"):
            continue
        baselines = ["plain eager", "plain compile", "plain compile (repeat)",
                     *(label for label in by if label.startswith(("torchtitan", "plain compile + liger")))]
        ratios = ", ".join(f"/ {base} = {ours['tokens_per_s'] / by[base]['tokens_per_s']:.2f}x"
                           for base in baselines if base in by)
        print(f"{name}: {label}: {ours['tokens_per_s']:,} tok/s, MFU {ours['mfu']:.1%} {ratios}"
              f"{training_warning(ours, best)}", flush=True)
    for curve in compare_curves(group):
        out.append(curve)
        print(json.dumps(curve), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=[*MODELS, *HF_MODELS])
    parser.add_argument("--hf-dir", help="a Hugging Face Llama/Mistral directory (its config.json; weights optional) "
                                         "for the models hf and hf-builtin, B=4, T=2048")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--curve-steps", type=int, default=0,
                        help="run the engine rows this many steps and compare their loss curves (fp8 vs bf16)")
    parser.add_argument("--variants", nargs="*", default=None,
                        help=f"engine variants, '+'-joined from: {', '.join(VARIANTS)} (default: fp8 for 1.3B)")
    parser.add_argument("--skip-plain", action="store_true", help="no plain eager / plain compile rows")
    parser.add_argument("--skip-eager", action="store_true", help="no plain eager row")
    parser.add_argument("--skip-torchtitan", action="store_true", help="no torchtitan row for the Llama presets")
    parser.add_argument("--skip-engine", action="store_true", help="no default engine row")
    parser.add_argument("--ddp-modes", action="store_true", help="also DDP (1 rank, NCCL) with each compile mode")
    parser.add_argument("--profile", action="store_true", help="add a torch.profiler summary to every row")
    parser.add_argument("--liger", action="store_true", help="Llama models: also the plain loop with liger-kernel")
    parser.add_argument("--no-repeat", action="store_true", help="no second plain compile row after the engine's")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    if any(name in HF_MODELS for name in args.models) and not args.hf_dir:
        parser.error("the models hf and hf-builtin need --hf-dir")
    for name, kind in HF_MODELS.items():
        if args.hf_dir:
            MODELS[name] = ({"kind": kind, "hf_dir": args.hf_dir, "seq_len": 2048}, 4)
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    if args.ddp_modes and not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rows: list[dict] = []
    for name in args.models:
        run_model(name, args, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
