"""The cluster topology map: what GPUs, MIG slices, NVLink islands, PCIe/NUMA paths and NICs each
Ray node has, as one plain object (`ClusterTopology`) that prints, saves as JSON and loads back.

    from orchestrator import topology
    cluster = topology.discover()                                  # one probe task per alive Ray node
    cluster = topology.ClusterTopology.load("examples/topologies/h200-single.json")
    cluster = topology.machines.cluster([("8xH100-SXM", 4), ("8xL40S", 2)])    # for tests and simulation
    cluster.nvlink_islands, cluster.link(uuid_a, uuid_b)
"""

from orchestrator.topology.islands import NvlinkIsland
from orchestrator.topology.links import LinkKind
from orchestrator.topology.model import (ClusterTopology, Gpu, GpuLink, MigSlice, Nic, NicKind, NodeTopology,
                                         NumaNode)

__all__ = ["ClusterTopology", "Gpu", "GpuLink", "LinkKind", "MigSlice", "Nic", "NicKind", "NodeTopology",
           "NumaNode", "NvlinkIsland", "discover"]


def discover(**kwargs) -> ClusterTopology:
    """Map every alive node of the connected Ray cluster (see orchestrator.topology.discover)."""
    from orchestrator.topology.discover import discover_cluster
    return discover_cluster(**kwargs)
