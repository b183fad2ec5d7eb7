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

from rich.console import Console

from orchestrator.topology import discover_cluster, load_files, machines
from orchestrator.topology.discover import TIMEOUT_S
from orchestrator.topology.model import ClusterTopology


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
    add_timeout_argument(topology)
    topology.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    topology.set_defaults(command=_topology)

    resources = commands.add_parser("node-resources",
                                    help="print `ray start` --resources/--labels for this machine's islands and MIG")
    resources.add_argument("--format", choices=("args", "json"), default="args",
                           help="args (default): flags to splice into `ray start`; json: an object")
    resources.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    resources.set_defaults(command=_node_resources)


def add_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """--timeout for the commands that map the live Ray cluster (topology discovery says to raise it)."""
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help=f"seconds to wait for every node's topology probe (default {TIMEOUT_S:g})")


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
        return load_files(args.from_files)
    if args.generate:
        return machines.cluster(args.generate)
    return discover_cluster(address=args.address or "", timeout_s=args.timeout)


def _node_resources(args: argparse.Namespace, console: Console) -> int:
    from orchestrator.topology.probe import probe_local_node
    from orchestrator.topology.ray_resources import ray_start_arguments

    arguments = ray_start_arguments(probe_local_node())
    # Plain print: the output is spliced into a command line, so no wrapping or markup.
    print(arguments.as_json() if args.format == "json" else arguments.as_arguments())
    return 0
