"""Multi-GPU measurements on every GPU of one machine: the engine under DDP and FSDP2 against plain
PyTorch DDP + torch.compile, the device-mesh layouts (tensor parallel, FSDP2, HSDP, DDP) against
plain FSDP2 + torch.compile, an all-reduce sweep that recalibrates the cost model, the planner's
prediction against the measured step, and the DDP comm hooks against plain all-reduce.

    python3 benchmarks/multigpu.py --out $OUT            # all sections on every visible GPU
    python3 benchmarks/multigpu.py --out $OUT --only hooks --world 1   # hook compute cost on one GPU
    torchrun --nproc-per-node 8 benchmarks/multigpu.py --out $OUT --only mesh   # the layouts, under torchrun
    python3 benchmarks/multigpu.py --cpu --world 2 --out /tmp/mg       # gloo, tiny model: checks the script

Sections (--only picks some):
  sweep   all-reduce of 1 MB–1 GB over all ranks: bus bandwidth per size, and the (alpha, bus GB/s)
          calibration row for the machine's link class (calibration.json; `Calibration.load`, and
          `archipelago calibrate --sweep DIR` takes it into a fitted calibration);
          with train, the row also gets ddp_compute_slowdown: DDP's step beyond one GPU's, less its
          exposed communication
  train   per model: engine DDP, engine FSDP2 and plain DDP + compile on all ranks, the engine alone on
          one GPU; tokens/s per GPU, MFU, scaling efficiency, exposed communication and overlap
  plan    the planner's plan for the same job on this machine's probed topology: predicted step time
          against the measured engine DDP step (topology.json is the probe's map)
  mesh    per model (Llama-3.2 1B and 3B shapes, GPT 1.3B): TP=2 × FSDP2, FSDP2, HSDP (two halves of
          the machine as islands) and DDP on all ranks against plain FSDP2 + compile, and the engine on
          one GPU: tokens/s per GPU, scaling efficiency, peak memory, communication and the part of it
          no kernel hides (from a profile of 2 more steps), and the planner's predicted step for each
          layout against the measured one (a layout the ranks cannot form is skipped, saying why; on one
          GPU only the engine and plain FSDP2 + compile run)
  hooks   GPT-2 124M (or the first of --models) on real text (the standard library's .py bytes) for
          --hook-steps steps per hook:
          step time, final loss and bytes per step; the hook's own compute cost from a one-rank run
          gives the link bandwidth below which it beats plain all-reduce; with --overlap-shares,
          allreduce and bf16 again under the next-forward overlap (workers/comm/overlap.py)

Every figure is a median over timed steps after warm-up, between CUDA synchronisations (the hooks
section: between events at each step's start, with no wait between steps). Rank 0
writes the results; each configuration runs in fresh processes so compile caches do not leak.
Needs no Ray. Keep NCCL's NVLink multicast off on the lent machines (NCCL_NVLS_ENABLE=0; set here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planning  # noqa: E402
from core.config import JobConfig  # noqa: E402
from core.spec import WorkerSpec  # noqa: E402
from planning.model_size import model_facts  # noqa: E402
from planning.resolve import uniform_spec  # noqa: E402
from benchmarks.step import device_kernels, trace_events  # noqa: E402
from topology import catalog  # noqa: E402
from topology.cluster import ClusterTopology  # noqa: E402
from topology.probe import probe_local_node  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.models import make_workload  # noqa: E402

# name: (model section, micro-batch per GPU)
GPU_MODELS = {
    "gpt2-124m": ({"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304}, 32),
    "gpt-1.3b": ({"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "vocab_size": 50304}, 8),
}
CPU_MODELS = {"tiny": ({"n_layer": 2, "n_head": 4, "n_embd": 128, "seq_len": 64, "vocab_size": 257}, 4)}
MESH_MODELS = {
    "llama-1b": ({"preset": "llama3-1b", "seq_len": 2048}, 4),
    "llama-3b": ({"preset": "llama3-3b", "seq_len": 2048}, 2),
    "gpt-1.3b": GPU_MODELS["gpt-1.3b"],
}
MESH_LAYOUTS = {  # key: (row label, [parallel] strategy, tensor-parallel size, islands the ranks are cut into)
    "tp2": ("engine tp2 x fsdp2", "fsdp", 2, 1),
    "fsdp": ("engine fsdp2", "fsdp", 1, 1),
    "hsdp": ("engine hsdp, 2 islands", "hsdp", 1, 2),
    "ddp": ("engine ddp", "ddp", 1, 1),
}
HOOKS = ("allreduce", "bf16", "powersgd", "topk")
# key: (row label, job config sections); DDP's two ways of meeting compile are measured apart
# (issue: default to the faster).
ENGINE_CONFIGS = {
    "ddp_optimizer": ("engine ddp, DDPOptimizer", {"compile": {"ddp_mode": "ddp_optimizer"}}),
    "compiled_autograd": ("engine ddp, compiled autograd", {"compile": {"ddp_mode": "compiled_autograd"}}),
    "fsdp": ("engine fsdp", {"parallel": {"strategy": "fsdp"}}),
}
SWEEP_MB = (1, 4, 16, 64, 256, 1024)


# ---- launching ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, cpu: bool, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world,
                            device_id=None if cpu else torch.device("cuda", rank))
    try:
        fn(rank, world, cpu, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, cpu: bool, fn, *args) -> dict:
    """Runs fn(rank, world, cpu, *args, out_path) in `world` fresh processes; returns what rank 0 wrote."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"multigpu-{os.getpid()}-{time.monotonic_ns()}.json"
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_entry, args=(world, _free_port(), cpu, fn, (*args, str(out)), errors), nprocs=world)
    except mp.ProcessRaisedException:
        rank, text = errors.get()
        print(f"rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        # The exception's own line: the first unindented one after the last frame (hint lines may follow).
        lines = text.strip().splitlines()
        last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
        raised = next((line for line in lines[last_frame + 1:] if line and not line[0].isspace()), lines[-1])
        return {"error": f"rank {rank}: {raised[:300]}"}
    result = json.loads(out.read_text())
    out.unlink()
    return result


def _device(rank: int, cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", rank)


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def _median_step(step, warmup: int, steps: int, cpu: bool) -> tuple[float, float]:
    """(median seconds per step, warm-up seconds incl. compile); every rank times the same steps."""
    started = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(cpu)
    dist.barrier()
    warm = time.perf_counter() - started
    times = []
    for _ in range(steps):
        _sync(cpu)
        begin = time.perf_counter()
        step()
        _sync(cpu)
        times.append(time.perf_counter() - begin)
    # The slowest rank sets the pace of a synchronous step.
    median = torch.tensor([statistics.median(times)], device="cpu" if cpu else "cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median), warm


# ---- sweep --------------------------------------------------------------------------------------
def sweep(rank: int, world: int, cpu: bool, out_path: str) -> None:
    device = _device(rank, cpu)
    rows = []
    for mb in SWEEP_MB if not cpu else SWEEP_MB[:3]:
        x = torch.ones(mb * 2**20 // 4, device=device)
        seconds, _ = _median_step(lambda: dist.all_reduce(x), 3, 10 if mb < 256 else 5, cpu)
        bus = 2 * (world - 1) / world * x.numel() * 4 / seconds / 1e9 if world > 1 else 0.0
        rows.append({"mb": mb, "ms": round(seconds * 1e3, 3), "bus_gb_per_s": round(bus, 1)})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def calibration_row(rows: list[dict], world: int) -> dict:
    """Least squares of t = 2(n-1)·alpha + 2(n-1)/n · bytes / bus over the sweep (the ring model the
    cost model uses), so the planner's predictions follow this machine."""
    steps = 2 * (world - 1)
    xs = [steps / world * r["mb"] * 2**20 for r in rows]
    ts = [r["ms"] / 1e3 for r in rows]
    n, sx, st = len(xs), sum(xs), sum(ts)
    slope = (n * sum(x * t for x, t in zip(xs, ts)) - sx * st) / (n * sum(x * x for x in xs) - sx * sx)
    intercept = (st - slope * sx) / n
    row = {"alpha_us": round(max(intercept, 0.0) / steps * 1e6, 2), "bus_gb_per_s": round(1 / slope / 1e9, 1)}
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        # NCCL kept off NVLink (TCP, host memory): the link class's NVLink slowdown does not apply.
        row["ddp_compute_slowdown"] = 0.0
    return row


def measured_ddp_compute_slowdown(rows: list[dict]) -> float | None:
    """The calibration's ddp_compute_slowdown (planning/collectives.py) from the train section: the
    engine's DDPOptimizer rows' compute_slowdown_vs_1gpu, averaged over the models; None without one."""
    shares = [max(0.0, row["compute_slowdown_vs_1gpu"]) for row in rows
              if row["config"] == ENGINE_CONFIGS["ddp_optimizer"][0] and "compute_slowdown_vs_1gpu" in row]
    return round(statistics.mean(shares), 3) if shares else None


# ---- train --------------------------------------------------------------------------------------
def _job(model: dict, micro: int, world: int, cpu: bool, **sections) -> JobConfig:
    data = {"model": model,
            "train": {"global_batch_size": micro * world, "micro_batch_size": micro, "lr": 3e-4, "min_lr": 3e-4,
                      "warmup_steps": 0, "precision": "fp32" if cpu else "bf16", "log_every": 1000},
            "compile": {"enable": not cpu}, "cluster": {"num_workers": world, "use_gpu": not cpu}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return JobConfig.from_dict(data)


def _batches(config: JobConfig, rank: int, cpu: bool, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (config.train.micro_batch_size, config.model.seq_len + 1)
    return [torch.randint(0, config.model.vocab_size, shape, generator=g).to(_device(rank, cpu)) for _ in range(count)]


def engine_run(rank: int, world: int, cpu: bool, model: dict, micro: int, sections: dict, warmup: int, steps: int,
               out_path: str) -> None:
    config = _job(model, micro, world, cpu, **sections)
    # One DDP timing sample, inside the timed steps: every sampled step waits on the last one's events.
    config.train.log_every = warmup + steps - 1
    spec = uniform_spec(config, world_size=world, micro_batch_size=micro, grad_accum_steps=1)
    engine = Engine(spec, rank, _device(rank, cpu))
    batch = _batches(config, rank, cpu, 1)
    seconds, warm = _median_step(lambda: engine(batch, 3e-4), warmup, steps, cpu)
    metrics = engine.window_metrics()
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "step_s": seconds, "warmup_s": warm, "flops_per_token": spec.flops_per_token,
            "exposed_comm_s": metrics.get("exposed_comm_s"), "comm_s": metrics.get("comm_s"),
            "overlap_ratio": metrics.get("overlap_ratio"),
            "peak_mem_GiB": None if cpu else torch.cuda.max_memory_allocated() / 2**30}))


def plain_ddp_run(rank: int, world: int, cpu: bool, model: dict, micro: int, warmup: int, steps: int,
                  out_path: str) -> None:
    """The baseline a user writes: DDP around the same GPT, torch.compile (DDPOptimizer), bf16 autocast,
    fused AdamW, full-logits loss."""
    config = _job(model, micro, world, cpu)
    device = _device(rank, cpu)
    torch.manual_seed(0)
    workload = make_workload(config.model)
    net = workload.build().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=None if cpu else [rank])
    forward = ddp if cpu else torch.compile(ddp)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=not cpu)
    (batch,) = _batches(config, rank, cpu, 1)

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=not cpu):
            loss = forward(batch[:, :-1], batch[:, 1:], loss_kernel="plain")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, warm = _median_step(step, warmup, steps, cpu)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"step_s": seconds, "warmup_s": warm,
                                              "flops_per_token": model_facts(workload, config.model.seq_len).flops_per_token}))


