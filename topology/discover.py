"""Map every alive node of a Ray cluster: one probe task pinned to each node, results joined.

    ray.init(address="auto")
    cluster = discover_cluster()                         # the cluster this driver is connected to
    cluster = discover_cluster(address="auto")          # connect, probe, disconnect (the CLIs)

Each probe also measures its node's devices once (a few seconds; cached per node and driver, see
topology/device_figures.py), so the planner can cost them by what they do rather than their data sheet.

The probe asks for no CPU and no GPU, so it runs even on a node whose resources are all taken,
and sees every GPU the node owns (NVML does not care about CUDA_VISIBLE_DEVICES set by Ray for
GPU tasks; the node's own CUDA_VISIBLE_DEVICES from `ray start` is honoured by the probe).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict

from core import codec
from core.errors import ClusterError
from topology.cluster import ClusterTopology, NodeTopology
from topology.connect import CONNECT_TIMEOUT_S, check_seconds, ray_session
from topology.device_figures import DeviceBench
from topology.probe import probe_local_node

TIMEOUT_S = 120.0
"""How long discovery waits for every node's probe by default (`--timeout` on the CLIs)."""


def _probe() -> dict:
    # A plain dict crosses the object store: no dependence on pickling our dataclasses. The device
    # figures come from the node's cache after the first probe (topology/device_figures.py).
    return asdict(probe_local_node(bench=DeviceBench.from_environment()))


def discover_cluster(*, address: str | None = None, timeout_s: float = TIMEOUT_S,
                     connect_timeout_s: float = CONNECT_TIMEOUT_S) -> ClusterTopology:
    """address None: the Ray cluster this process is connected to (ClusterError when it is not).
    Otherwise connect to `address` ("auto", "ray://host:10001", host:port; "" for RAY_ADDRESS, else
    an embedded cluster) within `connect_timeout_s` for the probes, and disconnect after."""
    check_seconds(timeout_s, "--timeout")
    if address is None:
        return _probe_every_node(timeout_s)
    with ray_session(address or os.environ.get("RAY_ADDRESS", ""), connect_timeout_s=connect_timeout_s):
        return _probe_every_node(timeout_s)


def _probe_every_node(timeout_s: float) -> ClusterTopology:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise ClusterError("not connected to a Ray cluster", where="topology discovery",
                           fix="call ray.init() first, or run `archipelago topology --address auto`")
    alive = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)).remote()
            for n in alive]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        missing = [n["NodeManagerAddress"] for n, ref in zip(alive, refs) if ref in pending]
        raise ClusterError(f"{len(missing)} of {len(alive)} nodes did not answer the topology probe within "
                           f"{timeout_s:g} s: {', '.join(missing)}", where="topology discovery",
                           fix="check them with `ray status`, or allow longer with --timeout")
    results = ray.get(refs)
    hostnames = Counter(result["hostname"] for result in results)
    nodes = [_node(info, result, shared_host=hostnames[result["hostname"]] > 1) for info, result in zip(alive, results)]
    return ClusterTopology(nodes=nodes)


def _node(info: dict, result: dict, *, shared_host: bool) -> NodeTopology:
    node: NodeTopology = codec.decode(NodeTopology, result, f"probe of {info['NodeManagerAddress']}")
    node.ray_node_id = info["NodeID"]
    node.address = info["NodeManagerAddress"]
    node.ray_resources = {key: float(value) for key, value in info.get("Resources", {}).items()
                          if not key.startswith("node:")}  # node:<ip> is Ray's per-node bookkeeping
    node.ray_labels = dict(info.get("Labels", {}))
    if shared_host:  # several Ray nodes on one machine (ray.cluster_utils, or one per GPU group)
        node.node_id = f"{node.hostname}-{node.ray_node_id[:8]}"
    ray_gpus = node.ray_resources.get("GPU", 0.0)
    mapped = sum(1 for gpu in node.gpus if gpu.usable_whole) + len(node.mig_slices)
    if ray_gpus != mapped:
        node.notes.append(f"Ray advertises {ray_gpus:g} GPUs here but the map has {mapped} schedulable GPUs or "
                          "MIG slices: start Ray with --num-gpus matching the node")
    return node
