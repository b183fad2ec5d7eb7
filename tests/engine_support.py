"""Hand-built plans and a process-group launcher for the worker-engine tests (no Ray, gloo on CPU)."""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from orchestrator.placement.plan import DataParallel, DeviceKind, Objective, Plan, Prediction, WorkerPlacement


def uniform_plan(world: int, micro_batch_size: int, accum: int, *, islands: list[list[int]] | None = None,
             seq_len: int = 32, strategy: str = "ddp") -> Plan:
    """A plan of `world` workers with equal micro-batches, as the planner makes for identical devices
    (described as CPU workers: the engine reads only micro-batches, accumulation and groups)."""
    workers = [WorkerPlacement(rank=r, node_id="node-0", device_uuid=None, device_kind=DeviceKind.CPU,
                               device_model="cpu", island_id=None, micro_batch_size=micro_batch_size,
                               grad_accum_steps=accum, data_parallel_rank=r) for r in range(world)]
    prediction = Prediction(step_seconds=0.0, compute_seconds=0.0, exposed_communication_seconds=0.0,
                            communication_seconds=0.0, tokens_per_second=0.0, dollars_per_hour=0.0,
                            dollars_per_step=0.0, dollars_per_million_tokens=0.0, job_hours=0.0, job_dollars=0.0)
    return Plan(job_name="test", objective=Objective.FASTEST, workers=workers,
                global_batch_size=world * micro_batch_size * accum, seq_len=seq_len, grad_accum_steps=accum,
                data_parallel=DataParallel(strategy), intra_island_groups=islands or [list(range(world))],
                tensor_parallel_groups=[[r] for r in range(world)], data_parallel_groups=[list(range(world))],
                predicted=prediction)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Runs fn(rank, world, *args) in `world` processes joined by a gloo group; fn must be importable."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_entry, args=(world, free_port(), fn, args, errors), nprocs=world)
    except mp.ProcessRaisedException:
        rank, text = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{text}") from None