def _row(what: str, name: str, result: dict, world: int, tokens_per_step_per_rank: int, peak: float | None) -> dict:
    if "error" in result:
        return {"model": name, "config": what, "world": world, **result}
    per_gpu = tokens_per_step_per_rank / result["step_s"]
    row = {"model": name, "config": what, "world": world, "step_ms": round(result["step_s"] * 1e3, 2),
           "tokens_per_s_per_gpu": round(per_gpu), "warmup_s": round(result["warmup_s"], 1)}
    if peak:
        row["mfu"] = round(per_gpu * result["flops_per_token"] / peak, 4)
    for key in ("exposed_comm_s", "comm_s", "overlap_ratio", "peak_mem_GiB"):
        if result.get(key) is not None:
            row[key] = round(result[key], 4)
    return row


def train_section(args, world: int, peak: float | None) -> list[dict]:
    rows = []
    for name, (model, micro) in (CPU_MODELS if args.cpu else GPU_MODELS).items():
        if args.models and name not in args.models:
            continue
        tokens = micro * model["seq_len"]
        single = run_ranks(1, args.cpu, engine_run, model, micro, {}, args.warmup, args.steps)
        group = {"single": _row("engine, 1 GPU", name, single, 1, tokens, peak)}
        for key in args.engine_configs:
            label, sections = ENGINE_CONFIGS[key]
            result = run_ranks(world, args.cpu, engine_run, model, micro, sections, args.warmup, args.steps)
            group[key] = _row(label, name, result, world, tokens, peak)
        plain = run_ranks(world, args.cpu, plain_ddp_run, model, micro, args.warmup, args.steps)
        group["plain"] = _row("plain DDP + compile", name, plain, world, tokens, peak)
        for key in (*args.engine_configs, "plain"):
            row = group[key]
            if "error" in row or "error" in group["single"]:
                continue
            row["scaling_efficiency"] = round(row["tokens_per_s_per_gpu"] / group["single"]["tokens_per_s_per_gpu"], 3)
            # What the step costs beyond the same work on one GPU: communication not hidden (FSDP2 and
            # plain DDP have no DDP timers of ours, so this is the comparable figure for all three).
            row["step_overhead_vs_1gpu"] = round(row["step_ms"] / group["single"]["step_ms"] - 1, 4)
            if "exposed_comm_s" in row:  # DDP's timers: what is left is compute slowed beside the collectives
                busy_ms = row["step_ms"] - 1e3 * row["exposed_comm_s"]
                row["compute_slowdown_vs_1gpu"] = round(busy_ms / group["single"]["step_ms"] - 1, 4)
            if key != "plain" and "error" not in group["plain"]:
                row["vs_plain_ddp_compile"] = round(row["tokens_per_s_per_gpu"] / group["plain"]["tokens_per_s_per_gpu"], 3)
        rows += group.values()
        for row in group.values():
            print(json.dumps(row), flush=True)
    return rows


