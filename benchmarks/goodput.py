"""Goodput: the adaptive batch against the config's fixed batch and the best fixed batch of a sweep,
each trained to the same validation loss, in one run; and the noise scale's cost per step.

    python benchmarks/goodput.py --threads 1                       # CPU tiny shape, ~1 min on 2 cores
    python benchmarks/goodput.py --shape config                    # the config's own model (4 × 128, T=128)
    python benchmarks/goodput.py --batches 8 16 32 64 --target 2.45 --json goodput.json
    python benchmarks/goodput.py --noise-cost --device cuda        # on a GPU: GPT-2 124M, bf16

Every run trains one worker engine in this process (workers/engine.py; no Ray: the driver adds the
same cost to every run) on the prepared byte-level standard-library text, on the sampler's exact
order, from the same initial weights, and evaluates the validation loss every --eval-every
samples. A run stops at the first evaluation at or below --target. --shape picks the model: the
config's, or a named shape of MODEL_SHAPES (tiny, the default: 2 layers of 64, T=64, so that the
seven runs finish on 2 cores). Compared, each to the target:

- fixed: the config's global batch (examples/cpu-tiny.toml: 32), lr as the config says;
- sweep: each of --batches with the learning rate scaled by sqrt(B / config batch) (what a user
  sweeping the batch would do), and the best of them by dollars;
- adaptive: [train] batch_size = "adaptive" from the config batch, min/max the sweep's ends, lr
  scaled by AdaScale (core/adaptive_batch.py), decisions every log window as in a job.

Dollars are the CPU time of the training steps (evaluations excluded), in core-seconds, at the CPU
core price of planning/prices.py: on a machine of its own that is the wall time times the threads
used, and on a shared one it leaves out the cores other processes took (the wall time, printed
beside it, does not; --threads 1 keeps threads from spinning while the other waits for a core).
One worker has no replica to compare with, so the noise scale comes from the first micro-batch's
gradient against the whole batch's: the micro-batch is --micro (4), so every batch accumulates.

--noise-cost times the engine step with the noise measurement on and off (Engine.measures_noise),
alternating, on one device; the cost is the extra read of the gradients after the first
micro-batch (on several GPUs the read happens per DDP bucket instead: the same bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import numpy as np  # noqa: E402
import torch  # noqa: E402

from core.config import JobConfig  # noqa: E402
from planning.prices import PriceTable  # noqa: E402
from planning.resolve import uniform_spec  # noqa: E402
from storage.loader import BatchLoader  # noqa: E402
from storage.prepare import prepare_dataset  # noqa: E402
from storage.readers import PosixReader  # noqa: E402
from storage.sampler import DeterministicSampler  # noqa: E402
from storage.shards import TokenDataset  # noqa: E402
from workers.batch_adapter import BatchAdapter  # noqa: E402
from workers.engine import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_SHAPES = {
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304},
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64, "vocab_size": 257},  # a CPU smoke run
}


@dataclass
class Outcome:
    name: str
    batch: str
    reached: bool
    steps: int
    samples: int
    tokens: int
    train_seconds: float
    """Wall time of the training steps."""
    cpu_seconds: float
    """CPU time of the training steps, all threads: the core-seconds the dollars price."""
    dollars: float
    final_val_loss: float
    batch_changes: list

    def line(self) -> str:
        status = "reached" if self.reached else "NOT reached"
        return (f"{self.name:<22} {self.batch:<14} {status:<11} steps {self.steps:>5}  tokens {self.tokens:>9,}  "
                f"wall {self.train_seconds:6.1f} s  cpu {self.cpu_seconds:6.1f} s  ${self.dollars:.6f}  "
                f"val {self.final_val_loss:.4f}")


def load_config(path: Path, data: Path, shape: str) -> JobConfig:
    config = JobConfig.from_toml(path)
    model = config.model if shape == "config" else replace(config.model, **MODEL_SHAPES[shape])
    return replace(config, model=model, data=replace(config.data, path=str(data), prepare_from=""))


def dataset(data: Path) -> Path:
    if not (data / "manifest.parquet").exists():
        print(f"preparing {data} from this Python's standard library …")
        prepare_dataset("stdlib", data, workers=0)
    return data


def train_config(config: JobConfig, batch: int, *, adaptive: tuple[int, int] | None, micro: int) -> JobConfig:
    lr_scale = math.sqrt(batch / config.train.global_batch_size) if adaptive is None else 1.0
    train = replace(config.train, global_batch_size=batch, micro_batch_size=micro, lr=config.train.lr * lr_scale,
                    min_lr=config.train.min_lr * lr_scale)
    if adaptive is not None:
        train = replace(train, batch_size="adaptive", min_batch_size=adaptive[0], max_batch_size=adaptive[1])
    return replace(config, train=train, cluster=replace(config.cluster, num_workers=1))


def run(name: str, config: JobConfig, data: Path, *, target: float, eval_every: int, max_samples: int,
        micro: int, price_per_core_hour: float, log_every: int) -> Outcome:
    train = config.train
    spec = uniform_spec(config, world_size=1, micro_batch_size=micro, grad_accum_steps=train.global_batch_size // micro,
                        data_location=str(data))
    device = torch.device("cpu")
    engine = Engine(spec, 0, device)
    adapter = BatchAdapter(spec)
    engine.replan(adapter.plan)
    train_set = TokenDataset(data, "train", config.model.seq_len)
    val_set = TokenDataset(data, "val", config.model.seq_len, manifest=train_set.manifest)
    loader = BatchLoader(train_set, PosixReader(threads=2), device, depth=1)
    val_loader = BatchLoader(val_set, PosixReader(threads=2), device, depth=1)
    val_ids = np.linspace(0, val_set.num_samples - 1, 256).astype(np.int64)
    val_batches = [val_ids[i:i + 64] for i in range(0, len(val_ids), 64)]
    sampler = DeterministicSampler(train_set.num_samples, train.seed)
    step = consumed = 0
    train_seconds = cpu_seconds = 0.0
    next_eval, val_loss, changes = eval_every, math.inf, []
    while consumed < max_samples:
        layout = adapter.plan.batch_layout()
        batches = loader.load(sampler.rank_micro_batches(consumed, layout, 0))
        started, cpu_started = time.perf_counter(), time.process_time()
        lr = adapter.lr(spec.lr_schedule, step, consumed)
        _, grad_norm = engine(batches, lr)
        local = engine.local_gradient
        row = {"grad_norm": float(grad_norm), "local_grad_sq": float(local[0]) if local else math.nan,
               "inverse_local_batch": 1.0 / local[1] if local else 0.0}
        adapter.measured([row])
        step, consumed = step + 1, consumed + layout.global_batch
        if step % log_every == 0:
            change = adapter.maybe_change(step)
            if change is not None:
                engine.replan(adapter.plan)
                changes.append({k: change[k] for k in ("step", "from", "to", "noise_scale")} | {"samples": consumed})
        train_seconds += time.perf_counter() - started
        cpu_seconds += time.process_time() - cpu_started
        if consumed >= next_eval:
            next_eval += eval_every
            loss_sum, tokens = engine.evaluate(val_loader.load(val_batches))
            val_loss = loss_sum / tokens
            if val_loss <= target:
                break
    loader.close()
    val_loader.close()
    batch = "adaptive" if adapter.policy.adaptive else str(train.global_batch_size)
    dollars = cpu_seconds / 3600 * price_per_core_hour
    return Outcome(name, batch, val_loss <= target, step, consumed, consumed * config.model.seq_len, train_seconds,
                   cpu_seconds, dollars, val_loss, changes)


def noise_cost(args) -> dict:
    """Engine step time with the noise measurement on and off, alternating blocks of steps."""
    model = MODEL_SHAPES[args.noise_shape]
    config = JobConfig.from_dict({"model": model,
                                  "train": {"global_batch_size": args.noise_batch, "micro_batch_size": args.noise_micro,
                                            "precision": "bf16" if args.device == "cuda" else "fp32"},
                                  "cluster": {"num_workers": 1, "use_gpu": args.device == "cuda"},
                                  "compile": {"enable": args.device == "cuda"}})
    accum = args.noise_batch // args.noise_micro
    spec = uniform_spec(config, world_size=1, micro_batch_size=args.noise_micro, grad_accum_steps=accum)
    device = torch.device(args.device)
    engine = Engine(spec, 0, device)
    batches = [torch.randint(0, model["vocab_size"], (args.noise_micro, model["seq_len"] + 1), device=device)
               for _ in range(accum)]

    def timed(on: bool, steps: int) -> float:
        engine.measures_noise = on
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        started = time.perf_counter()
        for _ in range(steps):
            loss, _ = engine(batches, 1e-4)
        loss.item()
        sync()
        return (time.perf_counter() - started) / steps

    for on in (True, False):
        timed(on, args.noise_warmup)
    on_s, off_s = [], []
    for _ in range(args.noise_repeats):
        on_s.append(timed(True, args.noise_steps))
        off_s.append(timed(False, args.noise_steps))
    on_median, off_median = statistics.median(on_s), statistics.median(off_s)
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "model": args.noise_shape, "micro_batch": args.noise_micro, "accumulation": accum,
            "step_ms_with_noise_scale": on_median * 1e3, "step_ms_without": off_median * 1e3,
            "cost_percent": (on_median - off_median) / off_median * 100, "blocks": args.noise_repeats,
            "steps_per_block": args.noise_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples/cpu-tiny.toml")
    parser.add_argument("--data", type=Path, default=ROOT / "data/stdlib-bytes")
    parser.add_argument("--shape", choices=["config", *sorted(MODEL_SHAPES)], default="tiny",
                        help="the model: the config's, or a named shape (tiny: 2 layers of 64, T=64)")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--target", type=float, default=2.6, help="validation loss every run trains to")
    parser.add_argument("--eval-every", type=int, default=1024, help="samples between validation passes")
    parser.add_argument("--max-samples", type=int, default=40_000, help="a run that has not reached the target stops here")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--noise-cost", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--noise-shape", choices=sorted(MODEL_SHAPES), default="gpt2-124m")
    parser.add_argument("--noise-batch", type=int, default=64)
    parser.add_argument("--noise-micro", type=int, default=16)
    parser.add_argument("--noise-steps", type=int, default=10)
    parser.add_argument("--noise-warmup", type=int, default=5)
    parser.add_argument("--noise-repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.noise_cost:
        result = noise_cost(args)
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
    data = dataset(args.data)
    config = load_config(args.config, data, args.shape)
    price = PriceTable().dollars_per_hour("cpu", spot=False)
    common = dict(target=args.target, eval_every=args.eval_every, max_samples=args.max_samples, micro=args.micro,
                  price_per_core_hour=price, log_every=config.train.log_every)
    base = config.train.global_batch_size
    print(f"target val loss {args.target}; config batch {base}; sweep {args.batches}; micro {args.micro}; "
          f"${price}/core-hour of CPU time; {args.threads} threads")
    fixed = run("fixed (config)", train_config(config, base, adaptive=None, micro=args.micro), data, **common)
    print(fixed.line(), flush=True)
    sweep = []
    for batch in args.batches:
        outcome = fixed if batch == base else run(f"sweep {batch}", train_config(config, batch, adaptive=None,
                                                                                  micro=args.micro), data, **common)
        sweep.append(outcome)
        if batch != base:
            print(outcome.line(), flush=True)
    adaptive_config = train_config(config, base, adaptive=(min(args.batches), max(args.batches)), micro=args.micro)
    adaptive = run("adaptive", adaptive_config, data, **common)
    print(adaptive.line(), flush=True)
    print("  batch changes:", ", ".join(f"step {c['step']}: {c['from']}→{c['to']} (noise {c['noise_scale']:.0f})"
                                        for c in adaptive.batch_changes) or "none")
    reached = [o for o in sweep if o.reached]
    best = min(reached, key=lambda o: o.dollars) if reached else None
    summary = {"target": args.target, "fixed": fixed.__dict__, "sweep": [o.__dict__ for o in sweep],
               "best_fixed": best.__dict__ if best else None, "adaptive": adaptive.__dict__}
    if best and fixed.reached and adaptive.reached:
        summary["adaptive_vs_fixed_dollars"] = adaptive.dollars / fixed.dollars
        summary["adaptive_vs_best_dollars"] = adaptive.dollars / best.dollars
        print(f"adaptive / config fixed: {summary['adaptive_vs_fixed_dollars']:.3f} of the dollars "
              f"(goal ≤ 0.80); adaptive / best fixed ({best.batch}): {summary['adaptive_vs_best_dollars']:.3f} (goal ≤ 1.05)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
