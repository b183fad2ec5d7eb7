"""The cluster topology map: what GPUs, MIG slices, NVLink islands, PCIe/NUMA paths and NICs each
Ray node has, as one plain object (`ClusterTopology`) that prints, saves as JSON and loads back.

    import topology
    from topology.discover import discover_cluster                  # the one part that needs Ray
    cluster = discover_cluster()                                    # one probe task per alive Ray node
    cluster = discover_cluster(address="auto", timeout_s=300)       # connect for the probes only
    cluster = topology.ClusterTopology.load("examples/topologies/h200-single.json")
    cluster = topology.load_files(["node-a.txt", "node-b.txt"])   # `nvidia-smi -L; nvidia-smi topo -m` texts
    cluster = topology.machines.cluster([("8xH100-SXM", 4), ("8xL40S", 2)])    # for tests and simulation
    cluster.nvlink_islands, cluster.link(uuid_a, uuid_b)
"""

# discover_cluster is not re-exported: it imports Ray, and the planner and the workers, which read
# this package, must import without Ray (a worker runs a step without it; the GPU machines have none).
from topology.cluster import ClusterTopology, Gpu, GpuLink, MigSlice, Nic, NicKind, NodeTopology, NumaNode
from topology.files import load_files
from topology.islands import NvlinkIsland
from topology.links import LinkKind

__all__ = ["ClusterTopology", "Gpu", "GpuLink", "LinkKind", "MigSlice", "Nic", "NicKind", "NodeTopology",
           "NumaNode", "NvlinkIsland", "load_files"]

