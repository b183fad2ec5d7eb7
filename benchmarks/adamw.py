"""The one-pass AdamW step (kernels.adamw) against torch's fused AdamW on one CUDA GPU, in the same run.

    python3 benchmarks/adamw.py                                   # the Llama-3.2-3B shape's parameters
    python3 benchmarks/adamw.py --model llama3-1b --steps 20 --json adamw.json
    python3 benchmarks/adamw.py --cpu --model tiny                # a smoke run on the CPU (the kernels' twins)

Every row steps the same parameters (the model's own shapes, built on the meta device) with the engine's
AdamW (workers.optim: fused on CUDA, 1-D parameters not decayed), from fresh moments, with the clip's divisor as grad_scale
where the row has one. Bytes a parameter, as each row reads and writes them:
  copy                the bandwidth baseline: 28 bytes a parameter moved by copy_ of one flat buffer (at most
                      COPY_BUFFER_BYTES, timed and scaled to the model's bytes: 3B's would need 90 GB)
  fused               torch's fused AdamW, no grad_scale (the plain loop's step, no clipping): 28
  fused + scale       the same with the clip as grad_scale (the engine's autocast step until 2026-12-05): 32,
                      as it writes every gradient back divided
  one-pass fp32       AdamWFromFp32 with the clip (the engine's autocast step now): 28
  one-pass fp32, views  the same on DDP-like bucket views at odd offsets (no 16-byte accesses): 28
  bf16, unfused       bf16 gradients cast into fp32 ones, fused + scale, the masters copied into bf16 weights: 44
  one-pass bf16       AdamWFromBf16 (the engine's bf16-weights step): 28
Each row: warm-up steps, then the median of --steps steps timed by CUDA events (wall clock on the CPU), its
bandwidth from the bytes above, and its time against "fused + scale" and against "copy". One row's tensors
are freed before the next row's are made (the 3B shape's rows hold up to ~64 GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from core.config import JobConfig, TrainConfig  # noqa: E402
from kernels.adamw import AdamWFromBf16, AdamWFromFp32  # noqa: E402
from workers.models import make_workload  # noqa: E402
from workers.optim import build_optimizer  # noqa: E402

MODELS = {
    "llama3-1b": {"preset": "llama3-1b"},
    "llama3-3b": {"preset": "llama3-3b"},
    "llama3-8b": {"preset": "llama3-8b"},
    "gpt-1.3b": {"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "vocab_size": 50304},
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 32},
}
COPY_BUFFER_BYTES = 2 * 2**30
"""The copy row's source buffer at most (its destination as large): HBM's rate is reached well below it."""
GRAD_SCALE = 1.7
"""The clip's divisor (gradient norm over max_grad_norm): any value above 1 divides every gradient."""
ROWS = ("copy", "fused", "fused + scale", "one-pass fp32", "one-pass fp32, views", "bf16, unfused", "one-pass bf16")
BYTES_PER_PARAMETER = {"copy": 28, "fused": 28, "fused + scale": 32, "one-pass fp32": 28,
                       "one-pass fp32, views": 28, "bf16, unfused": 44, "one-pass bf16": 28}


def parameter_shapes(model: str) -> list[torch.Size]:
    """The model's parameter shapes, from its workload built on the meta device (no memory)."""
    config = JobConfig.from_dict({"model": MODELS[model]}).model
    with torch.device("meta"):
        built = make_workload(config).build()
    return [p.shape for p in built.parameters()]


def gradients(shapes: list[torch.Size], device: torch.device, dtype: torch.dtype, views: bool) -> list[torch.Tensor]:
    """Small random gradients; with `views`, views into one flat buffer, each at an odd offset."""
    if not views:
        return [torch.randn(shape, device=device, dtype=dtype) * 1e-3 for shape in shapes]
    flat = torch.randn(sum(s.numel() + 1 for s in shapes), device=device, dtype=dtype) * 1e-3
    out, offset = [], 1
    for shape in shapes:
        out.append(flat[offset:offset + shape.numel()].view(shape))
        offset += shape.numel() + 1
    return out


