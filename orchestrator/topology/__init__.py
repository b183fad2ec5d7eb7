"""The cluster topology map: what GPUs, MIG slices, NVLink islands, PCIe/NUMA paths and NICs each
Ray node has, as one plain object (`ClusterTopology`) that prints, saves as JSON and loads back.

    from orchestrator import topology
    cluster = topology.discover_cluster()                          # one probe task per alive Ray node
    cluster = topology.ClusterTopology.load("examples/topologies/h200-single.json")
    cluster = topology.machines.cluster([("8xH100-SXM", 4), ("8xL40S", 2)])    # for tests and simulation
    cluster.nvlink_islands, cluster.link(uuid_a, uuid_b)
"""

from orchestrator.topology.islands import NvlinkIsland
from orchestrator.topology.links import LinkKind
from orchestrator.topology.model import (ClusterTopology, Gpu, GpuLink, MigSlice, Nic, NicKind, NodeTopology,
                                         NumaNode)

__all__ = ["ClusterTopology", "Gpu", "GpuLink", "LinkKind", "MigSlice", "Nic", "NicKind", "NodeTopology",
           "NumaNode", "NvlinkIsland", "discover_cluster"]


# Not named `discover`: that is the submodule's name, and importing the submodule anywhere rebinds
# the package attribute to it.
def discover_cluster(**kwargs) -> ClusterTopology:
    """Map every alive node of the connected Ray cluster (see orchestrator.topology.discover)."""
    from orchestrator.topology import discover
    return discover.discover_cluster(**kwargs)
