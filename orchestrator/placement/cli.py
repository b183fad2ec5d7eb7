"""`archipelago plan`: place a job on a cluster map and compare with Ray's default placement.

    archipelago plan --config job.toml                                # the live Ray cluster
    archipelago plan --topology cluster.json --config job.toml --json plan.json --png plan.png
    archipelago plan --topology node-a.txt --topology node-b.txt --config job.toml   # nvidia-smi texts
    archipelago plan --generate 8xH100-SXM:4,8xL40S:2 --config job.toml              # a made-up cluster
"""

from __future__ import annotations

import argparse

from rich.console import Console

from orchestrator.topology import ClusterTopology, discover_cluster, load_files, machines
from orchestrator.topology.cli import add_timeout_argument


def add_commands(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="place a job's workers on the cluster and predict step time and dollars")
    plan.add_argument("--config", required=True, help="job config (TOML)")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--topology", action="append", metavar="FILE",
                        help="a topology JSON or `nvidia-smi -L; nvidia-smi topo -m` text (repeat for more nodes); "
                             "default: map the live Ray cluster")
    source.add_argument("--generate", metavar="SPEC", help=f"a made-up cluster, MACHINE:COUNT,…; machines: "
                                                           f"{', '.join(machines.MACHINES)}")
    source.add_argument("--address", help="Ray cluster to map (default: RAY_ADDRESS, else an embedded cluster)")
    plan.add_argument("--json", metavar="OUT", help="save the plan as JSON (what the workers read)")
    plan.add_argument("--png", metavar="OUT", help="draw the workers on the map (needs matplotlib)")
    add_timeout_argument(plan)
    plan.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    plan.set_defaults(command=_plan)


def _plan(args: argparse.Namespace, console: Console) -> int:
    from orchestrator.config import JobConfig

    config = JobConfig.from_toml(args.config)
    topology = _topology(args)
    from orchestrator.placement.planner import Planner
    from orchestrator.placement.table import print_plan

    planner = Planner(topology, config)
    plan = planner.plan()
    naive = planner.naive(plan.world_size)
    reason = "" if naive else (f"no single micro-batch divides {plan.global_batch_size} samples over "
                               f"{plan.world_size} whole GPUs in PACK order and fits them all")
    print_plan(plan, naive, console, naive_reason=reason)
    if args.json:
        console.print(f"saved {plan.save(args.json)}")
    if args.png:
        from orchestrator.placement.drawing import draw_plan_png
        console.print(f"drew {draw_plan_png(plan, topology, args.png, naive=naive)}")
    return 0


def _topology(args: argparse.Namespace) -> ClusterTopology:
    if args.topology:
        return load_files(args.topology)
    if args.generate:
        return machines.cluster(args.generate)
    return discover_cluster(address=args.address or "", timeout_s=args.timeout)
