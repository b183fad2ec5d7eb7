"""What Linux says about this machine: CPUs, memory, NUMA nodes, NICs and PCIe paths.

Everything is read below `root` (normally "/"), so tests build a small fake /sys and /proc.
Missing files mean "the kernel does not say": the answer is a default, never an exception.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from topology.cluster import Nic, NicKind, NumaNode
from topology.links import LinkKind

_PCI_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ARPHRD_INFINIBAND = "32"  # /sys/class/net/*/type of an IPoIB interface


@dataclass(frozen=True, slots=True)
class Host:
    cpu_count: int
    memory_bytes: int
    numa_nodes: list[NumaNode]


def read_host(root: Path) -> Host:
    online = _read(root / "sys/devices/system/cpu/online")
    cpu_count = len(parse_cpu_list(online)) if online else (os.cpu_count() or 0)
    return Host(cpu_count=cpu_count, memory_bytes=_meminfo_total(root / "proc/meminfo", "MemTotal:"),
                numa_nodes=_numa_nodes(root))


def _numa_nodes(root: Path) -> list[NumaNode]:
    nodes = []
    base = root / "sys/devices/system/node"
    for path in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        numa_id = int(path.name[4:])
        nodes.append(NumaNode(numa_id=numa_id, cpus=_read(path / "cpulist"),
                              memory_bytes=_meminfo_total(path / "meminfo", f"Node {numa_id} MemTotal:")))
    return nodes


def _meminfo_total(path: Path, label: str) -> int:
    for line in _read(path).splitlines():
        if line.startswith(label):
            return int(line[len(label):].split()[0]) * 1024  # the kernel writes kB
    return 0


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8,10-11" → [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] → "0-3,8"."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


# ---- PCI devices ---------------------------------------------------------------------------------
def pci_numa_node(root: Path, bus_id: str) -> int | None:
    text = _read(root / "sys/bus/pci/devices" / bus_id / "numa_node")
    return int(text) if text.lstrip("-").isdigit() and int(text) >= 0 else None


def pci_local_cpus(root: Path, bus_id: str) -> str:
    return _read(root / "sys/bus/pci/devices" / bus_id / "local_cpulist")


def pcie_path(root: Path, bus_a: str, bus_b: str, numa_a: int | None, numa_b: int | None) -> LinkKind | None:
    """The nvidia-smi relationship (PIX/PXB/PHB/NODE/SYS) of two PCI devices, from their sysfs paths.

    A device's real path lists the host bridge (pci0000:17) and every bridge above it. Below one
    host bridge, the paths part at the deepest shared bridge: one switch between them is PIX, more
    is PXB, none (they part at the root) is PHB. Different host bridges: NODE on one NUMA node, SYS
    across nodes.
    """
    chain_a, chain_b = _pci_chain(root, bus_a), _pci_chain(root, bus_b)
    if not chain_a or not chain_b:
        return None
    if chain_a[0] != chain_b[0]:
        if numa_a is None or numa_b is None:
            return None
        return LinkKind.SAME_SOCKET if numa_a == numa_b else LinkKind.CROSS_SOCKET
    shared = 0
    while shared < min(len(chain_a), len(chain_b)) and chain_a[shared] == chain_b[shared]:
        shared += 1
    if shared == 1:
        return LinkKind.HOST_BRIDGE
    # Under one switch: upstream port shared, each device one downstream port below it (2 hops).
    below = max(len(chain_a), len(chain_b)) - shared
    return LinkKind.PCIE_SWITCH if below <= 2 else LinkKind.PCIE_SWITCHES


def _pci_chain(root: Path, bus_id: str) -> list[str]:
    """["pci0000:17", "0000:17:01.0", "0000:18:00.0", …] for a device, [] when sysfs lacks it."""
    link = root / "sys/bus/pci/devices" / bus_id
    if not link.exists():
        return []
    parts = Path(os.path.realpath(link)).parts
    start = next((i for i, part in enumerate(parts) if part.startswith("pci")), None)
    return list(parts[start:]) if start is not None else []


# ---- NICs ----------------------------------------------------------------------------------------
def read_nics(root: Path) -> list[Nic]:
    """RDMA devices (InfiniBand, RoCE) from /sys/class/infiniband, then the physical network
    interfaces in /sys/class/net that no RDMA device already accounts for."""
    nics = _rdma_nics(root)
    claimed = {nic.netdev for nic in nics}
    for path in sorted((root / "sys/class/net").glob("*")):
        if path.name in claimed or not (path / "device").exists():
            continue  # loopback, bridges, veth and other virtual interfaces have no device
        if _read(path / "type") == _ARPHRD_INFINIBAND:
            continue  # IPoIB on an RDMA device listed above
        speed_mbit = _read(path / "speed")
        pci = _pci_id(path / "device")
        nics.append(Nic(name=path.name, kind=NicKind.ETHERNET,
                        speed_gbit_per_s=int(speed_mbit) / 1000 if speed_mbit.isdigit() else 0.0,
                        numa_node=pci_numa_node(root, pci) if pci else None, pci_bus_id=pci,
                        up=_read(path / "operstate") == "up"))
    return nics


def _rdma_nics(root: Path) -> list[Nic]:
    nics = []
    for device in sorted((root / "sys/class/infiniband").glob("*")):
        ports = sorted((device / "ports").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0)
        pci = _pci_id(device / "device")
        netdevs = sorted(p.name for p in (device / "device/net").glob("*"))
        for port in ports:
            rate = _read(port / "rate").split()
            ethernet = _read(port / "link_layer").lower() == "ethernet"
            nics.append(Nic(name=device.name if len(ports) == 1 else f"{device.name}:{port.name}",
                            kind=NicKind.ROCE if ethernet else NicKind.INFINIBAND,
                            speed_gbit_per_s=float(rate[0]) if rate and _is_number(rate[0]) else 0.0,
                            numa_node=pci_numa_node(root, pci) if pci else None, pci_bus_id=pci,
                            netdev=netdevs[0] if netdevs else "",
                            up=_read(port / "state").endswith("ACTIVE")))
    return nics


def _pci_id(device_link: Path) -> str:
    if not device_link.exists():
        return ""
    name = Path(os.path.realpath(device_link)).name
    return name if _PCI_ID.match(name) else ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or unreadable (speed of a link that is down raises EINVAL)
        return ""
