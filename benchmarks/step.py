"""Worker step throughput on one GPU: plain PyTorch (eager, torch.compile) against the archipelago engine.

    python3 benchmarks/step.py                                  # GPT-2 124M (B=32, T=1024) and 1.3B (B=8, T=2048)
    python3 benchmarks/step.py --models gpt2-124m --steps 20 --json step.json

Every configuration trains the same architecture (pre-norm GPT, tied embeddings, vocab 50304) in bf16
autocast with fused AdamW on random tokens; the baselines are written here in plain PyTorch, the
engine is workers.engine.Engine with its defaults (chunked loss) and torch.compile. Each prints
tokens/s, MFU against the dense bf16 peak and peak memory; the engine's ratios are against both.
Needs a CUDA GPU and no Ray.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.config import JobConfig  # noqa: E402
from orchestrator.placement.plan import Plan  # noqa: E402
from workers.engine import Engine  # noqa: E402

PEAK_BF16 = 989e12
MODELS = {  # vocab, seq_len, width, layers, heads, micro-batch
    "gpt2-124m": (50304, 1024, 768, 12, 12, 32),
    "gpt-1.3b": (50304, 2048, 2048, 24, 16, 8),
}


class PlainBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """The baseline: what a user writes in plain PyTorch (full fp32 logits for the loss)."""

    def __init__(self, vocab: int, seq_len: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(PlainBlock(d, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.lnf(x)).float().view(-1, self.head.out_features), targets.reshape(-1))


def flops_per_token(params: int, layers: int, width: int, seq_len: int) -> int:
    return 6 * params + 12 * layers * width * seq_len


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
    vocab, seq_len, d, layers, heads, B = MODELS[name]
    torch.manual_seed(0)
    model = PlainGPT(vocab, seq_len, d, layers, heads).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model

    def step(tokens):
        with torch.autocast("cuda", torch.bfloat16):
            loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, warm = time_steps(step, batch, warmup, steps)
    params = sum(p.numel() for p in model.parameters())
    return result(f"plain {'compile' if compiled else 'eager'}", name, params, seconds, warm, B * seq_len,
                  flops_per_token(params, layers, d, seq_len))


def engine(name: str, batch: torch.Tensor, warmup: int, steps: int) -> dict:
    vocab, seq_len, d, layers, heads, B = MODELS[name]
    config = JobConfig.from_dict({
        "model": {"n_layer": layers, "n_head": heads, "n_embd": d, "seq_len": seq_len, "vocab_size": vocab},
        "train": {"global_batch_size": B, "micro_batch_size": B, "precision": "bf16", "lr": 1e-4, "min_lr": 1e-5},
        "compile": {"enable": True}, "cluster": {"num_workers": 1, "use_gpu": True}})
    plan = Plan.uniform(job_name=name, world_size=1, micro_batch_size=B, grad_accum_steps=1, seq_len=seq_len)
    eng = Engine(config, plan, 0, torch.device("cuda", 0))
    seconds, warm = time_steps(lambda tokens: eng([tokens], 1e-4), batch, warmup, steps)
    stats = eng.window_metrics().get("compile", {})
    row = result("archipelago engine", name, eng.model.num_params(), seconds, warm, B * seq_len,
                 eng.model.flops_per_token())
    row.update(graph_breaks=stats.get("graph_breaks"), recompilations=stats.get("recompilations"))
    return row


def result(what: str, name: str, params: int, seconds: float, warm: float, tokens: int, flops: int) -> dict:
    tok_s = tokens / seconds
    return {"config": what, "model": name, "params_M": round(params / 1e6, 1), "step_ms": round(seconds * 1e3, 2),
            "tokens_per_s": round(tok_s), "mfu": round(tok_s * flops / PEAK_BF16, 4), "warmup_s": round(warm, 1),
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
            torch._dynamo.reset()
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
