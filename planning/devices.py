"""What the planner places workers on: devices, grouped into domains of identical, closely linked devices.

    pool = DevicePool.gpus(topology, collectives, dtype="bf16", use_mig=True)      # GPUs and MIG slices
    pool = DevicePool.cpus(topology, collectives, cores_per_worker=4, cpu_gflops_per_core=100.0)  # CPU slots
    pool.domains              # each: one node's devices of one kind that share a fast interconnect

A domain is the unit a hierarchical all-reduce reduces inside: an NVLink island (one GPU model),
the GPUs of one node and model that have no NVLink peers (PCIe), the MIG slices of one node and
profile (host memory), or the CPU worker slots of one node (loopback). Every device of a domain
is interchangeable with every other, which is what lets the planner count instead of enumerate.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from core.plan import DeviceKind
from planning.collectives import CollectiveCostModel, Hop, LinkClass
from topology import catalog
from topology.cluster import ClusterTopology, Gpu, MigSlice, NicKind, NodeTopology
from topology.links import PCIE_PATHS, LinkKind
from topology.sysfs import format_cpu_list, parse_cpu_list

UNKNOWN_NETWORK_GB_PER_S = 1.25
"""A NIC whose speed the kernel does not report is planned as 10 Gbit/s Ethernet (and a note says so)."""


UNKNOWN_GPU_MEMORY_BYTES_PER_S = 2.0e12
"""A GPU the catalog does not know is costed at an A100's memory bandwidth."""
CPU_MEMORY_BYTES_PER_S_PER_CORE = 5e9
"""Nominal: a share of a server socket's ~200 GB/s."""


@dataclass(frozen=True, slots=True)
class DeviceType:
    """What decides a device's speed, memory and price: equal types are interchangeable."""

    kind: DeviceKind
    model: str
    """Price-table key: catalog key, or "cpu"."""
    label: str
    """Shown in plans: the catalog key, with the MIG profile for a slice; "cpu"."""
    peak_tflops: float
    """At the job's compute dtype; for CPU slots, cores × nominal GFLOP/s / 1000."""
    memory_bytes: int
    price_units: float
    """Multiples of the model's hourly price: 1 per GPU, the SM share of a MIG slice, cores of a CPU slot."""
    cores: int = 0
    memory_bytes_per_s: float = UNKNOWN_GPU_MEMORY_BYTES_PER_S
    """Device memory bandwidth (the catalog's; a MIG slice's SM share of it; CPU slots a nominal
    rate per core): what a comm hook's passes over the gradients run at."""


@dataclass(slots=True)
class Device:
    uuid: str | None
    type: DeviceType
    node: NodeTopology
    island_id: str | None
    parent_uuid: str = ""
    """The GPU a MIG slice is cut from."""
    numa_node: int | None = None
    cpu_affinity: str = ""


@dataclass(slots=True)
class Domain:
    domain_id: str
    devices: list[Device]
    intra_hop: Hop | None
    """The slowest hop of a ring over all the domain's devices; None for a domain of one."""
    network_hop: Hop
    """Leaving the node: its NICs together (or one NVLink fabric that spans nodes)."""
    fabric_id: str = ""
    """Set when the domain is an NVLink fabric island spanning nodes: then "node" means the fabric."""
    nvlink: bool = False
    """Whole GPUs joined by NVLink: where tensor-parallel groups may live."""

    @property
    def type(self) -> DeviceType:
        return self.devices[0].type

    @property
    def node_id(self) -> str:
        return self.fabric_id or self.devices[0].node.node_id

    @property
    def size(self) -> int:
        return len(self.devices)

    def class_key(self) -> tuple:
        """Domains with equal keys are interchangeable for every cost the planner computes."""
        intra = None if self.intra_hop is None else (self.intra_hop.link_class, self.intra_hop.bytes_per_s)
        return (self.type, self.size, intra, self.network_hop.link_class, self.network_hop.bytes_per_s, self.nvlink)