# ---- mesh ---------------------------------------------------------------------------------------
def mesh_layout_refusal(world: int, tp: int, islands: int) -> str | None:
    """Why `world` ranks cannot form a layout, or None."""
    if world % (tp * islands) or world < 2:
        groups = f" in groups of {tp * islands}" if tp * islands > 1 else ""
        return f"needs two or more ranks{groups}; {world} given"
    if islands > 1 and world // islands // tp < 2:
        return f"hsdp needs two or more ranks per island: {world} ranks in {islands} islands"
    return None


def mesh_run(rank: int, world: int, cpu: bool, model: dict, micro: int, layout: str, warmup: int, steps: int,
             out_path: str) -> None:
    """The engine on `world` ranks in one layout; every GPU trains on `micro` samples' worth a step (a
    tensor-parallel group shares one replica's micro × tp samples)."""
    _, strategy, tp, islands = MESH_LAYOUTS[layout] if world > 1 else ("", "ddp", 1, 1)
    config = _job(model, micro, world, cpu, parallel={"strategy": strategy}, train={"loss_kernel": "plain"})
    size = world // islands
    spec = uniform_spec(config, world_size=world, micro_batch_size=micro * tp, grad_accum_steps=1,
                        tensor_parallel_size=tp, intra_island_groups=[list(range(k, k + size))
                                                                       for k in range(0, world, size)])
    engine = Engine(spec, rank, _device(rank, cpu))
    replica = spec.plan.worker(rank).data_parallel_rank
    g = torch.Generator().manual_seed(1000 + replica)  # a tensor-parallel group reads one batch
    batch = [torch.randint(0, config.model.vocab_size, (micro * tp, config.model.seq_len + 1),
                           generator=g).to(_device(rank, cpu))]
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    seconds, warm = _median_step(lambda: engine(batch, 3e-4), warmup, steps, cpu)
    peak_mem = None if cpu else torch.cuda.max_memory_allocated() / 2**30
    communication = {} if cpu else profiled_communication(lambda: engine(batch, 3e-4))
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "step_s": seconds, "warmup_s": warm, "flops_per_token": spec.flops_per_token,
            "peak_mem_GiB": peak_mem, **communication}))


