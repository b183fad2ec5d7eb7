"""What the top-k hook costs in loss and saves in bytes, against the uncompressed run, on CPU.

    python3 benchmarks/topk_loss.py                                   # shares 5, 10, 15 % at seeds 0 and 1
    python3 benchmarks/topk_loss.py --shares 0.07 --ramp-steps 80 --seeds 0 1 2 3
    python3 benchmarks/topk_loss.py --shares 0.07 --ramp-steps 80 --seeds 0 --wire offsets   # bytes as int16 offsets

The run is the worker-engine test's text run (tests/unit/test_engine.py): a 2-layer byte-level GPT
on the standard library's email package, 2 gloo ranks, 150 steps at a constant lr 3e-3. Per seed
(the weights' initialisation; the batches stay the same) the baseline is the same run with DDP's
plain fp32 all-reduce; each row prints the mean loss of the last 10 steps, its gap to the
baseline's, and the bytes the hook handed to collectives over the whole run against the baseline's.
About 20 s a run on 2 cores.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import JobConfig  # noqa: E402
from storage.prepare import prepare_dataset  # noqa: E402
from tests.engine_support import engine_spec, run_ranks  # noqa: E402
from tests.unit.test_engine import TEXT_STEPS, text_losses  # noqa: E402
from workers.engine import Engine  # noqa: E402

TEXT_JOB = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 32},
            "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 0}}


def _ranks(rank: int, world: int, data_dir: str, parallel: dict, seed: int) -> dict:
    config = JobConfig.from_dict({**TEXT_JOB, "train": {**TEXT_JOB["train"], "seed": seed},
                                  "parallel": parallel, "cluster": {"num_workers": world}})
    engine = Engine(engine_spec(config, world, 8, 1), rank, torch.device("cpu"))
    losses = text_losses(engine, data_dir, rank, world, TEXT_STEPS)
    return {"losses": losses, "bytes": engine.window_metrics()["comm_bytes"]}


def run(data_dir: Path, parallel: dict, seed: int) -> tuple[float, int]:
    """(mean loss of the last 10 steps, bytes handed to collectives over the run)."""
    result = run_ranks(2, _ranks, str(data_dir), parallel, seed)
    return sum(result["losses"][-10:]) / 10, result["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.10, 0.15],
                        help="[parallel] topk_ratio values: the share of entries sent (after any ramp)")
    parser.add_argument("--ramp-steps", type=int, default=0, help="[parallel] topk_ramp_steps (from 25 %% down)")
    parser.add_argument("--dense-steps", type=int, default=0, help="[parallel] comm_warmup_steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--wire", choices=("elias_fano", "offsets"), default="elias_fano",
                        help="[parallel] topk_wire: how the entries' places are sent")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus, data = Path(tmp) / "email", Path(tmp) / "data"
        shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "email", corpus,
                        ignore=shutil.ignore_patterns("__pycache__"))
        prepare_dataset(str(corpus), data, val_percent=25.0, shard_tokens=64 * 1024, workers=1)
        print(f"{'seed':>4} {'share':>6} {'loss':>7} {'baseline':>8} {'gap':>8} {'bytes vs fp32':>13}")
        for seed in args.seeds:
            base_loss, base_bytes = run(data, {}, seed)
            for share in args.shares:
                parallel = {"comm_hook": "topk", "topk_ratio": share, "topk_ramp_steps": args.ramp_steps,
                            "comm_warmup_steps": args.dense_steps, "topk_wire": args.wire}
                loss, sent = run(data, parallel, seed)
                print(f"{seed:>4} {share:>6.1%} {loss:>7.4f} {base_loss:>8.4f} {loss / base_loss - 1:>+8.2%} "
                      f"{sent / base_bytes:>13.2%}", flush=True)


if __name__ == "__main__":
    main()
