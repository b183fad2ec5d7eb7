"""The planner's memory estimate beside the peak a GPU measures, and what is alive at that peak.

    python3 benchmarks/memory.py                                   # GPT-2 124M and the Llama-3.2-1B shape
    python3 benchmarks/memory.py --models llama3-1b --bf16-weights --json memory.json
    python3 benchmarks/memory.py --cpu                              # no GPU: eager and compiled CPU steps

For each model, as tests/gpu/test_memory_gpu.py measures it: the worker engine's second step on GPU 0
(torch.cuda.max_memory_allocated), beside the estimate of planning/memory.py (fake tensors, computed on
the CPU) split as it counts it: parameters, gradients, optimizer state, the rest. The measured step runs
under the allocator's trace (torch.cuda.memory._record_memory_history, Python frames), and the
allocations alive at its peak are listed by where they were made: the innermost frame in this
project's code or in Inductor's generated code, largest first. What was allocated before the step
(weights, optimizer state) is one line; the traced peak adds it to the step's own, so it reads above
the measured peak by what the step frees of it before its peak. The largest rows against the estimate's parts say which part
the estimate gets wrong (benchmarks/RESULTS.md, the Llama-3 shapes' memory estimate).
Needs a CUDA GPU and no Ray.

With --cpu, small models on this CPU instead: the engine's step eager and compiled by Inductor, its
peak read from the CPU allocator's events under the profiler (as tests/unit/test_memory.py reads it),
beside the estimate's activations and temporaries (what the step adds to the weights and optimizer
state). Two sets: logits-heavy (a 50,304-token vocabulary over 2 narrow blocks), where the fused loss
decides the peak, and blocks-heavy (a 512-token vocabulary, 2 and 4 blocks), whose difference is what
one block keeps for backward. It says whether the compiled step holds what the eager fake step counts,
apart from the GPU's own kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from benchmarks import step  # noqa: E402
from core.config import JobConfig  # noqa: E402
from planning import memory  # noqa: E402
from planning.resolve import uniform_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = step.MODELS
"""name: ([model] table, micro-batch): benchmarks/step.py's rows, tests/gpu/test_memory_gpu.py's cases."""
INDUCTOR_CODE = "torchinductor"
"""A path part of Inductor's generated code: the compiled blocks and head."""


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """The highest total of bytes the trace's allocations held at once, and the allocations alive then.
    An allocation counts from its "alloc" to the first free of its address ("free_requested", or
    "free_completed" where no request was traced), as torch.cuda.max_memory_allocated counts it."""
    live, total, peak, peak_at = {}, 0, 0, -1
    for index, entry in enumerate(trace):
        action, address = entry.get("action"), entry.get("addr")
        if action == "alloc":
            live[address] = entry
            total += entry["size"]
            if total > peak:
                peak, peak_at = total, index
        elif action in ("free_requested", "free_completed") and address in live:
            total -= live.pop(address)["size"]
    alive = {}
    for entry in trace[:peak_at + 1]:
        action, address = entry.get("action"), entry.get("addr")
        if action == "alloc":
            alive[address] = entry
        elif action in ("free_requested", "free_completed"):
            alive.pop(address, None)
    return peak, list(alive.values())


def made_where(entry: dict) -> str:
    """The innermost frame in this project's code or in Inductor's generated code, else the innermost."""
    frames = entry.get("frames") or []
    for frame in frames:
        name = frame.get("filename", "")
        if name.startswith(str(ROOT)) or INDUCTOR_CODE in name:
            where = Path(name).relative_to(ROOT) if name.startswith(str(ROOT)) else Path(name).name
            return f"{where}:{frame.get('line')} {frame.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}" if frames else "(no frame)"


def by_place(entries: list[dict], rows: int) -> list[dict]:
    sizes, counts = Counter(), Counter()
    for entry in entries:
        place = made_where(entry)
        sizes[place] += entry["size"]
        counts[place] += 1
    return [{"where": place, "GiB": round(size / 2**30, 3), "allocations": counts[place]}
            for place, size in sizes.most_common(rows)]


def config_for(name: str, bf16_weights: bool) -> JobConfig:
    model, micro = MODELS[name]
    return JobConfig.from_dict({"name": "memory", "model": model, "cluster": {"use_gpu": True, "num_workers": 1},
                                "train": {"global_batch_size": micro, "micro_batch_size": micro,
                                          "bf16_weights": bf16_weights}})


