"""Generated topologies of common machines and mixed clusters, for tests and planner simulation.

    machines.node("8xH100-SXM", "h100-0")                    # one DGX/HGX H100 box
    machines.cluster("8xH100-SXM:128,8xL40S:64,1xH100-MIG7:4")  # 196 nodes, 1,540 GPUs and slices
    archipelago topology --generate 8xA100-SXM:2 --png a100.png

Layouts follow the vendors' reference designs: two GPUs (and one NIC) per PCIe switch, GPUs split
evenly over the sockets, NVLink as NVSwitch, bridged pairs, or the DGX-1 hybrid cube mesh. UUIDs
are made up but stable (`stable_uuid`), so a generated cluster is the same on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import TopologyError
from topology import catalog
from topology.cluster import ClusterTopology, Gpu, GpuLink, MigSlice, Nic, NicKind, NodeTopology, NumaNode, stable_uuid
from topology.links import LinkKind, nvlink_cost, pcie_cost, pcie_gb_per_s

# DGX-1 (8×V100 SXM2) hybrid cube mesh: NVLinks between each pair, 6 per GPU; 0 = no NVLink.
_HYBRID_CUBE_MESH = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)


@dataclass(frozen=True, slots=True)
class Machine:
    model: str
    """Catalog key of its GPUs."""
    gpus: int
    nvlink: str
    """"nvswitch", "pairs" (bridged 0-1, 2-3, …), "hybrid-cube-mesh", or "none"."""
    sockets: int
    cpus_per_socket: int
    memory_gib_per_socket: int
    gpus_per_pcie_switch: int
    rdma_nics: int = 0
    """One per PCIe switch, from the first, each shared by that switch's GPUs."""
    rdma_kind: NicKind = NicKind.INFINIBAND
    rdma_gbit_per_s: float = 0.0
    ethernet_gbit_per_s: float = 100.0
    mig_profile: str = ""
    """When set, every GPU is in MIG mode, split into as many slices of this profile as fit."""


MACHINES: dict[str, Machine] = {
    "8xH100-SXM": Machine(model="H100-SXM5-80GB", gpus=8, nvlink="nvswitch", sockets=2, cpus_per_socket=112,
                          memory_gib_per_socket=1024, gpus_per_pcie_switch=2, rdma_nics=4, rdma_gbit_per_s=400.0),
    "8xH200": Machine(model="H200-SXM5-141GB", gpus=8, nvlink="nvswitch", sockets=2, cpus_per_socket=112,
                      memory_gib_per_socket=1024, gpus_per_pcie_switch=1, rdma_nics=8, rdma_gbit_per_s=400.0),
    "8xA100-SXM": Machine(model="A100-SXM4-80GB", gpus=8, nvlink="nvswitch", sockets=2, cpus_per_socket=128,
                          memory_gib_per_socket=1024, gpus_per_pcie_switch=2, rdma_nics=4, rdma_gbit_per_s=200.0),
    "8xL40S": Machine(model="L40S", gpus=8, nvlink="none", sockets=2, cpus_per_socket=64, memory_gib_per_socket=512,
                      gpus_per_pcie_switch=2, rdma_nics=4, rdma_kind=NicKind.ROCE, rdma_gbit_per_s=200.0),
    "4xA100-PCIE-bridged": Machine(model="A100-PCIE-80GB", gpus=4, nvlink="pairs", sockets=2, cpus_per_socket=64,
                                   memory_gib_per_socket=512, gpus_per_pcie_switch=1),
    "8xV100-SXM2": Machine(model="V100-SXM2-32GB", gpus=8, nvlink="hybrid-cube-mesh", sockets=2, cpus_per_socket=40,
                           memory_gib_per_socket=256, gpus_per_pcie_switch=2, rdma_nics=4, rdma_gbit_per_s=100.0),
    "1xH100-MIG7": Machine(model="H100-SXM5-80GB", gpus=1, nvlink="none", sockets=1, cpus_per_socket=32,
                           memory_gib_per_socket=256, gpus_per_pcie_switch=1, mig_profile="1g.10gb"),
    "1xH200": Machine(model="H200-SXM5-141GB", gpus=1, nvlink="none", sockets=1, cpus_per_socket=16,
                      memory_gib_per_socket=128, gpus_per_pcie_switch=1),
    "4xL4": Machine(model="L4", gpus=4, nvlink="none", sockets=1, cpus_per_socket=48, memory_gib_per_socket=192,
                    gpus_per_pcie_switch=2, ethernet_gbit_per_s=40.0),
    "8xA10G": Machine(model="A10G", gpus=8, nvlink="none", sockets=2, cpus_per_socket=96, memory_gib_per_socket=384,
                      gpus_per_pcie_switch=2),
    "1xA10G": Machine(model="A10G", gpus=1, nvlink="none", sockets=1, cpus_per_socket=4, memory_gib_per_socket=16,
                      gpus_per_pcie_switch=1, ethernet_gbit_per_s=10.0),
}


