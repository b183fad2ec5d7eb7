"""Quantization-aware training against post-training quantization, on a CPU fine-tune.

    python3 benchmarks/qat.py                                   # int8-dynamic-act-int4-weight, group 32
    python3 benchmarks/qat.py --scheme int8-weight --finetune-steps 300 --json qat.json

A built-in Llama (4 blocks, width 128, seq 128) is pretrained on the bytes of the standard library's
`email` package, then fine-tuned from those weights on `asyncio` twice with the same data
order: once in full precision, then quantized after training (PTQ: torchao's post-training config),
and once with [train] qat (fake quantization while training, then torchao's convert step). Both
quantized models' validation loss on the fine-tuning set is printed beside the full-precision
model's, with each fine-tune's median step time (QAT's cost). The worker engine runs the steps
(workers/engine.py), one CPU process, no Ray.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's kernels/, not benchmarks/kernels.py

from core.config import JobConfig  # noqa: E402
from planning.resolve import uniform_spec  # noqa: E402
from storage.prepare import prepare_dataset  # noqa: E402
from storage.sampler import DeterministicSampler  # noqa: E402
from storage.shards import TokenDataset  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.qat import convert_qat, quantize_ptq  # noqa: E402

SEQ, BATCH = 128, 16
MODEL = {"kind": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "seq_len": SEQ,
         "tie_embeddings": False}


def dataset(packages: list[str], root: Path) -> Path:
    source = root / "-".join(packages)
    for package in packages:
        shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = root / f"data-{'-'.join(packages)}"
    prepare_dataset(str(source), out, val_percent=20.0, workers=1)
    return out


def engine(steps: int, lr: float, qat: str = "", group_size: int = 32) -> Engine:
    config = JobConfig.from_dict({"model": MODEL, "cluster": {"num_workers": 1},
                                  "train": {"steps": steps, "global_batch_size": BATCH, "micro_batch_size": BATCH,
                                            "lr": lr, "min_lr": lr / 10, "warmup_steps": 10, "qat": qat,
                                            "qat_group_size": group_size, "loss_kernel": "plain"}})
    return Engine(uniform_spec(config, world_size=1, micro_batch_size=BATCH, grad_accum_steps=1), 0, torch.device("cpu"))


def train(run: Engine, data: Path, steps: int, lr: float) -> list[float]:
    """Trains `steps` steps on `data` (the same sample order every call); returns each step's seconds."""
    split = TokenDataset(data, "train", SEQ)
    order = DeterministicSampler(split.num_samples, seed=0).permute(0, np.arange(steps * BATCH) % split.num_samples)
    seconds = []
    for step in range(steps):
        batch = torch.from_numpy(split.batch(order[step * BATCH:(step + 1) * BATCH]))
        started = time.perf_counter()
        run([batch], run.spec.lr_schedule.lr_at(step))
        seconds.append(time.perf_counter() - started)
    return seconds


@torch.no_grad()
def val_loss(model: torch.nn.Module, data: Path, samples: int = 64) -> float:
    split = TokenDataset(data, "val", SEQ)
    ids = np.linspace(0, split.num_samples - 1, min(samples, split.num_samples)).astype(np.int64)
    batch = torch.from_numpy(split.batch(ids))
    return float(model(batch[:, :-1], batch[:, 1:], loss_kernel="plain"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", default="int8-dynamic-act-int4-weight", choices=["int8-dynamic-act-int4-weight",
                                                                                      "int8-weight"])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp())
    pretrain_data, finetune_data = dataset(["email"], root), dataset(["asyncio"], root)

    base = engine(args.pretrain_steps, 3e-3)
    train(base, pretrain_data, args.pretrain_steps, 3e-3)
    pretrained = copy.deepcopy(base.model.state_dict())

    results = {"scheme": args.scheme, "group_size": args.group_size, "pretrain_steps": args.pretrain_steps,
               "finetune_steps": args.finetune_steps}
    for name, qat in (("plain", ""), ("qat", args.scheme)):
        run = engine(args.finetune_steps, 1e-3, qat, args.group_size)
        run.model.load_state_dict(pretrained)
        seconds = train(run, finetune_data, args.finetune_steps, 1e-3)
        results[f"{name}_step_ms"] = 1000 * statistics.median(seconds[5:])
        results[f"{name}_val_loss"] = val_loss(run.model, finetune_data)  # QAT's: with fake quantization
        quantized = copy.deepcopy(run.model)
        if qat:
            convert_qat(quantized, qat, args.group_size)
        else:
            quantize_ptq(quantized, run.workload.blocks(quantized), args.scheme, args.group_size)
        results[f"{name}_quantized_val_loss"] = val_loss(quantized, finetune_data)
    results["qat_step_cost"] = results["qat_step_ms"] / results["plain_step_ms"]
    print(f"{args.scheme} (group {args.group_size}), fine-tune {args.finetune_steps} steps after "
          f"{args.pretrain_steps} of pretraining, validation loss:")
    print(f"  full precision (plain fine-tune)     {results['plain_val_loss']:.4f}")
    print(f"  plain fine-tune, then quantized (PTQ) {results['plain_quantized_val_loss']:.4f}")
    print(f"  QAT fine-tune, fake-quantized         {results['qat_val_loss']:.4f}")
    print(f"  QAT fine-tune, converted (quantized)  {results['qat_quantized_val_loss']:.4f}")
    print(f"  step: plain {results['plain_step_ms']:.1f} ms, QAT {results['qat_step_ms']:.1f} ms "
          f"({results['qat_step_cost']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