def row(name: str, bf16_weights: bool, rows: int) -> dict:
    from workers.engine import Engine

    config = config_for(name, bf16_weights)
    micro = config.train.micro_batch_size
    estimate = memory.measure_step(memory.StepSpec.for_job(config, device_type="cuda"), micro)
    device = torch.device("cuda", 0)
    engine = Engine(uniform_spec(config, world_size=1, micro_batch_size=micro, grad_accum_steps=1), 0, device)
    batch = torch.randint(0, config.model.vocab_size, (micro, config.model.seq_len + 1), device=device)
    engine([batch], 1e-4)  # the first step compiles and makes the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python", clear_history=True)
    engine([batch], 1e-4)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    traced_peak, alive = live_at_peak(trace)
    del engine, batch
    torch.cuda.empty_cache()
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731
    return {"model": name, "bf16_weights": bf16_weights, "micro_batch": micro,
            "estimate_GiB": gib(estimate.peak_bytes), "measured_GiB": gib(measured),
            "error": round(estimate.peak_bytes / measured - 1, 4),
            "estimate_parts_GiB": {"parameters": gib(estimate.parameter_bytes), "gradients": gib(estimate.gradient_bytes),
                                   "optimizer": gib(estimate.optimizer_bytes), "activations and temporaries":
                                   gib(estimate.activation_bytes)},
            "allocated_before_the_step_GiB": gib(before), "traced_peak_GiB": gib(before + traced_peak),
            "alive_at_the_peak": by_place(alive, rows)}


CPU_MODELS = {  # name: ([model] table, micro-batch), bf16 autocast on the CPU
    "gpt logits-heavy": ({"n_layer": 2, "n_head": 4, "n_embd": 128, "seq_len": 256, "vocab_size": 50304}, 8),
    "llama logits-heavy": ({"kind": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 128,
                            "ffn_dim": 256, "seq_len": 256, "vocab_size": 50304}, 8),
    **{f"gpt {layers} blocks": ({"n_layer": layers, "n_head": 12, "n_embd": 768, "seq_len": 1024,
                                 "vocab_size": 512}, 1) for layers in (2, 4)},
    **{f"llama {layers} blocks": ({"kind": "llama", "n_layer": layers, "n_head": 8, "n_kv_head": 2, "n_embd": 512,
                                   "ffn_dim": 256, "seq_len": 1024, "vocab_size": 512}, 1) for layers in (2, 4)},
}


def allocator_peak(events, start_ns: int = 0, end_ns: int | None = None) -> int:
    """The highest running sum of the allocator's "[memory]" events (allocations positive, frees
    negative) among a torch.profiler session's kineto events, between start_ns and end_ns: what
    that span added at most to the memory alive before it."""
    inside = sorted((e for e in events if e.name() == "[memory]" and start_ns <= e.start_ns() and
                     (end_ns is None or e.start_ns() <= end_ns)), key=lambda e: e.start_ns())
    running = peak = 0
    for event in inside:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def cpu_row(name: str, compiled: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from workers.engine import Engine

    model, micro = CPU_MODELS[name]
    config = JobConfig.from_dict({"name": "memory", "model": model, "cluster": {"use_gpu": False, "num_workers": 1},
                                  "train": {"global_batch_size": micro, "micro_batch_size": micro, "precision": "bf16"},
                                  "compile": {"enable": compiled, "check_tolerance": 0}})
    estimate = memory.measure_step(memory.StepSpec.for_job(config, device_type="cpu"), micro)
    engine = Engine(uniform_spec(config, world_size=1, micro_batch_size=micro, grad_accum_steps=1), 0,
                    torch.device("cpu"))
    batch = torch.randint(0, config.model.vocab_size, (micro, config.model.seq_len + 1))
    for _ in range(2):  # compiles, makes the optimizer's state
        engine([batch], 1e-4)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine([batch], 1e-4)
    peak = allocator_peak(prof.profiler.kineto_results.events())
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {"model": name, "compiled": compiled, "micro_batch": micro, "step_added_MiB": mib(peak),
            "estimate_activations_and_temporaries_MiB": mib(estimate.activation_bytes)}


def cpu_main(json_path: str | None) -> None:
    rows = [cpu_row(name, compiled) for name in CPU_MODELS for compiled in (False, True)]
    for r in rows:
        print(f"{r['model']:<20} {'compiled' if r['compiled'] else 'eager':<9} step added {r['step_added_MiB']:8.1f} MiB"
              f"   estimate {r['estimate_activations_and_temporaries_MiB']:8.1f} MiB", flush=True)
    for kind in ("gpt", "llama"):
        per_block = {c: [r["step_added_MiB"] for r in rows if r["model"].startswith(f"{kind} ") and
                         "blocks" in r["model"] and r["compiled"] == c] for c in (False, True)}
        print(f"{kind}: one block keeps {(per_block[False][1] - per_block[False][0]) / 2:.1f} MiB eager, "
              f"{(per_block[True][1] - per_block[True][0]) / 2:.1f} MiB compiled")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "llama3-1b"], choices=list(MODELS))
    parser.add_argument("--bf16-weights", action="store_true", help="the engine with [train] bf16_weights")
    parser.add_argument("--rows", type=int, default=12, help="places listed at the peak")
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--cpu", action="store_true", help="small models' eager and compiled steps on this CPU")
    args = parser.parse_args()
    if args.cpu:
        cpu_main(args.json)
        return
    rows = []
    for name in args.models:
        rows.append(row(name, args.bf16_weights, args.rows))
        print(json.dumps(rows[-1], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
