"""The cluster topology map: what GPUs, MIG slices, NVLink islands, PCIe/NUMA paths and NICs each
Ray node has, as one plain object (`ClusterTopology`) that prints, saves as JSON and loads back.

    import topology
    cluster = topology.discover_cluster()                          # one probe task per alive Ray node
    cluster = topology.discover_cluster(address="auto", timeout_s=300)     # connect for the probes only
    cluster = topology.ClusterTopology.load("examples/topologies/h200-single.json")
    cluster = topology.load_files(["node-a.txt", "node-b.txt"])   # `nvidia-smi -L; nvidia-smi topo -m` texts
    cluster = topology.machines.cluster([("8xH100-SXM", 4), ("8xL40S", 2)])    # for tests and simulation
    cluster.nvlink_islands, cluster.link(uuid_a, uuid_b)
"""

from topology.cluster import ClusterTopology, Gpu, GpuLink, MigSlice, Nic, NicKind, NodeTopology, NumaNode
from topology.discover import discover_cluster
from topology.files import load_files
from topology.islands import NvlinkIsland
from topology.links import LinkKind

__all__ = ["ClusterTopology", "Gpu", "GpuLink", "LinkKind", "MigSlice", "Nic", "NicKind", "NodeTopology",
           "NumaNode", "NvlinkIsland", "discover_cluster", "load_files"]

