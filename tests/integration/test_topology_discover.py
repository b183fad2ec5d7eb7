"""Discovery on a real multi-node Ray cluster (ray.cluster_utils.Cluster: several raylets on loopback).

conftest.py's cluster (a head and a worker node) with a third node for this module: one advertising
fake GPUs and the custom resources and labels `archipelago node-resources` would print for an 8×H100 box.
"""

import pytest
import ray

from core.errors import ClusterError
from topology import machines
from topology.discover import discover_cluster
from topology.ray_resources import ray_start_arguments

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gpu_cluster(cluster):
    h100 = ray_start_arguments(machines.node("8xH100-SXM", "gpu-host"))
    gpu_node = cluster.add_node(num_cpus=0, num_gpus=8, resources=h100.resources, labels=h100.labels)
    cluster.wait_for_nodes()
    try:
        yield cluster, h100
    finally:
        cluster.remove_node(gpu_node)  # the CPU jobs of other modules plan on every node's CPUs


def test_one_node_entry_per_ray_node(gpu_cluster):
    _, h100 = gpu_cluster
    topology = discover_cluster()
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    assert sorted(node.ray_node_id for node in topology.nodes) == sorted(alive)
    assert len({node.node_id for node in topology.nodes}) == 3  # one host: ids made unique per Ray node
    for node in topology.nodes:
        assert node.address == alive[node.ray_node_id]["NodeManagerAddress"]
        assert node.cpu_count > 0 and node.memory_bytes > 0 and node.source == "nvml"
    (gpu_node,) = [node for node in topology.nodes if node.ray_resources.get("GPU")]
    assert gpu_node.ray_resources["nvlink_island_gpu-host-nvl0"] == 8.0
    assert {k: v for k, v in gpu_node.ray_labels.items() if k.startswith("archipelago.io/")} == h100.labels
    if not gpu_node.gpus:  # CI machines have no NVIDIA driver: the probe says so, and the mismatch is noted
        assert "Ray advertises 8 GPUs here but the map has 0 schedulable GPUs or MIG slices" in gpu_node.notes[-1]


def test_discovery_without_ray_says_how_to_connect(gpu_cluster):
    ray.shutdown()
    try:
        with pytest.raises(ClusterError, match="not connected to a Ray cluster"):
            discover_cluster()
    finally:
        ray.init(address=gpu_cluster[0].address, log_to_driver=False)


def test_discovery_at_an_address_connects_for_the_probes_only(gpu_cluster):
    ray.shutdown()
    try:
        topology = discover_cluster(address=gpu_cluster[0].address, timeout_s=60)
        assert len(topology.nodes) == 3 and not ray.is_initialized()
    finally:
        ray.init(address=gpu_cluster[0].address, log_to_driver=False)
