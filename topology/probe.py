"""Map the machine this runs on: NVML for GPUs, MIG slices and links, sysfs for NICs and NUMA.

    node = probe_local_node(bench=DeviceBench.from_environment())   # `archipelago topology --local`, the live map
    node = probe_local_node()                       # without measured device figures (`node-resources`)
    node = probe_local_node(nvml_module=fake_nvml)  # tests

No NVML or no GPUs gives a CPU-only node with a note, not an error. An NVML error on one GPU is
written on that GPU (`Gpu.error`) and the rest of the node is still mapped.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from types import ModuleType

from topology import catalog, sysfs
from topology.cluster import Gpu, GpuLink, MigSlice, NodeTopology
from topology.device_figures import DeviceBench
from topology.links import LinkKind, nvlink_cost, pcie_cost, pcie_gb_per_s
from topology.nvml import NvlinkPort, Nvml

_PCIE_PATH_BY_NVML_LEVEL = {
    0: LinkKind.PCIE_SWITCH,     # NVML_TOPOLOGY_INTERNAL: two GPUs on one board
    10: LinkKind.PCIE_SWITCH,    # SINGLE: one PCIe switch
    20: LinkKind.PCIE_SWITCHES,  # MULTIPLE: several switches, no host bridge
    30: LinkKind.HOST_BRIDGE,    # HOSTBRIDGE
    40: LinkKind.SAME_SOCKET,    # NODE (also NVML_TOPOLOGY_CPU)
    50: LinkKind.CROSS_SOCKET,   # SYSTEM
}


@dataclass(slots=True)
class _ReadGpu:
    """A GPU as read, with the NVML handle and NVLink ports the pairwise pass needs."""
    gpu: Gpu
    handle: object = None
    ports: list[NvlinkPort] | None = None


def probe_local_node(*, nvml_module: ModuleType | None = None, root: Path = Path("/"), hostname: str = "",
                     visible_devices: str | None = None, bench: DeviceBench | None = None) -> NodeTopology:
    """`visible_devices` defaults to CUDA_VISIBLE_DEVICES: a Ray node started with it owns only those GPUs.
    `bench` measures the node's devices (or reads its cached figures) into `node.measured`."""
    hostname = hostname or socket.gethostname()
    if visible_devices is None:
        visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    host = sysfs.read_host(root)
    node = NodeTopology(node_id=hostname, hostname=hostname, cpu_count=host.cpu_count,
                        memory_bytes=host.memory_bytes, numa_nodes=host.numa_nodes, nics=sysfs.read_nics(root),
                        source="nvml")
    nvml, why_not = Nvml.open(nvml_module)
    if nvml is None:
        node.notes.append(f"no GPUs mapped: {why_not}")
    else:
        try:
            _map_gpus(nvml, node, root, visible_devices)
        finally:
            nvml.close()
        _add_nic_paths(node, root)
    if bench is not None:
        node.measured, notes = bench.figures(node)
        node.notes.extend(notes)
    return node


def _map_gpus(nvml: Nvml, node: NodeTopology, root: Path, visible_devices: str | None) -> None:
    node.driver_version = nvml.driver_version()
    count = nvml.gpu_count()
    read = [_read_gpu(nvml, index, node, root) for index in range(count)]
    read = _visible(read, visible_devices, node)
    if not read:
        node.notes.append("NVML found no GPUs" if not count else "CUDA_VISIBLE_DEVICES hides every GPU")
    node.gpus = [r.gpu for r in read]
    for r in read:
        if r.gpu.mig_enabled and not r.gpu.error:
            _guarded(nvml, r, lambda: node.mig_slices.extend(_mig_slices(nvml, r)), "reading MIG devices")
    good = [r for r in read if not r.gpu.error]
    for a, b in combinations(good, 2):
        try:
            node.links.append(_link(nvml, a, b))
        except nvml.Error as e:
            node.notes.append(f"no link between GPU {a.gpu.index} and GPU {b.gpu.index}: NVML {e}")


def _read_gpu(nvml: Nvml, index: int, node: NodeTopology, root: Path) -> _ReadGpu:
    r = _ReadGpu(gpu=Gpu(uuid=f"unreadable-{node.node_id}-gpu{index}", index=index, name=""))
    try:
        r.handle = nvml.handle(index)
        r.gpu.uuid = nvml.uuid(r.handle)
    except nvml.Error as e:
        r.gpu.error = f"NVML {e} (reading the UUID)"
        return r
    _guarded(nvml, r, lambda: _fill_gpu(nvml, r, node, root), "reading the GPU")
    return r


def _fill_gpu(nvml: Nvml, r: _ReadGpu, node: NodeTopology, root: Path) -> None:
    gpu, handle = r.gpu, r.handle
    gpu.name = nvml.name(handle)
    model = catalog.lookup(gpu.name)
    gpu.model = model.key if model else ""
    gpu.pci_bus_id = nvml.pci_bus_id(handle)
    gpu.memory_bytes = nvml.memory_bytes(handle)
    gpu.sm_count = nvml.sm_count(handle) or (model.sm_count if model else 0)
    gpu.compute_capability = nvml.compute_capability(handle) or (model.compute_capability if model else "")
    gpu.numa_node = nvml.numa_node(handle)
    if gpu.numa_node is None:
        gpu.numa_node = sysfs.pci_numa_node(root, gpu.pci_bus_id)
    gpu.cpu_affinity = (sysfs.format_cpu_list(nvml.cpu_affinity(handle, node.cpu_count))
                        or sysfs.pci_local_cpus(root, gpu.pci_bus_id))
    gpu.pcie_generation, gpu.pcie_width = nvml.pcie_link(handle)
    gpu.mig_enabled = nvml.mig_enabled(handle)
    gpu.peak_tflops = dict(model.peak_tflops) if model else {}
    r.ports = nvml.nvlink_ports(handle)
    if any(port.remote_is_switch for port in r.ports):
        gpu.nvlink_domain = nvml.fabric_domain(handle)
    if model is None:
        node.notes.append(f"GPU {gpu.index} ({gpu.name}) is not in the device catalog: no peak TFLOP/s")
    if gpu.mig_enabled and r.ports:
        node.notes.append(f"GPU {gpu.index} is in MIG mode: its {len(r.ports)} NVLinks carry no traffic")