@dataclass(slots=True)
class DevicePool:
    domains: list[Domain]
    cross_domain_hops: dict[str, Hop] = field(default_factory=dict)
    """Per node: the slowest hop between two of its domains (PCIe, host memory), for nodes with several."""
    notes: list[str] = field(default_factory=list)
    guessed_networks: set[str] = field(default_factory=set)
    """Nodes whose NIC speed is unknown (planned at UNKNOWN_NETWORK_GB_PER_S): worth a note when a
    plan's reduction leaves one of them."""

    @property
    def device_count(self) -> int:
        return sum(len(domain.devices) for domain in self.domains)

    @classmethod
    def gpus(cls, topology: ClusterTopology, collectives: CollectiveCostModel, *, dtype: str,
             use_mig: bool) -> DevicePool:
        notes: list[str] = []
        networks = {node.node_id: _network_hop(node, collectives) for node in topology.nodes}
        domains = _gpu_domains(topology, collectives, networks, dtype, use_mig)
        by_node: dict[str, list[Domain]] = defaultdict(list)
        for domain in domains:
            by_node[domain.node_id].append(domain)
        cross = {node_id: _slowest_pair(topology, [d.devices[0].uuid for d in node_domains], collectives)
                 for node_id, node_domains in by_node.items() if len(node_domains) > 1}
        unreadable = [f"{node.node_id} GPU {gpu.index}" for node, gpu in topology.gpus() if gpu.error]
        if unreadable:
            notes.append(f"left out {len(unreadable)} GPU(s) NVML could not read: {', '.join(unreadable[:4])}")
        return cls(domains=domains, cross_domain_hops=cross, notes=notes,
                   guessed_networks=_guessed_networks(topology))

    @classmethod
    def cpus(cls, topology: ClusterTopology, collectives: CollectiveCostModel, *, cores_per_worker: int,
             cpu_gflops_per_core: float) -> DevicePool:
        """One slot per `cores_per_worker` cores, inside one NUMA node where the node says which cores those are."""
        domains = []
        for node in topology.nodes:
            slots = _cpu_slots(node, cores_per_worker)
            if not slots:
                continue
            memory = node.memory_bytes // len(slots) if node.memory_bytes else 0
            kind = DeviceType(kind=DeviceKind.CPU, model="cpu", label="cpu", cores=cores_per_worker,
                              peak_tflops=cores_per_worker * cpu_gflops_per_core / 1000, memory_bytes=memory,
                              price_units=float(cores_per_worker),
                              memory_bytes_per_s=cores_per_worker * CPU_MEMORY_BYTES_PER_S_PER_CORE)
            devices = [Device(uuid=None, type=kind, node=node, island_id=None, numa_node=numa, cpu_affinity=cpus)
                       for numa, cpus in slots]
            hop = collectives.hop(LinkClass.LOOPBACK) if len(devices) > 1 else None
            domains.append(Domain(domain_id=f"{node.node_id}-cpu", devices=devices, intra_hop=hop,
                                  network_hop=_network_hop(node, collectives)))
        return cls(domains=domains, guessed_networks=_guessed_networks(topology))


def _guessed_networks(topology: ClusterTopology) -> set[str]:
    return {node.node_id for node in topology.nodes if node.network_gb_per_s <= 0}


def _network_hop(node: NodeTopology, collectives: CollectiveCostModel) -> Hop:
    gb_per_s = node.network_gb_per_s if node.network_gb_per_s > 0 else UNKNOWN_NETWORK_GB_PER_S
    kind = {NicKind.INFINIBAND: LinkClass.INFINIBAND, NicKind.ROCE: LinkClass.ROCE}.get(node.network_kind,
                                                                                        LinkClass.ETHERNET)
    return collectives.hop(kind, gb_per_s)


def _peak(peaks: dict[str, float], dtype: str) -> float:
    """The device's dense peak at the job's dtype; fp16 stands in for bf16 (V100), fp32 for the rest."""
    return peaks.get(dtype) or (peaks.get("fp16") if dtype == "bf16" else None) or peaks.get("fp32") or 0.0


def _gpu_type(gpu: Gpu | MigSlice, parent: Gpu, peak: float) -> DeviceType | None:
    if not peak:
        return None
    model = parent.model or parent.name
    known = catalog.find(model) if model else None
    bandwidth = known.memory_gb_per_s * 1e9 if known else UNKNOWN_GPU_MEMORY_BYTES_PER_S
    if isinstance(gpu, MigSlice):
        return DeviceType(kind=DeviceKind.MIG, model=model, peak_tflops=peak, label=f"{model} {gpu.profile}",
                          memory_bytes=gpu.memory_bytes, price_units=gpu.sm_share or 1.0,
                          memory_bytes_per_s=bandwidth * (gpu.sm_share or 1.0))
    return DeviceType(kind=DeviceKind.GPU, model=model, label=model, peak_tflops=peak,
                      memory_bytes=gpu.memory_bytes, price_units=1.0, memory_bytes_per_s=bandwidth)


