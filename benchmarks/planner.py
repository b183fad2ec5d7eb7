"""The planner against its named baselines: the exhaustive optimum of the same cost model, and Ray's PACK.

    python benchmarks/planner.py                       # everything below, CPU only, a few minutes on 2 cores
    python benchmarks/planner.py --skip-small --repeats 5 --json planner.json

Large: GPT 1.3B (seq 2048, global batch 16,384) on a generated 1,024-node, 8,192-GPU mixed cluster
(512 × 8×H100 SXM, 256 × 8×A100 SXM, 256 × 8×L40S). Timed: building the planner (device pool,
domains, cost tables), the search and building the Plan: the planning a `fit` would wait for once
it has the topology and the job's memory profile. The memory profile (fake-tensor steps of the
model, independent of the cluster's size) and generating the topology are timed separately.
Wall and CPU seconds, median of --repeats; the target is < 1 s.

Small: GPT-2 124M (seq 1024, global batch 256) on clusters of at most 16 devices in several mixes,
each objective. "exhaustive" evaluates every number of devices from every domain with every
feasible accumulation count (devices of one domain are interchangeable in the model, so that is
every subset of devices) under the same cost model; the target is the planner within 5% of it.
"naive" is Ray's PACK placement of the same number of whole GPUs with one micro-batch for all
(Planner.naive); its ratio to the plan is printed, not targeted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from core.config import JobConfig  # noqa: E402
from planning import memory  # noqa: E402
from planning.planner import Planner  # noqa: E402
from topology import machines  # noqa: E402

LARGE_CLUSTER = "8xH100-SXM:512,8xA100-SXM:256,8xL40S:256"
GPT_1_3B = {"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "vocab_size": 50304}
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304}
SMALL_CLUSTERS = (
    "8xH100-SXM:1,8xL40S:1",
    "4xA100-PCIE-bridged:2,4xL4:2",
    "1xH100-MIG7:1,1xH200:1,4xL4:2",
    "8xA10G:1,4xL4:2",
    "8xV100-SXM2:1,1xA10G:4,1xH200:4",
    "1xH200:2,1xA10G:6,1xH100-MIG7:1",
)
OBJECTIVES = ("fastest", "cheapest", "cheapest_under_deadline")


def job(model: dict, global_batch: int, micro_batch: int, **placement) -> JobConfig:
    return JobConfig.from_dict({"name": "bench", "model": model, "cluster": {"use_gpu": True},
                                "train": {"steps": 10_000, "global_batch_size": global_batch,
                                          "micro_batch_size": micro_batch},
                                "placement": placement})


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def large(repeats: int) -> dict:
    config = job(GPT_1_3B, 16_384, 8)
    topology, topology_wall, _ = timed(lambda: machines.cluster(LARGE_CLUSTER))
    profile, profile_wall, profile_cpu = timed(lambda: memory.profile(config))
    devices = sum(len(n.gpus) for n in topology.nodes)
    print(f"large: {len(topology.nodes):,} nodes, {devices:,} GPUs ({LARGE_CLUSTER}); GPT 1.3B, global batch 16,384")
    print(f"  generating the topology {topology_wall:.2f} s; memory profile (3 fake steps, once per job) "
          f"{profile_wall:.2f} s wall / {profile_cpu:.2f} s CPU")
    runs = []
    for _ in range(repeats):
        planner, setup_wall, setup_cpu = timed(lambda: Planner(topology, config, memory=profile, exact_memory=False))
        best, search_wall, search_cpu = timed(lambda: planner.search(planner.costing))
        plan, build_wall, build_cpu = timed(lambda: planner.build(best, planner.costing, notes=[]))
        runs.append({"setup_wall": setup_wall, "search_wall": search_wall, "build_wall": build_wall,
                     "setup_cpu": setup_cpu, "search_cpu": search_cpu, "build_cpu": build_cpu})
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    total_wall = median["setup_wall"] + median["search_wall"] + median["build_wall"]
    total_cpu = median["setup_cpu"] + median["search_cpu"] + median["build_cpu"]
    naive = planner.naive(plan.world_size)
    everything = planner.naive()
    models = sorted({w.device_model for w in plan.workers})
    print(f"  plan: {plan.world_size:,} workers ({', '.join(models)}), {plan.data_parallel.value}, "
          f"{plan.allreduce.value}, micro-batches {sorted({w.micro_batch_size for w in plan.workers})} × "
          f"{plan.grad_accum_steps}; step {plan.predicted.step_seconds:.4f} s")
    print(f"  planning time, median of {repeats}: setup {median['setup_wall']:.3f} + search {median['search_wall']:.3f}"
          f" + build {median['build_wall']:.3f} = {total_wall:.3f} s wall ({total_cpu:.3f} s CPU); target < 1 s: "
          f"{'met' if total_wall < 1 else 'MISSED'}")
    mine = plan.predicted
    for label, other in (("the plan's number of", naive), ("all", everything)):
        if other:
            theirs = other.predicted
            print(f"  naive PACK on {label} GPUs ({other.world_size:,}, micro-batch "
                  f"{other.workers[0].micro_batch_size} × {other.grad_accum_steps}): step "
                  f"{theirs.step_seconds:.4f} s = {theirs.step_seconds / mine.step_seconds:.2f}× the plan's, "
                  f"${theirs.dollars_per_million_tokens:.3f}/M tokens = "
                  f"{theirs.dollars_per_million_tokens / mine.dollars_per_million_tokens:.2f}×")
    return {"nodes": len(topology.nodes), "gpus": devices, "workers": plan.world_size, "median": median,
            "total_wall_s": total_wall, "total_cpu_s": total_cpu, "memory_profile_wall_s": profile_wall,
            "step_seconds": plan.predicted.step_seconds,
            "dollars_per_million_tokens": plan.predicted.dollars_per_million_tokens,
            "naive_same_count": naive.predicted.step_seconds if naive else None,
            "naive_all_gpus": everything.predicted.step_seconds if everything else None}


def small() -> list[dict]:
    base = job(GPT2_124M, 256, 32)
    profile = memory.profile(base)
    rows = []
    print("\nsmall clusters, GPT-2 124M, global batch 256: planner vs the exhaustive optimum and naive PACK")
    print(f"  {'cluster':34s} {'objective':24s} {'devices':>9s} {'planner':>11s} {'exhaustive':>11s} "
          f"{'ratio':>6s} {'naive':>7s} {'search s':>8s} {'exh s':>6s}")
    for cluster in SMALL_CLUSTERS:
        topology = machines.cluster(cluster)
        fastest_hours = None
        for objective in OBJECTIVES:
            placement = {"objective": objective}
            if objective == "cheapest_under_deadline":
                placement["deadline_hours"] = round(1.5 * fastest_hours, 3)  # room for a cheaper, slower plan
            planner = Planner(topology, job(GPT2_124M, 256, 32, **placement), memory=profile, exact_memory=False)
            found, search_wall, _ = timed(lambda: planner.search(planner.costing))
            best, exhaustive_wall, _ = timed(planner.exhaustive)
            plan = planner.build(found, planner.costing, notes=[])
            naive = planner.naive(plan.world_size)
            if objective == "fastest":
                fastest_hours = found.job_hours(planner.job)
            value = found.score[0]
            ratio = value / best.score[0]
            unit = "s/step" if objective == "fastest" else "$/Mtok"
            naive_value = (naive.predicted.step_seconds if objective == "fastest" else
                           naive.predicted.dollars_per_million_tokens) if naive else None
            naive_ratio = f"{naive_value / value:.2f}×" if naive_value else "none"
            print(f"  {cluster:34s} {objective:24s} {found.devices:>4d}/{best.devices:<4d} {value:>11.5g} "
                  f"{best.score[0]:>11.5g} {ratio:>6.3f} {naive_ratio:>7s} {search_wall:>8.2f} {exhaustive_wall:>6.1f}")
            rows.append({"cluster": cluster, "objective": objective, "unit": unit, "planner": value,
                         "exhaustive": best.score[0], "ratio": ratio, "planner_devices": found.devices,
                         "exhaustive_devices": best.devices, "naive": naive_value,
                         "search_s": search_wall, "exhaustive_s": exhaustive_wall})
    worst = max(row["ratio"] for row in rows)
    print(f"  worst planner / exhaustive: {worst:.4f}; target ≤ 1.05: {'met' if worst <= 1.05 else 'MISSED'}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of the large plan (median)")
    parser.add_argument("--skip-small", action="store_true", help="only the large cluster")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, Python {platform.python_version()}")
    results = {"large": large(args.repeats)}
    if not args.skip_small:
        results["small"] = small()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
