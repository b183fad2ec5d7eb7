"""The planner's memory estimate beside the peak a GPU measures, and what is alive at that peak.

    python3 benchmarks/memory.py                                   # GPT-2 124M and the Llama-3.2-1B shape
    python3 benchmarks/memory.py --models llama3-1b --bf16-weights --json memory.json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "llama3-1b"], choices=list(MODELS))
    parser.add_argument("--bf16-weights", action="store_true", help="the engine with [train] bf16_weights")
    parser.add_argument("--rows", type=int, default=12, help="places listed at the peak")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(row(name, args.bf16_weights, args.rows))
        print(json.dumps(rows[-1], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