def _gpu_domains(topology: ClusterTopology, collectives: CollectiveCostModel, networks: dict[str, Hop],
                 dtype: str, use_mig: bool) -> list[Domain]:
    """NVLink islands (several nodes' GPUs for a fabric that spans nodes), then per node its GPUs
    without NVLink peers and its MIG slices, each split by device type."""
    groups: dict[tuple[str, DeviceType], list[Device]] = defaultdict(list)
    kinds: dict[str, tuple[bool, bool]] = {}
    island_of = {uuid: island for island in topology.nvlink_islands for uuid in island.gpu_uuids}
    types: dict[tuple, DeviceType | None] = {}  # one object per kind of device: cheap to hash and compare

    def type_of(device: Gpu | MigSlice, parent: Gpu) -> DeviceType | None:
        peak = _peak(device.peak_tflops, dtype)
        key = (parent.model, parent.name, getattr(device, "profile", ""), device.memory_bytes, peak,
               getattr(device, "sm_share", 1.0))
        if key not in types:
            types[key] = _gpu_type(device, parent, peak)
        return types[key]

    for node in topology.nodes:
        gpus = {gpu.uuid: gpu for gpu in node.gpus}
        for gpu in node.gpus:
            island = island_of.get(gpu.uuid) if gpu.usable_whole else None
            kind = type_of(gpu, gpu) if island is not None else None
            if kind is None:
                continue
            key = island.island_id if island.size > 1 else f"{node.node_id}-pcie"
            kinds[key] = (island.size > 1, len(island.node_ids) > 1)
            groups[key, kind].append(Device(uuid=gpu.uuid, type=kind, node=node, island_id=island.island_id,
                                            numa_node=gpu.numa_node, cpu_affinity=gpu.cpu_affinity))
        for mig in node.mig_slices if use_mig else []:
            parent = gpus[mig.parent_uuid]
            kind = type_of(mig, parent)
            if kind is None or parent.error:
                continue
            kinds[f"{node.node_id}-mig"] = (False, False)
            groups[f"{node.node_id}-mig", kind].append(
                Device(uuid=mig.uuid, type=kind, node=node, island_id=None, parent_uuid=parent.uuid,
                       numa_node=parent.numa_node, cpu_affinity=parent.cpu_affinity))
    types_per_key = Counter(key for key, _ in groups)
    islands = {island.island_id: island for island in topology.nvlink_islands}
    domains = []
    for (key, kind), devices in groups.items():
        nvlink, spans_nodes = kinds[key]
        network = min((networks[node_id] for node_id in {d.node.node_id for d in devices}),
                      key=lambda hop: hop.bytes_per_s)
        if len(devices) == 1:
            intra = None
        elif nvlink:  # the island's slowest directly linked pair; its links are all NVLink
            island = islands[key]
            intra = collectives.hop(LinkClass(island.interconnect.value), island.bandwidth_gb_per_s)
        else:
            intra = _slowest_pair(topology, [d.uuid for d in devices], collectives)
        domains.append(Domain(domain_id=f"{key}-{kind.label.replace(' ', '-')}" if types_per_key[key] > 1 else key,
                              devices=devices, network_hop=network, fabric_id=key if spans_nodes else "",
                              nvlink=nvlink, intra_hop=intra))
    return domains


def _slowest_pair(topology: ClusterTopology, uuids: list[str], collectives: CollectiveCostModel) -> Hop:
    """The slowest hop of a ring through `uuids` in order (each device to the next, the last to the first)."""
    ring = list(zip(uuids, uuids[1:] + uuids[:1]))[:len(uuids) if len(uuids) > 2 else 1]
    links = {(link.kind, link.bandwidth_gb_per_s) for link in (topology.link(*pair) for pair in ring)}
    hops = [_hop(kind, bandwidth, collectives) for kind, bandwidth in links]
    return min(hops, key=lambda hop: (hop.bytes_per_s, -hop.alpha_s))


def _hop(kind: LinkKind, bandwidth_gb_per_s: float, collectives: CollectiveCostModel) -> Hop:
    if kind.is_nvlink:
        return collectives.hop(LinkClass(kind.value), bandwidth_gb_per_s)
    if kind in PCIE_PATHS:
        return collectives.hop(LinkClass.PCIE, bandwidth_gb_per_s)
    return collectives.hop(LinkClass.HOST_MEMORY, bandwidth_gb_per_s)


def _cpu_slots(node: NodeTopology, cores: int) -> list[tuple[int | None, str]]:
    """(NUMA node, CPU list) of each worker slot; CPU lists stay inside one NUMA node."""
    if node.numa_nodes:
        slots = []
        for numa in node.numa_nodes:
            cpus = parse_cpu_list(numa.cpus)
            slots += [(numa.numa_id, format_cpu_list(cpus[i:i + cores]))
                      for i in range(0, len(cpus) - cores + 1, cores)]
        if slots:
            return slots
    return [(None, "")] * (node.cpu_count // cores) if node.cpu_count else []

