"""Which NICs NCCL should use for a GPU: the nearest ones by the node's PCIe map.

    nccl_environment(node, "GPU-…")   # {"NCCL_IB_HCA": "=mlx5_0", "NCCL_SOCKET_IFNAME": "=ens1f0"}

NCCL picks NICs itself, but on nodes with several NICs and GPUs it can pick one across the CPU
sockets (every byte then crosses the socket link as well as the network). Naming the NICs under
the same PCIe switch as each worker's GPU keeps GPUDirect RDMA on the shortest path. "=" asks NCCL
for exact names (mlx5_1 would otherwise also match mlx5_10, mlx5_11, …).
"""

from __future__ import annotations

from topology.cluster import Nic, NicKind, NodeTopology
from topology.links import PCIE_PATHS, LinkKind

RDMA = (NicKind.INFINIBAND, NicKind.ROCE)


def nccl_environment(node: NodeTopology, gpu_uuid: str) -> dict[str, str]:
    """NCCL_IB_HCA naming the RDMA NICs nearest the GPU, NCCL_SOCKET_IFNAME the nearest network
    interfaces (for NCCL's socket transport and bootstrap); a variable is left out when the node has
    no such NIC up or the map does not say how far they are."""
    numa = next((gpu.numa_node for gpu in node.gpus if gpu.uuid == gpu_uuid), None)
    up = [nic for nic in node.nics if nic.up]
    environment = {}
    hcas = _nearest([nic for nic in up if nic.kind in RDMA], gpu_uuid, numa)
    if hcas:
        environment["NCCL_IB_HCA"] = "=" + ",".join(nic.name for nic in hcas)
    interfaces = _nearest([nic for nic in up if nic.kind == NicKind.ETHERNET or nic.netdev], gpu_uuid, numa)
    if interfaces:
        environment["NCCL_SOCKET_IFNAME"] = "=" + ",".join(nic.netdev or nic.name for nic in interfaces)
    return environment


def _nearest(nics: list[Nic], gpu_uuid: str, numa: int | None) -> list[Nic]:
    """The NICs at the shortest PCIe distance from the GPU (its NUMA node's when the map has no paths)."""
    distance = {nic.name: _distance(nic, gpu_uuid, numa) for nic in nics}
    known = [d for d in distance.values() if d is not None]
    if not known:
        return []
    return [nic for nic in nics if distance[nic.name] == min(known)]


def _distance(nic: Nic, gpu_uuid: str, numa: int | None) -> int | None:
    path = nic.gpu_paths.get(gpu_uuid)
    if path in PCIE_PATHS:
        return PCIE_PATHS.index(path)
    if numa is not None and nic.numa_node is not None:
        return PCIE_PATHS.index(LinkKind.SAME_SOCKET if nic.numa_node == numa else LinkKind.CROSS_SOCKET)
    return None