def _guarded(nvml: Nvml, r: _ReadGpu, read, what: str) -> None:
    """Run NVML reads for one GPU; an NVML error marks that GPU instead of failing the node."""
    try:
        read()
    except nvml.Error as e:
        r.gpu.error = f"NVML {e} ({what})"


def _visible(read: list[_ReadGpu], visible_devices: str | None, node: NodeTopology) -> list[_ReadGpu]:
    """Keep the GPUs CUDA_VISIBLE_DEVICES names: UUIDs or UUID prefixes, or indices read in PCI order."""
    if visible_devices is None:
        return read
    wanted = [item.strip() for item in visible_devices.split(",") if item.strip()]
    kept = []
    for item in wanted:
        if item.isdigit():
            match = [r for r in read if r.gpu.index == int(item)]
        else:
            match = [r for r in read if r.gpu.uuid.startswith(item)]
        kept.extend(r for r in match if r not in kept)
    if any(item.isdigit() for item in wanted):
        node.notes.append("CUDA_VISIBLE_DEVICES lists indices, read here in PCI bus order; list GPU UUIDs to be exact")
    if len(kept) < len(read):
        node.notes.append(f"CUDA_VISIBLE_DEVICES={visible_devices} gives this node {len(kept)} of {len(read)} GPUs")
    return kept


def _mig_slices(nvml: Nvml, r: _ReadGpu) -> list[MigSlice]:
    parent = r.gpu
    model = catalog.lookup(parent.name)
    slices = []
    for handle in nvml.mig_devices(r.handle):
        name = nvml.name(handle)  # "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
        profile = name.rsplit("MIG ", 1)[-1].strip() if "MIG " in name else ""
        sm_count = nvml.sm_count(handle)
        if sm_count and parent.sm_count:
            share = sm_count / parent.sm_count
        elif profile and model and model.mig_slices:
            share = catalog.mig_profile(profile).sm_share(model.mig_slices)
        else:
            share = 0.0
        gpu_instance, compute_instance = nvml.mig_instance_ids(handle)
        slices.append(MigSlice(uuid=nvml.uuid(handle), parent_uuid=parent.uuid, profile=profile,
                               memory_bytes=nvml.memory_bytes(handle), sm_count=sm_count, sm_share=round(share, 4),
                               gpu_instance_id=gpu_instance, compute_instance_id=compute_instance,
                               peak_tflops=catalog.scaled_peaks(parent.peak_tflops, share)))
    return slices


def _link(nvml: Nvml, a: _ReadGpu, b: _ReadGpu) -> GpuLink:
    level = nvml.common_ancestor(a.handle, b.handle)
    pcie_path = _PCIE_PATH_BY_NVML_LEVEL.get(level) if level is not None else None
    slower_pcie = min(pcie_gb_per_s(g.pcie_generation, g.pcie_width or 16) for g in (a.gpu, b.gpu))
    if not (a.gpu.mig_enabled or b.gpu.mig_enabled):
        direct = sum(1 for port in a.ports or [] if port.remote_pci_bus_id == b.gpu.pci_bus_id)
        switched = min(sum(port.remote_is_switch for port in r.ports or []) for r in (a, b))
        same_fabric = a.gpu.nvlink_domain == b.gpu.nvlink_domain
        kind, count = ((LinkKind.NVLINK, direct) if direct
                       else (LinkKind.NVSWITCH, switched) if switched and same_fabric else (None, 0))
        if kind is not None:
            generation = catalog.nvlink_generation(catalog.lookup(a.gpu.name), a.gpu.compute_capability)
            bandwidth, latency = nvlink_cost(kind, count, generation)
            return GpuLink(gpu_a=a.gpu.uuid, gpu_b=b.gpu.uuid, kind=kind, pcie_path=pcie_path, nvlink_count=count,
                           nvlink_generation=generation, bandwidth_gb_per_s=bandwidth, latency_us=latency)
    peer_to_peer = pcie_path is not None and not (a.gpu.mig_enabled or b.gpu.mig_enabled) \
        and nvml.p2p_readable(a.handle, b.handle)
    kind = pcie_path if peer_to_peer else LinkKind.HOST_MEMORY
    bandwidth, latency = pcie_cost(kind, slower_pcie)
    return GpuLink(gpu_a=a.gpu.uuid, gpu_b=b.gpu.uuid, kind=kind, pcie_path=pcie_path,
                   bandwidth_gb_per_s=bandwidth, latency_us=latency)


def _add_nic_paths(node: NodeTopology, root: Path) -> None:
    for nic in node.nics:
        if not nic.pci_bus_id:
            continue
        for gpu in node.gpus:
            if gpu.pci_bus_id:
                path = sysfs.pcie_path(root, nic.pci_bus_id, gpu.pci_bus_id, nic.numa_node, gpu.numa_node)
                if path is not None:
                    nic.gpu_paths[gpu.uuid] = path
