"""Worker step throughput on one GPU: plain PyTorch (eager, torch.compile) against the archipelago engine.

    python3 benchmarks/step.py                                  # GPT-2 124M (B=32, T=1024) and 1.3B (B=8, T=2048)
    python3 benchmarks/step.py --models gpt2-124m --steps 20 --json step.json

Every configuration trains the same model (workers.models.gpt.GPT: pre-norm, tied embeddings, vocab
50304) in bf16 autocast with fused AdamW on random tokens. The baselines drive it from a plain PyTorch
loop (eager, then torch.compile) with the plain full-logits loss; the engine is workers.engine.Engine
with its defaults (chunked loss) and torch.compile. Each prints tokens/s, MFU against the GPU's dense
bf16 peak from the device catalog and peak memory; the engine's ratios are against both.
Needs a CUDA GPU and no Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.config import JobConfig, ModelConfig  # noqa: E402
from orchestrator.placement.plan import Plan  # noqa: E402
from orchestrator.topology import catalog  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.models.gpt import GPT  # noqa: E402

MODELS = {  # vocab, seq_len, width, layers, heads, micro-batch
    "gpt2-124m": (50304, 1024, 768, 12, 12, 32),
    "gpt-1.3b": (50304, 2048, 2048, 24, 16, 8),
}


def model_config(name: str) -> ModelConfig:
    vocab, seq_len, d, layers, heads, _ = MODELS[name]
    return ModelConfig(n_layer=layers, n_head=heads, n_embd=d, seq_len=seq_len, vocab_size=vocab)


def peak_bf16_flops() -> float:
    model = catalog.lookup(torch.cuda.get_device_name())
    if model is None:
        sys.exit(f"no bf16 peak in the device catalog for {torch.cuda.get_device_name()!r}: MFU cannot be computed")
    return model.peak_tflops["bf16"] * 1e12


def reset_compiler() -> None:
    """Forget compiled graphs and Dynamo's counters, so each configuration reports its own compile."""
    torch._dynamo.reset()
    dynamo_utils.clear_compilation_metrics()
    dynamo_utils.counters.clear()


def time_steps(step, batch, warmup: int, steps: int) -> tuple[float, float]:
    """(median seconds per step over `steps` after `warmup`, warmup seconds incl. compile)."""
    started = time.perf_counter()
    for _ in range(warmup):
        step(batch)
    torch.cuda.synchronize()
    warm = time.perf_counter() - started
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step(batch)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times), warm


def plain(name: str, compiled: bool, batch: torch.Tensor, warmup: int, steps: int) -> dict:
    """The baseline: the same GPT in a loop a user writes in plain PyTorch (full fp32 logits for the loss)."""
    torch.manual_seed(0)
    model = GPT(model_config(name)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model

    def step(tokens):
        with torch.autocast("cuda", torch.bfloat16):
            loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, warm = time_steps(step, batch, warmup, steps)
    return result(f"plain {'compile' if compiled else 'eager'}", name, model, seconds, warm, batch)


def engine(name: str, batch: torch.Tensor, warmup: int, steps: int) -> dict:
    B, seq_len = batch.shape[0], batch.shape[1] - 1
    config = JobConfig.from_dict({
        "model": dataclasses.asdict(model_config(name)),
        "train": {"global_batch_size": B, "micro_batch_size": B, "precision": "bf16", "lr": 1e-4, "min_lr": 1e-5},
        "compile": {"enable": True}, "cluster": {"use_gpu": True}})
    plan = Plan.uniform(job_name=name, world_size=1, micro_batch_size=B, grad_accum_steps=1, seq_len=seq_len)
    eng = Engine(config, plan, 0, torch.device("cuda", 0))
    seconds, warm = time_steps(lambda tokens: eng([tokens], 1e-4), batch, warmup, steps)
    stats = eng.window_metrics().get("compile", {})
    row = result("archipelago engine", name, eng.model, seconds, warm, batch)
    row.update(graph_breaks=stats.get("graph_breaks"), recompilations=stats.get("recompilations"))
    return row


def result(what: str, name: str, model: GPT, seconds: float, warm: float, batch: torch.Tensor) -> dict:
    tok_s = batch[:, 1:].numel() / seconds
    return {"config": what, "model": name, "params_M": round(model.num_params() / 1e6, 1),
            "step_ms": round(seconds * 1e3, 2), "tokens_per_s": round(tok_s),
            "mfu": round(tok_s * model.flops_per_token() / peak_bf16_flops(), 4), "warmup_s": round(warm, 1),
            "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for name in args.models:
        vocab, seq_len, *_, B = MODELS[name]
        batch = torch.randint(0, vocab, (B, seq_len + 1), device="cuda")
        group = []
        for run in (lambda: plain(name, False, batch, args.warmup, args.steps),
                    lambda: plain(name, True, batch, args.warmup, args.steps),
                    lambda: engine(name, batch, args.warmup, args.steps)):
            try:
                row = run()
            except Exception as e:  # one failing configuration must not hide the others' numbers
                row = {"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                       "tokens_per_s": float("nan"), "mfu": float("nan")}
            group.append(row)
            print(json.dumps(row), flush=True)
            reset_compiler()
            torch.cuda.empty_cache()
        eager, compiled, ours = group
        print(f"{name}: engine / plain eager = {ours['tokens_per_s'] / eager['tokens_per_s']:.2f}x, "
              f"engine / plain compile = {ours['tokens_per_s'] / compiled['tokens_per_s']:.2f}x, "
              f"MFU {ours['mfu']:.1%} (plain compile {compiled['mfu']:.1%})", flush=True)
        rows += group
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