def make_row(name: str, shapes: list[torch.Size], device: torch.device) -> Callable[[], None]:
    """One step of the row `name`, its tensors made (they live as long as the step function)."""
    scale = torch.tensor(GRAD_SCALE, device=device)
    if name == "copy":
        src = torch.empty(copy_elements(shapes), device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    masters = [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for shape in shapes]
    optimizer = build_optimizer(torch.nn.ParameterList(masters), TrainConfig(), device)  # the engine's AdamW
    torch_scale = scale if optimizer.defaults["fused"] else None  # a CPU smoke run's AdamW takes none
    if "bf16" in name:
        grads = gradients(shapes, device, torch.bfloat16, views=False)
        copies = [m.detach().bfloat16() for m in masters]
        if name == "one-pass bf16":
            step = AdamWFromBf16(optimizer, masters, copies)
            return lambda: step.step(grads, scale)

        def unfused() -> None:
            for master, grad in zip(masters, grads):
                master.grad = grad.float()
            optimizer.grad_scale = torch_scale
            optimizer.step()
            with torch.no_grad():
                torch._foreach_copy_(copies, masters)
        return unfused
    grads = gradients(shapes, device, torch.float32, views=name.endswith("views"))
    for master, grad in zip(masters, grads):
        master.grad = grad
    if name.startswith("one-pass fp32"):
        step = AdamWFromFp32(optimizer)
        return lambda: step.step(scale)
    optimizer.grad_scale = torch_scale if name == "fused + scale" else None
    return optimizer.step


def copy_elements(shapes: list[torch.Size]) -> int:
    """fp32 elements of the copy row's source: 14 bytes a parameter, at most COPY_BUFFER_BYTES."""
    return min(sum(s.numel() for s in shapes) * 7 // 2, COPY_BUFFER_BYTES // 4)


def timed(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> float:
    """Median seconds a step, after `warmup` steps."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def measure(model: str, device: torch.device, warmup: int, steps: int, rows: tuple[str, ...] = ROWS) -> list[dict]:
    shapes = parameter_shapes(model)
    parameters = sum(s.numel() for s in shapes)
    results = []
    for name in rows:
        step = make_row(name, shapes, device)
        seconds = timed(step, device, warmup, steps)
        del step  # its tensors, before the next row's
        if device.type == "cuda":
            torch.cuda.empty_cache()
        moved = BYTES_PER_PARAMETER[name] * parameters
        if name == "copy":  # a smaller buffer's copy, scaled to the model's bytes
            seconds *= moved / (8 * copy_elements(shapes))
        results.append({"row": name, "model": model, "parameters": parameters, "tensors": len(shapes),
                        "ms": seconds * 1e3, "gb_per_s": moved / seconds / 1e9})
    by_name = {r["row"]: r["ms"] for r in results}
    for r in results:
        if "fused + scale" in by_name:
            r["vs_fused_scale"] = by_name["fused + scale"] / r["ms"]
        if "copy" in by_name:
            r["vs_copy"] = by_name["copy"] / r["ms"]
    return results


def print_table(rows: list[dict], device_name: str) -> None:
    first = rows[0]
    print(f"{device_name}: {first['model']}, {first['parameters'] / 1e6:,.1f} M parameters in {first['tensors']} tensors")
    print(f"{'row':<22} {'ms':>9} {'GB/s':>8} {'x fused+scale':>14} {'copy / row':>11}")
    for r in rows:
        print(f"{r['row']:<22} {r['ms']:>9.2f} {r['gb_per_s']:>8.0f} {r.get('vs_fused_scale', float('nan')):>14.3f} "
              f"{r.get('vs_copy', float('nan')):>11.3f}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-3b", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU: the twins, wall-clock times")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --cpu for a smoke run)")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    rows = measure(args.model, device, args.warmup, args.steps, tuple(args.rows))
    print_table(rows, "CPU" if args.cpu else torch.cuda.get_device_name(device))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