def plain_fsdp_run(rank: int, world: int, cpu: bool, model: dict, micro: int, warmup: int, steps: int,
                   out_path: str) -> None:
    """The baseline a user writes from the torchtitan recipe: each block compiled then fully_shard-ed,
    bf16 parameters with fp32 reductions, fused AdamW, full-logits loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    config = _job(model, micro, world, cpu)
    device = _device(rank, cpu)
    torch.manual_seed(0)
    workload = make_workload(config.model)
    net = workload.build().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32 if cpu else torch.bfloat16, reduce_dtype=torch.float32)
    for block in workload.blocks(net):
        if not cpu:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=not cpu)
    (batch,) = _batches(config, rank, cpu, 1)

    def step() -> None:
        net(batch[:, :-1], batch[:, 1:], loss_kernel="plain").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    seconds, warm = _median_step(step, warmup, steps, cpu)
    peak_mem = None if cpu else torch.cuda.max_memory_allocated() / 2**30
    communication = {} if cpu else profiled_communication(step)
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "step_s": seconds, "warmup_s": warm, "peak_mem_GiB": peak_mem,
            "flops_per_token": model_facts(workload, config.model.seq_len).flops_per_token, **communication}))


def exposed_communication_us(kernels: list[tuple[float, float, bool]]) -> tuple[float, float]:
    """(time some collective kernel runs, time one runs while no other kernel does), in the kernels'
    unit, from (start, end, is_collective) intervals of every stream: what the step waits on is
    communication no computation hides (FSDP2's gathers and reductions, tensor parallelism's
    collectives, which no DDP timer sees)."""
    edges = sorted((t, change, collective) for start, end, collective in kernels
                   for t, change in ((start, 1), (end, -1)))
    running = {True: 0, False: 0}
    communicating = exposed = 0.0
    last = edges[0][0] if edges else 0.0
    for t, change, collective in edges:
        if running[True]:
            communicating += t - last
            if not running[False]:
                exposed += t - last
        running[collective] += change
        last = t
    return communicating, exposed


def profiled_communication(step, steps: int = 2) -> dict:
    """comm_s and exposed_comm_s per step, and the share of communication hidden, from a torch.profiler
    trace of `steps` more steps on this rank's GPU (every rank runs them: the collectives need all)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [(e["ts"], e["ts"] + e["dur"], "nccl" in e["name"].lower())
               for e in device_kernels(trace_events(prof))]
    communicating, exposed = exposed_communication_us(kernels)
    return {"comm_s": communicating / 1e6 / steps, "exposed_comm_s": exposed / 1e6 / steps,
            "overlap_ratio": 1 - exposed / communicating if communicating else None}


