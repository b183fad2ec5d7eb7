"""The first step's compile check (workers/compile_check.py) on real models: how far apart compiled and
eager are in sound compiles, and whether the check stops a compile with torch 2.11's final-norm race.

    python3 benchmarks/compile_check.py                                  # both models, both precisions
    python3 benchmarks/compile_check.py --models gpt-1.3b --precisions autocast --json check.json

Each row builds the engine (benchmarks/step.py's settings, compile caches off so every row tunes its
own block sizes) and runs its first step on real text, once per way of compiling:
- "as tuned": the engine as it is;
- "norm outside, largest block": GPT.head as it was before the fused loss took the final norm in
  (kernels/loss.py), with the final norm's kernel held to its largest R0_BLOCK, the block size under
  which Inductor's kernel for the last residual add and final norm raced at n_embd 2048;
- "norm outside, smallest block": the same with the smallest, which computed the right thing.
Both comparisons are made in every row (its tolerances set out of reach); a row prints the loss and
worst gradient differences, the parameter with the worst, the kernels held to a block size, and which
of the default tolerances ([compile] check_tolerance, gradient_tolerance) would have stopped the run.
Needs a CUDA GPU and no Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch: every row autotunes

import torch
from torch._inductor.runtime import triton_heuristics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import step  # noqa: E402
from core.config import CompileConfig  # noqa: E402
from kernels.loss import ignore_masked, linear_cross_entropy  # noqa: E402
from planning.resolve import uniform_spec  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.models.gpt import GPT  # noqa: E402

DEFAULTS = CompileConfig()
RECORD_ONLY = {"check_tolerance": 1e30, "gradient_tolerance": 1e30}
WAYS = ("as tuned", "norm outside, largest block", "norm outside, smallest block")
PRECISIONS = {"autocast": {}, "bf16 weights": {"train": {"bf16_weights": True}}}


def head_with_the_norm_outside(self, x: torch.Tensor, targets, loss_kernel: str, loss_mask=None) -> torch.Tensor:
    """GPT.head before the fused loss ran the final norm itself: Inductor fuses the norm with the last
    residual add into one kernel that feeds the op."""
    targets = ignore_masked(targets, loss_mask).reshape(-1)
    return linear_cross_entropy(self.ln_f(x).reshape(-1, x.size(-1)), self.lm_head.weight, targets)


class HeldBlockSize:
    """While active, the final norm's kernel (a layer norm feeding the fused loss op), when it has
    several candidate configs, runs the one with the largest (or smallest) R0_BLOCK instead of the
    autotuner's pick."""

    def __init__(self, largest: bool):
        self.largest = largest
        self.held: dict[str, str] = {}
        self._run = triton_heuristics.CachingAutotuner.run

    def __enter__(self):
        holder, run = self, self._run

        def run_held(autotuner, *args, **kwargs):
            name = autotuner.fn.__name__
            if "native_layer_norm" in name and "linear_cross_entropy" in name and not getattr(autotuner, "_held", False):
                autotuner._held = True
                if not autotuner.launchers:
                    autotuner.precompile()
                if len(autotuner.launchers) > 1:
                    pick = max if holder.largest else min
                    autotuner.launchers = [pick(autotuner.launchers, key=lambda la: la.config.kwargs.get("R0_BLOCK", 0))]
                    holder.held[name] = str(autotuner.launchers[0].config)
            return run(autotuner, *args, **kwargs)

        triton_heuristics.CachingAutotuner.run = run_held
        return self

    def __exit__(self, *_):
        triton_heuristics.CachingAutotuner.run = self._run


def first_step(name: str, precision: str, way: str, data: step.TextBatches) -> dict:
    step.reset_compiler()
    B = data.tokens.shape[1]
    # Tolerances no difference reaches, so both comparisons are always made and recorded; the row
    # then says which of the default tolerances the run was over (a gradient over its tolerance is
    # checked once more in full precision by the engine; this row does not make that pass).
    config = step.engine_config(name, B, {**PRECISIONS[precision], "compile": RECORD_ONLY}, steps=100)
    spec = uniform_spec(config, world_size=1, micro_batch_size=B, grad_accum_steps=1, use_gpu=step.DEVICE == "cuda")
    engine = Engine(spec, 0, torch.device(step.DEVICE, 0))
    row = {"model": name, "precision": precision, "way": way}
    holder = None
    with contextlib.ExitStack() as old_head:
        if way != "as tuned":
            holder = old_head.enter_context(HeldBlockSize(largest="largest" in way))
            old_head.callback(setattr, GPT, "head", GPT.head)
            GPT.head = head_with_the_norm_outside
        engine([data[0]], lr=0.0)
    row.update(engine.compile_check)
    row["stopped_by"] = [key for key, apart in (("check_tolerance", row["relative_difference"]),
                                                 ("gradient_tolerance", row["gradient_difference"]))
                         if apart > getattr(DEFAULTS, key)]
    row["held"] = holder.held if holder is not None else {}
    by_size = sorted(engine.compile_checker.gradient_differences.items(), key=lambda item: -item[1])
    row["largest_gradient_differences"] = dict(by_size[:6])
    row["median_gradient_difference"] = by_size[len(by_size) // 2][1]
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(step.MODELS), choices=list(step.MODELS))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    rows = []
    for name in args.models:
        _, seq_len, *_, B = step.MODELS[name]
        data = step.TextBatches(B, seq_len, steps=1)
        for precision in args.precisions:
            for way in args.ways:
                row = first_step(name, precision, way, data)
                rows.append(row)
                print(json.dumps(row), flush=True)
                stops = " and ".join(row["stopped_by"]) or "neither tolerance"
                print(f"{name}, {precision}, {way}: loss {row['relative_difference']:.2e} apart, worst gradient "
                      f"{row['gradient_difference']:.2e} ({row['gradient_worst']}); at the defaults stopped by {stops}",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
