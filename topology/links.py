"""How two GPUs (or two nodes) are connected, and what that connection is nominally worth.

The bandwidths and latencies here are nominal planning figures, one direction, for a bulk
transfer between two devices: NVLink by link count and generation, PCIe by generation and
width discounted by how many bridges a path crosses, host-memory staging, and the network.
They rank paths correctly and are the right order of magnitude; a measured table (nccl-tests)
is what should replace them where one exists.
"""

from __future__ import annotations

from enum import StrEnum


class LinkKind(StrEnum):
    NVSWITCH = "nvswitch"
    """NVLink through an NVSwitch fabric: every GPU reaches every other at its full link count."""
    NVLINK = "nvlink"
    """Direct NVLink between two GPUs (a bridge or a point-to-point mesh)."""
    PCIE_SWITCH = "pcie_switch"
    """PCIe peer-to-peer under one PCIe switch (nvidia-smi PIX)."""
    PCIE_SWITCHES = "pcie_switches"
    """PCIe peer-to-peer across several switches, below one host bridge (PXB)."""
    HOST_BRIDGE = "host_bridge"
    """PCIe peer-to-peer through the CPU's host bridge (PHB)."""
    SAME_SOCKET = "same_socket"
    """PCIe between host bridges of one NUMA node (NODE)."""
    CROSS_SOCKET = "cross_socket"
    """PCIe across the inter-socket link, QPI/UPI/Infinity Fabric (SYS, formerly SOC)."""
    HOST_MEMORY = "host_memory"
    """No peer-to-peer: copies are staged through host memory. Always the case for MIG slices."""
    NETWORK = "network"
    """Between nodes, over their NICs."""

    @property
    def is_nvlink(self) -> bool:
        return self in (LinkKind.NVSWITCH, LinkKind.NVLINK)


PCIE_PATHS = (LinkKind.PCIE_SWITCH, LinkKind.PCIE_SWITCHES, LinkKind.HOST_BRIDGE, LinkKind.SAME_SOCKET,
              LinkKind.CROSS_SOCKET)
"""The kinds that name a PCIe relationship, nearest first."""

NVIDIA_SMI_PCIE_CODES = {
    "PIX": LinkKind.PCIE_SWITCH,
    "PXB": LinkKind.PCIE_SWITCHES,
    "PHB": LinkKind.HOST_BRIDGE,
    "NODE": LinkKind.SAME_SOCKET,
    "SYS": LinkKind.CROSS_SOCKET,
    "SOC": LinkKind.CROSS_SOCKET,  # drivers before ~R384 printed SOC for what is now SYS
}

NVLINK_GB_PER_S_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
"""One direction, per link, by NVLink generation (P100, V100, A100, H100/H200, B200)."""

_PCIE_GB_PER_S_X16 = {1: 3.2, 2: 6.4, 3: 13.0, 4: 26.0, 5: 52.0, 6: 104.0}
"""Achievable one-direction bandwidth of an x16 link, about 82% of the raw rate."""

# (share of the slower GPU's PCIe bandwidth, latency in microseconds) by path; each bridge and
# the inter-socket link cost a little bandwidth and latency, host staging costs two copies.
_PCIE_PATH_COST = {
    LinkKind.PCIE_SWITCH: (1.0, 1.5),
    LinkKind.PCIE_SWITCHES: (0.9, 2.0),
    LinkKind.HOST_BRIDGE: (0.8, 2.5),
    LinkKind.SAME_SOCKET: (0.7, 3.0),
    LinkKind.CROSS_SOCKET: (0.5, 4.5),
    LinkKind.HOST_MEMORY: (0.45, 9.0),
}
_NVLINK_LATENCY_US = {LinkKind.NVLINK: 1.0, LinkKind.NVSWITCH: 1.3}
NETWORK_LATENCY_US = {"infiniband": 2.5, "roce": 4.0, "ethernet": 25.0}
"""One small message, node to node, by NIC kind (RDMA verbs for InfiniBand and RoCE, TCP otherwise)."""


def nvlink_gb_per_s(count: int, generation: int) -> float:
    """An unknown generation counts as the slowest; one newer than the table as the fastest known."""
    newest = max(NVLINK_GB_PER_S_PER_LINK)
    per_link = NVLINK_GB_PER_S_PER_LINK.get(min(generation, newest), NVLINK_GB_PER_S_PER_LINK[1])
    return count * per_link


def pcie_gb_per_s(generation: int, width: int) -> float:
    """One direction; an unknown generation counts as the slowest in common use (gen 3)."""
    return _PCIE_GB_PER_S_X16.get(generation, _PCIE_GB_PER_S_X16[3]) * max(width, 1) / 16


def nvlink_cost(kind: LinkKind, count: int, generation: int) -> tuple[float, float]:
    """(bandwidth_gb_per_s, latency_us) of `count` NVLinks of `generation`."""
    return nvlink_gb_per_s(count, generation), _NVLINK_LATENCY_US[kind]


def pcie_cost(kind: LinkKind, slower_pcie_gb_per_s: float) -> tuple[float, float]:
    """(bandwidth_gb_per_s, latency_us) of a PCIe path or host-memory staging between two GPUs."""
    share, latency_us = _PCIE_PATH_COST[kind]
    return round(share * slower_pcie_gb_per_s, 2), latency_us