def _predicted_ms(topology: ClusterTopology, model: dict, micro: int, world: int, cpu: bool, layout: str) -> dict:
    """The planner's step for the layout on this machine's probed map, or why it refuses it."""
    _, strategy, tp, _ = MESH_LAYOUTS[layout]
    try:  # the config refuses some layouts too (tensor parallelism on CPU workers)
        config = _job(model, micro, world, cpu, parallel={"strategy": strategy}, train={"loss_kernel": "plain"},
                      placement={"min_gpus": world, "max_gpus": world, "tensor_parallel_size": tp})
        return {"predicted_step_ms": round(planning.make_plan(topology, config).predicted.step_seconds * 1e3, 2)}
    except Exception as e:  # the measurement stands where the planner refuses (one island: no hsdp)
        return {"predicted": f"refused: {type(e).__name__}: {e}"[:200]}


def mesh_section(args, world: int, peak: float | None, topology: ClusterTopology, launch) -> list[dict]:
    """`launch(world, fn, *args)` runs fn on `world` ranks and returns rank 0's result (spawned
    processes, or the torchrun ranks themselves)."""
    rows = []
    models = CPU_MODELS if args.cpu else MESH_MODELS
    for name, (model, micro) in models.items():
        if args.models and name not in args.models:
            continue
        tokens = micro * JobConfig.from_dict({"model": model}).model.seq_len
        group = {"single": _announce(_row("engine, 1 GPU", name, launch(1, mesh_run, model, micro, "ddp", args.warmup,
                                                                     args.steps), 1, tokens, peak))}
        for layout, (label, _, tp, islands) in MESH_LAYOUTS.items():
            why = mesh_layout_refusal(world, tp, islands)
            if why:
                group[layout] = {"model": name, "config": label, "world": world, "not run": why}
                continue
            result = launch(world, mesh_run, model, micro, layout, args.warmup, args.steps)
            group[layout] = _announce({**_row(label, name, result, world, tokens, peak),
                                       **_predicted_ms(topology, model, micro, world, args.cpu, layout)})
        plain = launch(world, plain_fsdp_run, model, micro, args.warmup, args.steps)
        group["plain"] = _announce(_row("plain FSDP2 + compile", name, plain, world, tokens, peak))
        single, plain = group["single"], group["plain"]
        for key, row in group.items():
            if "step_ms" not in row:
                continue
            if row["world"] > 1 and "step_ms" in single:
                row["scaling_efficiency"] = round(row["tokens_per_s_per_gpu"] / single["tokens_per_s_per_gpu"], 3)
            if "predicted_step_ms" in row:
                row["prediction_error"] = round(row["predicted_step_ms"] / row["step_ms"] - 1, 4)
            if key != "plain" and "step_ms" in plain and plain["world"] == row["world"]:
                row["vs_plain_fsdp_compile"] = round(row["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"], 3)
        measured = {k: r for k, r in group.items() if k in MESH_LAYOUTS and "step_ms" in r}
        if measured:
            fastest = max(measured, key=lambda k: measured[k]["tokens_per_s_per_gpu"])
            print(json.dumps({"model": name, "fastest_layout": MESH_LAYOUTS[fastest][0]}), flush=True)
        rows += group.values()
        for row in group.values():
            print(json.dumps(row), flush=True)
    return rows


def _announce(row: dict) -> dict:
    """Prints a row as soon as it is measured, so a run its time limit cuts keeps what it measured; the
    model's rows print again, with their ratios, once all of them are in."""
    print(json.dumps({"measured": row}), flush=True)
    return row


def torchrun_launch(rank: int, cpu: bool):
    """launch() for mesh_section under torchrun: every rank calls fn itself; a one-rank run is spawned
    by rank 0 in a fresh process with a one-rank group of its own (the others wait at a barrier)."""
    def launch(world: int, fn, *args) -> dict:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"multigpu-torchrun-{os.getpid() if rank == 0 else 0}.json"
        result: list = [None]
        try:
            if world == 1:
                result[0] = _outside_torchrun(lambda: run_ranks(1, cpu, fn, *args)) if rank == 0 else None
            else:
                fn(rank, world, cpu, *args, str(out))
                result[0] = json.loads(out.read_text()) if rank == 0 else None
        except Exception as e:  # the ranks fail together in a collective: report it and go on
            result[0] = {"error": f"rank {rank}: {type(e).__name__}: {e}"[:300]}
        if not cpu:
            torch.cuda.empty_cache()
        dist.barrier()
        dist.broadcast_object_list(result, src=0)
        return result[0]
    return launch


