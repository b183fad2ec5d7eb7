"""Hand-built worker specs and a process-group launcher for the worker-engine tests (no Ray, gloo on CPU)."""

from __future__ import annotations

import json
import socket
import tempfile
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from core.config import JobConfig
from core.spec import WorkerSpec
from planning.resolve import uniform_spec


def engine_spec(config: JobConfig, world: int, micro_batch_size: int, accum: int, *,
                islands: list[list[int]] | None = None) -> WorkerSpec:
    """A spec of `world` identical workers with equal micro-batches, resolved from `config` as the
    planner resolves it: what the planner makes for identical devices."""
    return uniform_spec(config, world_size=world, micro_batch_size=micro_batch_size, grad_accum_steps=accum,
                        intra_island_groups=islands)


def job_spec(config: JobConfig) -> WorkerSpec:
    """The spec of `config` as [cluster] num_workers identical workers split its global batch."""
    world, micro = config.cluster.num_workers, config.train.micro_batch_size
    return engine_spec(config, world, micro, max(1, config.train.global_batch_size // (micro * world)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, store: str, backend: str, fn, args, errors, out_path: str) -> None:
    if backend == "nccl":
        import torch
        torch.cuda.set_device(rank)
    # A file store, not a TCP port: a port picked free and then bound by rank 0 can be taken in between
    # (by the Ray cluster of the tests running beside these), and then the ranks hang until the timeout.
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, backend: str = "gloo"):
    """Runs fn(rank, world, *args) in `world` processes joined by a process group (gloo, or nccl with
    one GPU per rank) and returns what rank 0's call returned, through JSON; fn must be importable."""
    errors = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "rank0.json")
        try:
            store = str(Path(tmp) / "rendezvous")
            mp.spawn(_entry, args=(world, store, backend, fn, args, errors, out_path), nprocs=world)
        except mp.ProcessRaisedException:
            rank, text = errors.get()
            raise AssertionError(f"rank {rank} failed:\n{text}") from None
        return json.loads(Path(out_path).read_text())
