"""`archipelago topology` and `archipelago node-resources`.

    archipelago topology                                  # the live Ray cluster (RAY_ADDRESS, else embedded)
    archipelago topology --address auto --json cluster.json --png cluster.png
    archipelago topology --local                          # this machine through NVML, without Ray
    archipelago topology --from cluster.json              # a saved map
    archipelago topology --from node-a.txt --from node-b.txt   # `nvidia-smi -L; nvidia-smi topo -m` texts
    archipelago topology --generate 8xH100-SXM:4,8xL40S:2      # a made-up cluster, for planning
    ray start --head $(archipelago node-resources)        # advertise islands and MIG profiles to Ray
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from rich.console import Console

from orchestrator.atomic import read_text
from orchestrator.errors import TopologyError
from orchestrator.topology import machines, nvidia_smi
from orchestrator.topology.model import ClusterTopology, NodeTopology


def add_commands(commands: argparse._SubParsersAction) -> None:
    topology = commands.add_parser("topology", help="map GPUs, MIG slices, NVLink islands, PCIe/NUMA and NICs")
    source = topology.add_mutually_exclusive_group()
    source.add_argument("--address", help="Ray cluster to map (default: RAY_ADDRESS, else an embedded cluster)")
    source.add_argument("--local", action="store_true", help="map this machine through NVML, without Ray")
    source.add_argument("--from", dest="from_files", action="append", metavar="FILE",
                        help="a saved topology JSON, or `nvidia-smi -L; nvidia-smi topo -m` text (one node "
                             "per text file); repeat for more nodes")
    source.add_argument("--generate", metavar="SPEC",
                        help=f"a made-up cluster, MACHINE:COUNT,…; machines: {', '.join(machines.MACHINES)}")
    topology.add_argument("--json", metavar="OUT", help="save the map as JSON")
    topology.add_argument("--png", metavar="OUT", help="draw the map (needs matplotlib)")
    topology.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every node's probe")
    topology.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    topology.set_defaults(command=_topology)

    resources = commands.add_parser("node-resources",
                                    help="print `ray start` --resources/--labels for this machine's islands and MIG")
    resources.add_argument("--format", choices=("args", "json"), default="args",
                           help="args (default): flags to splice into `ray start`; json: an object")
    resources.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    resources.set_defaults(command=_node_resources)


def _topology(args: argparse.Namespace, console: Console) -> int:
    from orchestrator.topology.table import print_topology

    cluster = _load(args)
    print_topology(cluster, console)
    if args.json:
        console.print(f"saved {cluster.save(args.json)}")
    if args.png:
        from orchestrator.topology.drawing import draw_png
        console.print(f"drew {draw_png(cluster, args.png)}")
    return 0


def _load(args: argparse.Namespace) -> ClusterTopology:
    if args.local:
        from orchestrator.topology.probe import probe_local_node
        return ClusterTopology(nodes=[probe_local_node()])
    if args.from_files:
        return _from_files([Path(f) for f in args.from_files])
    if args.generate:
        return machines.cluster(args.generate)
    return _from_ray(args.address or os.environ.get("RAY_ADDRESS", ""), args.timeout)


def _from_files(paths: list[Path]) -> ClusterTopology:
    nodes: list[NodeTopology] = []
    for path in paths:
        text = read_text(path, error=TopologyError, fix="pass a topology JSON or nvidia-smi text file")
        if text.lstrip().startswith("{"):
            nodes.extend(ClusterTopology.from_json(text, where=str(path)).nodes)
        else:
            nodes.append(nvidia_smi.parse_node(text, node_id=_node_id(path, nodes), source=str(path)))
    return ClusterTopology(nodes=nodes)


def _node_id(path: Path, nodes: list[NodeTopology]) -> str:
    """The file's name up to its first dot (node-a.txt → node-a), unique among the nodes so far."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.name.split(".")[0]) or "node"
    taken = {node.node_id for node in nodes}
    return next(candidate for candidate in (base if k == 0 else f"{base}-{k}" for k in range(len(taken) + 1))
                if candidate not in taken)


def _from_ray(address: str, timeout_s: float) -> ClusterTopology:
    import ray

    from orchestrator.topology.discover import discover_cluster

    ray.init(address=address or None, log_to_driver=False, include_dashboard=False if not address else None)
    try:
        return discover_cluster(timeout_s=timeout_s)
    finally:
        ray.shutdown()


def _node_resources(args: argparse.Namespace, console: Console) -> int:
    from orchestrator.topology.probe import probe_local_node
    from orchestrator.topology.ray_resources import ray_start_arguments

    arguments = ray_start_arguments(probe_local_node())
    # Plain print: the output is spliced into a command line, so no wrapping or markup.
    print(arguments.as_json() if args.format == "json" else arguments.as_arguments())
    return 0