def _outside_torchrun(call):
    """call() with torchrun's variables out of the environment, so that a process it spawns starts a
    process group of its own instead of joining torchrun's store."""
    names = [name for name in os.environ if name.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_")) or
             name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        return call()
    finally:
        os.environ.update(saved)


# ---- plan ---------------------------------------------------------------------------------------
def plan_section(args, world: int, topology: ClusterTopology, calibration: dict | None, measured: list[dict]) -> list[dict]:
    rows = []
    for name, (model, micro) in (CPU_MODELS if args.cpu else GPU_MODELS).items():
        ddp_rows = [r for r in measured if r["model"] == name and r["config"].startswith("engine ddp") and "step_ms" in r]
        if not ddp_rows:
            continue
        ddp = min(ddp_rows, key=lambda r: r["step_ms"])  # the DDP mode a job would pick
        config = _job(model, micro, world, args.cpu, placement={"min_gpus": world, "max_gpus": world})
        for label, table in (("built-in link table", None), ("recalibrated from the sweep", calibration)):
            if label != "built-in link table" and table is None:
                continue
            kwargs = {}
            if table is not None:
                from planning.collectives import CollectiveCostModel, parse_calibration
                kwargs["collectives"] = CollectiveCostModel(parse_calibration(table, where="sweep"))
            try:
                plan = planning.make_plan(topology, config, **kwargs)
            except Exception as e:  # the measurement stands even where the planner refuses
                rows.append({"model": name, "calibration": label, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            predicted = plan.predicted.step_seconds * 1e3
            rows.append({"model": name, "calibration": label, "predicted_step_ms": round(predicted, 2),
                         "measured_step_ms": ddp["step_ms"],
                         "error": round(predicted / ddp["step_ms"] - 1, 4)})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


# ---- hooks --------------------------------------------------------------------------------------
def _text_tokens() -> np.ndarray:
    """Bytes of the running Python's standard library: real text every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks = [p.read_bytes() for p in sorted(root.glob("*.py"))]
    return np.frombuffer(b"\x00".join(chunks), dtype=np.uint8)


def hook_run(rank: int, world: int, cpu: bool, model: dict, micro: int, hook: str, steps: int, topk_ramp_steps: int,
             topk_wire: str | None, overlap_share: float | None, no_clip: bool, out_path: str) -> None:
    # Every hook, plain all-reduce included, under DDPOptimizer: the same graph splits for all of them
    # (the next-forward overlap compiles block by block instead: it runs between blocks).
    parallel = {"comm_hook": hook, "comm_warmup_steps": 10, "topk_ramp_steps": topk_ramp_steps,
                **({"topk_wire": topk_wire} if topk_wire else {})}
    if overlap_share is not None:
        parallel.update(overlap="next_forward", overlap_backward_share=overlap_share)
    config = _job(model, micro, world, cpu, parallel=parallel, compile={"ddp_mode": "ddp_optimizer"},
                  train={"grad_clip": 0.0} if no_clip else {})
    config.train.lr, config.train.min_lr = 6e-4, 6e-4
    spec = uniform_spec(config, world_size=world, micro_batch_size=micro, grad_accum_steps=1)
    engine = _hooked_engine(spec, rank, world, cpu, overlap=config.parallel.overlap)
    tokens = torch.from_numpy(_text_tokens().astype(np.int64))
    span = config.model.seq_len + 1
    g = torch.Generator().manual_seed(7)
    device = _device(rank, cpu)
    batches = []
    for _ in range(steps):  # made and copied up front: the timed loop must not wait on the host
        starts = torch.randint(0, len(tokens) - span, (world, micro), generator=g)[rank]
        batches.append(torch.stack([tokens[s:s + span] for s in starts.tolist()]).to(device))
    # A step is the time between the starts of consecutive steps on the compute stream, read once at
    # the end: no host wait and no collective between steps, which would drain the wire the
    # next-forward overlap keeps busy into the next step (and queue behind its buckets on NCCL).
    marks, losses = [], []
    _sync(cpu)
    for step, batch in enumerate(batches):
        marks.append(_mark(cpu))
        loss, _ = engine([batch], config.train.lr)
        losses.append(loss.detach())
        if step == 19:  # bytes of the compressed steps only (after comm_warmup_steps)
            engine.comm_stats.take()
    marks.append(_mark(cpu))
    engine.settle()
    _sync(cpu)
    times = [_seconds_between(a, b) for a, b in zip(marks, marks[1:])]
    comm_bytes = engine.comm_stats.take()
    total = torch.stack(losses)
    dist.all_reduce(total)
    losses = (total / world).tolist()
    exposed = engine.window_metrics().get("exposed_comm_s")
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "step_s": statistics.median(times[20:]), "final_loss": statistics.mean(losses[-10:]),
            "bytes_per_step": comm_bytes / (steps - 20), "losses": [round(x, 4) for x in losses],
            "exposed_comm_s": exposed}))


def _mark(cpu: bool):
    if cpu:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds_between(start, end) -> float:
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3


def _hooked_engine(spec: WorkerSpec, rank: int, world: int, cpu: bool, overlap: str = "off") -> Engine:
    """An engine whose DDP and hook run even on one rank (the engine skips DDP when alone), so one GPU
    measures a hook's own compute: the all-reduce of one rank moves nothing. `overlap`: the job's
    [parallel] overlap, which a one-replica plan resolves to off and this keeps on."""
    if world > 1:
        return Engine(spec, rank, _device(rank, cpu))
    import workers.parallel as parallel
    spec = spec.with_plan(dataclasses.replace(spec.plan, overlap=overlap))
    original = dist.get_world_size
    try:  # wrap() asks the world size to decide whether to wrap at all
        parallel.dist.get_world_size = lambda *a, **k: 2
        engine = Engine(spec, rank, _device(rank, cpu))
    finally:
        parallel.dist.get_world_size = original
    engine.wrapped.hook_state.world_size = 1
    return engine


def hooks_section(args, world: int) -> list[dict]:
    models = CPU_MODELS if args.cpu else GPU_MODELS
    name = args.models[0] if args.models else next(iter(models))
    model, micro = models[name]
    if "allreduce" not in args.hooks:
        raise SystemExit("--hooks must include allreduce: every hook is compared with it")
    rows = []
    runs = [(hook, wire, None) for hook in args.hooks for wire in (args.topk_wires if hook == "topk" else [None])]
    runs += [(hook, None, share) for hook in args.hooks if hook in ("allreduce", "bf16") for share in args.overlap_shares]
    no_clip = bool(args.overlap_shares)  # the overlap cannot clip: no row of the call does, for a fair comparison
    for hook, wire, share in runs:
        if args.cpu and hook == "powersgd":
            print("powersgd skipped: it hangs over gloo, and the config refuses it there", flush=True)
            continue
        ramp = args.topk_ramp_steps if hook == "topk" else 0
        on_world = run_ranks(world, args.cpu, hook_run, model, micro, hook, args.hook_steps, ramp, wire, share, no_clip)
        alone = (on_world if world == 1 else {} if args.skip_alone or share is not None
                 else run_ranks(1, args.cpu, hook_run, model, micro, hook, 40, ramp, wire, None, no_clip))
        rows.append({"model": name, "hook": hook, "world": world, "topk_ramp_steps": ramp, "topk_wire": wire,
                     "overlap_backward_share": share, "grad_clip": 0.0 if no_clip else None, **on_world,
                     "alone_step_s": alone.get("step_s"), "alone_bytes_per_step": alone.get("bytes_per_step")})
        print(json.dumps(rows[-1]), flush=True)  # as it lands: a call's time limit may cut the section short
    base = next(r for r in rows if r["hook"] == "allreduce" and r["overlap_backward_share"] is None)
    for row in rows:
        if "error" in row or "error" in base or row is base:
            continue
        row["step_vs_allreduce"] = round(row["step_s"] / base["step_s"], 3)
        row["loss_vs_allreduce"] = round(row["final_loss"] / base["final_loss"] - 1, 4)
        # The hook wins when the time its saved bytes take on the wire exceeds its own compute:
        # saved_bytes / bandwidth > cost, i.e. below bandwidth = saved_bytes / cost. The bytes are what
        # this rank hands to collectives (CommStats); from a one-rank run they stand for two ranks, where
        # a ring all-reduce and an all-gather both put exactly those bytes on each rank's link.
        row.update(_time_to_loss(row, base))
        if args.skip_alone or row["overlap_backward_share"] is not None:
            continue
        cost = row["alone_step_s"] - base["alone_step_s"]
        full = base["bytes_per_step"] if world > 1 else base["alone_bytes_per_step"]
        sent = row["bytes_per_step"] if world > 1 else row["alone_bytes_per_step"]
        row["hook_compute_ms"] = round(cost * 1e3, 3)
        row["break_even_gb_per_s"] = round((full - sent) / cost / 1e9, 2) if cost > 0 else math.inf
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _time_to_loss(row: dict, base: dict) -> dict:
    """Seconds of training (steps × median step) until the 10-step mean loss first reaches what plain
    all-reduce reached three quarters of the way through: time to the same loss, not only time per
    step (a target all-reduce only just reaches would leave a hook's noise deciding)."""
    def steps_to(losses: list[float], target: float) -> int | None:
        means = [statistics.mean(losses[i - 10:i]) for i in range(10, len(losses) + 1)]
        return next((i + 10 for i, m in enumerate(means) if m <= target), None)

    quarter = len(base["losses"]) * 3 // 4
    target = statistics.mean(base["losses"][quarter - 10:quarter]) + 1e-9
    ours, theirs = steps_to(row["losses"], target), steps_to(base["losses"], target)
    return {"target_loss": round(target, 4), "steps_to_target": ours, "allreduce_steps_to_target": theirs,
            "seconds_to_target": round(ours * row["step_s"], 2) if ours else None,
            "allreduce_seconds_to_target": round(theirs * base["step_s"], 2) if theirs else None}


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for multigpu.json, topology.json, calibration.json")
    parser.add_argument("--only", nargs="+", choices=("sweep", "train", "plan", "mesh", "hooks"),
                        default=("sweep", "train", "plan", "mesh", "hooks"))
    parser.add_argument("--world", type=int, default=0, help="ranks; 0 is every visible GPU")
    parser.add_argument("--models", nargs="+", choices=list(GPU_MODELS) + list(CPU_MODELS) + list(MESH_MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hook-steps", type=int, default=200)
    parser.add_argument("--skip-alone", action="store_true",
                        help="hooks: skip the one-rank runs that measure each hook's own compute")
    parser.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS), help="hooks the hooks section runs")
    parser.add_argument("--topk-ramp-steps", type=int, default=0,
                        help="[parallel] topk_ramp_steps for the topk hook: its share falls from 25 %% to topk_ratio over them")
    parser.add_argument("--topk-wires", nargs="+", choices=("elias_fano", "offsets"), default=["elias_fano"],
                        help="[parallel] topk_wire values the topk hook runs with, one run each")
    parser.add_argument("--overlap-shares", nargs="+", type=float, default=[],
                        help="hooks: also run allreduce and bf16 with [parallel] overlap = \"next_forward\" at each "
                             "overlap_backward_share given (0: from the plan); every row of the call then trains "
                             "with grad_clip = 0, which the overlap needs")
    parser.add_argument("--engine-configs", nargs="+", choices=list(ENGINE_CONFIGS), default=list(ENGINE_CONFIGS),
                        help="which engine wrappings the train section measures")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes with a tiny model")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # under torchrun: the mesh section, run by the ranks themselves
        torchrun_main(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = args.world or (2 if args.cpu else torch.cuda.device_count())
    if world < 1:
        sys.exit("no CUDA GPU visible: run on a GPU machine, or pass --cpu for a gloo check of the script")
    peak = None
    topology = ClusterTopology(nodes=[probe_local_node()])
    if not args.cpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        model = catalog.lookup(torch.cuda.get_device_name())
        peak = model.peak_tflops["bf16"] * 1e12 if model else None
        topology.save(out / "topology.json")
    results: dict = {"world": world, "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
                     "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    calibration = None
    if "sweep" in args.only and world == 1:
        results["sweep"] = {"not run": "an all-reduce needs two or more ranks; 1 given"}
        print(json.dumps({"sweep": results["sweep"]}), flush=True)
    elif "sweep" in args.only:
        results["sweep"] = run_ranks(world, args.cpu, sweep)
        if "error" not in results["sweep"]:
            link = "loopback" if args.cpu else _link_class(topology)
            calibration = {link: calibration_row(results["sweep"], world)}
            (out / "calibration.json").write_text(json.dumps(calibration, indent=1))
            results["calibration"] = calibration
        print(json.dumps({"sweep": results["sweep"], "calibration": calibration}), flush=True)
    if "train" in args.only:
        results["train"] = train_section(args, world, peak)
    if calibration is not None and "train" in results and not args.cpu:  # CPU ranks share cores: no figure
        slowdown = measured_ddp_compute_slowdown(results["train"])
        if slowdown is not None and slowdown > 1:
            print(f"ddp_compute_slowdown {slowdown} not written: above 1 the DDP rows measure something else "
                  "(see the train section's rows)", flush=True)
        elif slowdown is not None:
            for row in calibration.values():
                row["ddp_compute_slowdown"] = slowdown
            (out / "calibration.json").write_text(json.dumps(calibration, indent=1))
            print(json.dumps({"calibration": calibration}), flush=True)
    if "plan" in args.only and "train" in results:
        results["plan"] = plan_section(args, world, topology, calibration, results["train"])
    if "mesh" in args.only:
        results["mesh"] = mesh_section(args, world, peak, topology, lambda n, fn, *a: run_ranks(n, args.cpu, fn, *a))
    if "hooks" in args.only:
        results["hooks"] = hooks_section(args, world)
    (out / "multigpu.json").write_text(json.dumps(results, indent=1))


def torchrun_main(args) -> None:
    """The mesh section on torchrun's ranks (one process per GPU, this host): rank 0 writes mesh.json."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not args.cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("gloo" if args.cpu else "nccl")
    model = None if args.cpu else catalog.lookup(torch.cuda.get_device_name())
    peak = model.peak_tflops["bf16"] * 1e12 if model else None
    topology = ClusterTopology(nodes=[probe_local_node()])
    rows = mesh_section(args, world, peak, topology, torchrun_launch(rank, args.cpu))
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mesh.json").write_text(json.dumps({"world": world, "torch": torch.__version__, "mesh": rows},
                                                            indent=1))
    dist.destroy_process_group()


def _link_class(topology: ClusterTopology) -> str:
    """The class of the slowest link between this machine's GPUs (the ring's bottleneck)."""
    from planning.collectives import LinkClass
    links = [link for node in topology.nodes for link in node.links]
    kinds = {getattr(link.kind, "value", link.kind) for link in links}
    if not links or kinds - {"nvlink", "nvswitch"}:
        return LinkClass.PCIE.value
    return LinkClass.NVSWITCH.value if "nvswitch" in kinds else LinkClass.NVLINK.value


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