def node(machine_name: str, node_id: str) -> NodeTopology:
    machine = _machine(machine_name)
    model = catalog.by_key(machine.model)
    per_socket = max(1, machine.gpus // machine.sockets)
    sockets = [min(i // per_socket, machine.sockets - 1) for i in range(machine.gpus)]
    switches = [i // machine.gpus_per_pcie_switch for i in range(machine.gpus)]
    numa = [NumaNode(numa_id=s, cpus=f"{s * machine.cpus_per_socket}-{(s + 1) * machine.cpus_per_socket - 1}",
                     memory_bytes=machine.memory_gib_per_socket * 2**30) for s in range(machine.sockets)]
    gpus = [Gpu(uuid=stable_uuid("GPU", node_id, i), index=i, name=model.nvml_name, model=model.key,
                pci_bus_id=f"0000:{0x18 + 0x10 * i:02x}:00.0", memory_bytes=model.memory_mib * 2**20,
                sm_count=model.sm_count, compute_capability=model.compute_capability, numa_node=sockets[i],
                cpu_affinity=numa[sockets[i]].cpus, pcie_generation=model.pcie_generation, pcie_width=16,
                mig_enabled=bool(machine.mig_profile), peak_tflops=dict(model.peak_tflops))
            for i in range(machine.gpus)]
    result = NodeTopology(node_id=node_id, hostname=node_id, cpu_count=machine.sockets * machine.cpus_per_socket,
                          memory_bytes=machine.sockets * machine.memory_gib_per_socket * 2**30, numa_nodes=numa,
                          gpus=gpus, source="generated")
    result.mig_slices = [s for gpu in gpus for s in _mig_slices(machine, model, gpu, node_id)]
    result.links = [_link(machine, model, gpus[a], gpus[b], _pcie_path(a, b, switches, sockets))
                    for a in range(machine.gpus) for b in range(a + 1, machine.gpus)]
    result.nics = _nics(machine, gpus, switches, sockets)
    return result


def cluster(spec: str | list[tuple[str, int]]) -> ClusterTopology:
    """A mixed cluster: "8xH100-SXM:4,8xL40S:2" or [("8xH100-SXM", 4), ("8xL40S", 2)]."""
    counts = parse_spec(spec) if isinstance(spec, str) else spec
    nodes = [node(name, f"{name.lower()}-{k}") for name, count in counts for k in range(count)]
    return ClusterTopology(nodes=nodes)


def parse_spec(spec: str) -> list[tuple[str, int]]:
    counts = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, count = part.partition(":")
        _machine(name)
        if not (count or "1").isdigit() or int(count or "1") < 1:
            raise TopologyError(f"node count {count!r} in {part!r} is not a positive whole number",
                                where="--generate", fix="write MACHINE:COUNT, e.g. 8xH100-SXM:4")
        counts.append((name, int(count or "1")))
    if not counts:
        raise TopologyError("names no machines", where="--generate", fix="e.g. --generate 8xH100-SXM:4,8xL40S:2")
    return counts


def _machine(name: str) -> Machine:
    try:
        return MACHINES[name]
    except KeyError:
        raise TopologyError(f"unknown machine {name!r}", where="--generate",
                            fix=f"use one of: {', '.join(MACHINES)}") from None


def _pcie_path(a: int, b: int, switches: list[int], sockets: list[int]) -> LinkKind:
    if switches[a] == switches[b]:
        return LinkKind.PCIE_SWITCH
    return LinkKind.SAME_SOCKET if sockets[a] == sockets[b] else LinkKind.CROSS_SOCKET


def _nvlinks(machine: Machine, model: catalog.GpuModel, a: int, b: int) -> tuple[LinkKind | None, int]:
    if machine.mig_profile:
        return None, 0  # MIG slices have no NVLink
    if machine.nvlink == "nvswitch":
        return LinkKind.NVSWITCH, model.nvlink_links
    if machine.nvlink == "pairs" and a ^ 1 == b:
        return LinkKind.NVLINK, model.nvlink_links
    if machine.nvlink == "hybrid-cube-mesh" and _HYBRID_CUBE_MESH[a][b]:
        return LinkKind.NVLINK, _HYBRID_CUBE_MESH[a][b]
    return None, 0


def _link(machine: Machine, model: catalog.GpuModel, a: Gpu, b: Gpu, pcie_path: LinkKind) -> GpuLink:
    kind, count = _nvlinks(machine, model, a.index, b.index)
    if kind is not None:
        bandwidth, latency = nvlink_cost(kind, count, model.nvlink_generation)
        return GpuLink(gpu_a=a.uuid, gpu_b=b.uuid, kind=kind, pcie_path=pcie_path, nvlink_count=count,
                       nvlink_generation=model.nvlink_generation, bandwidth_gb_per_s=bandwidth, latency_us=latency)
    kind = LinkKind.HOST_MEMORY if machine.mig_profile else pcie_path
    bandwidth, latency = pcie_cost(kind, pcie_gb_per_s(model.pcie_generation, 16))
    return GpuLink(gpu_a=a.uuid, gpu_b=b.uuid, kind=kind, pcie_path=pcie_path, bandwidth_gb_per_s=bandwidth,
                   latency_us=latency)


def _mig_slices(machine: Machine, model: catalog.GpuModel, gpu: Gpu, node_id: str) -> list[MigSlice]:
    if not machine.mig_profile:
        return []
    if machine.mig_profile not in model.mig_profiles:
        raise TopologyError(f"{model.key} has no MIG profile {machine.mig_profile!r}", where=node_id,
                            fix=f"use one of: {', '.join(model.mig_profiles)}")
    profile = catalog.mig_profile(machine.mig_profile)
    share = profile.sm_share(model.mig_slices)
    memory = gpu.memory_bytes * profile.memory_gb // catalog.full_gpu_memory_gb(model)
    return [MigSlice(uuid=stable_uuid("MIG", node_id, gpu.index, k), parent_uuid=gpu.uuid, profile=profile.name,
                     memory_bytes=memory, sm_share=round(share, 4),
                     gpu_instance_id=k + 1, compute_instance_id=0,
                     peak_tflops=catalog.scaled_peaks(gpu.peak_tflops, share))
            for k in range(model.mig_slices // profile.compute_slices)]


def _nics(machine: Machine, gpus: list[Gpu], switches: list[int], sockets: list[int]) -> list[Nic]:
    nics = []
    for k in range(machine.rdma_nics):
        on_switch = switches.index(k * len(set(switches)) // machine.rdma_nics)
        nics.append(Nic(name=f"mlx5_{k}", kind=machine.rdma_kind, speed_gbit_per_s=machine.rdma_gbit_per_s,
                        numa_node=sockets[on_switch], pci_bus_id=f"0000:{0x1a + 0x10 * on_switch:02x}:00.0",
                        netdev=f"ib{k}" if machine.rdma_kind == NicKind.INFINIBAND else f"ens{k}np0",
                        gpu_paths={gpu.uuid: _pcie_path(on_switch, gpu.index, switches, sockets) for gpu in gpus}))
    nics.append(Nic(name="eno1", kind=NicKind.ETHERNET, speed_gbit_per_s=machine.ethernet_gbit_per_s, numa_node=0,
                    pci_bus_id="0000:03:00.0",
                    gpu_paths={gpu.uuid: LinkKind.SAME_SOCKET if sockets[gpu.index] == 0 else LinkKind.CROSS_SOCKET
                               for gpu in gpus}))
    return nics
