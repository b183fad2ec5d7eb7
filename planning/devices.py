"""What the planner places workers on: devices, grouped into domains of identical, closely linked devices.

    pool = DevicePool.gpus(topology, collectives, dtype="bf16", use_mig=True, figures=FigureBook(topology, {}))
    pool = DevicePool.cpus(topology, collectives, cores_per_worker=4, dtype="fp32", nominal_gflops_per_core=100.0)
    pool.domains              # each: one node's devices of one kind that share a fast interconnect
    pool.unknown              # {GPU name: count} of the GPUs left out because nothing gives their figures

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
from planning.figures import Figure, FigureBook, Source
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
RAY_PROCESS_CORES = 0.27
"""Cores' worth of a node's CPU that Ray's own processes (raylet, GCS, the Train controller and its
actors, the log monitor, the dashboard agent) and archipelago's driver, coordinator and metrics sink
take while a job trains: what CPU workers, which the probe measured on idle cores, lose. Measured on
this project's 2-core Xeon during `make demo` (top, four 5 s samples): the two workers 173.5 % of
200 %, everything else 26.5 %; the step ran 13 % longer under Ray (180 ms) than the same two gloo
ranks without it (159 ms). Spread over the node's cores: 13.5 % of each on two, 0.4 % on 64."""


@dataclass(frozen=True, slots=True)
class DeviceType:
    """What decides a device's speed, memory and price: equal types are interchangeable."""

    kind: DeviceKind
    model: str
    """Price-table key: the catalog key, the name nvidia-smi prints for a GPU the catalog lacks, or "cpu"."""
    label: str
    """Shown in plans: the catalog key, with the MIG profile for a slice; "cpu"."""
    peak_tflops: float
    """What the compute model's utilisation is a share of, at the job's compute dtype (figures.Figure):
    a catalog or declared dense peak, or the peak a measured product rate implies; a MIG slice's
    share of its GPU's. CPU slots: cores × the measured or nominal product rate per core."""
    memory_bytes: int
    price_units: float
    """Multiples of the model's hourly price: 1 per GPU, the SM share of a MIG slice, cores of a CPU slot."""
    cores: int = 0
    memory_bytes_per_s: float = UNKNOWN_GPU_MEMORY_BYTES_PER_S
    """Device memory bandwidth (the catalog's, or a measured copy's nominal equivalent; a MIG slice's
    SM share of it; CPU slots a measured or nominal rate per core): what a comm hook's passes over the
    gradients run at."""
    source: Source = Source.CATALOG
    """Where the figures come from: declared, measured, catalog, or (CPU slots) nominal."""
    stated_tflops: float = 0.0
    """The figure as its source gives it, for people: a measured rate, a declared or catalog peak."""
    training_tflops: float = 0.0
    """CPU slots in fp32: cores × the probe's measured rate training a small transformer block
    (MeasuredDevice.fp32_block_tflops), what the compute model prices a CPU step at; 0 where the node
    has no such figure (then a share of peak_tflops)."""


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
    unknown: dict[str, int] = field(default_factory=dict)
    """GPUs left out because no [devices] table, measurement or catalog entry gives their figures:
    count by name ("" for GPUs an nvidia-smi text without `-L` lines leaves unnamed)."""

    @property
    def device_count(self) -> int:
        return sum(len(domain.devices) for domain in self.domains)

    @classmethod
    def gpus(cls, topology: ClusterTopology, collectives: CollectiveCostModel, *, dtype: str,
             use_mig: bool, figures: FigureBook) -> DevicePool:
        notes: list[str] = []
        networks = {node.node_id: _network_hop(node, collectives) for node in topology.nodes}
        domains = _gpu_domains(topology, collectives, networks, dtype, use_mig, figures)
        by_node: dict[str, list[Domain]] = defaultdict(list)
        for domain in domains:
            by_node[domain.node_id].append(domain)
        cross = {node_id: _slowest_pair(topology, [d.devices[0].uuid for d in node_domains], collectives)
                 for node_id, node_domains in by_node.items() if len(node_domains) > 1}
        unreadable = [f"{node.node_id} GPU {gpu.index}" for node, gpu in topology.gpus() if gpu.error]
        if unreadable:
            notes.append(f"left out {len(unreadable)} GPU(s) NVML could not read: {', '.join(unreadable[:4])}")
        notes.extend(figures.notes)
        return cls(domains=domains, cross_domain_hops=cross, notes=notes,
                   guessed_networks=_guessed_networks(topology), unknown=dict(figures.unknown))

    @classmethod
    def cpus(cls, topology: ClusterTopology, collectives: CollectiveCostModel, *, cores_per_worker: int,
             dtype: str, nominal_gflops_per_core: float) -> DevicePool:
        """One slot per `cores_per_worker` cores, inside one NUMA node where the node says which cores
        those are; each core at the node's measured product rate in `dtype`, else the nominal one."""
        domains = []
        for node in topology.nodes:
            slots = _cpu_slots(node, cores_per_worker)
            if not slots:
                continue
            memory = node.memory_bytes // len(slots) if node.memory_bytes else 0
            kind = _cpu_type(node, cores_per_worker, memory, dtype, nominal_gflops_per_core)
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


def _cpu_type(node: NodeTopology, cores: int, memory_bytes: int, dtype: str,
              nominal_gflops_per_core: float) -> DeviceType:
    measured = next((d for d in node.measured if d.name == "cpu"), None)
    per_core = (measured.fp32_tflops if dtype == "fp32" else measured.bf16_tflops) if measured else 0.0
    training = measured.fp32_block_tflops if measured and dtype == "fp32" else 0.0
    # The probe trained its block on idle cores; a job trains beside Ray. (The product-rate fallback's
    # CPU_UTILISATION_OF_MEASURED was fitted on demo runs under Ray: it has that share in it already.)
    if training and measured.cores:
        training *= 1 - RAY_PROCESS_CORES / measured.cores
    source = Source.MEASURED if per_core else Source.NOMINAL
    per_core = per_core or nominal_gflops_per_core / 1000
    bandwidth = (measured.memory_gb_per_s * 1e9 if measured and measured.memory_gb_per_s
                 else CPU_MEMORY_BYTES_PER_S_PER_CORE)
    return DeviceType(kind=DeviceKind.CPU, model="cpu", label="cpu", cores=cores, peak_tflops=cores * per_core,
                      memory_bytes=memory_bytes, price_units=float(cores), memory_bytes_per_s=cores * bandwidth,
                      source=source, stated_tflops=cores * per_core, training_tflops=cores * training)


def _gpu_type(gpu: Gpu | MigSlice, parent: Gpu, figure: Figure) -> DeviceType:
    """A whole GPU or a MIG slice (its SM share of the parent's figures) as `figure` describes it."""
    model = parent.model or parent.name
    share = _slice_share(gpu, model) if isinstance(gpu, MigSlice) else 1.0
    whole = figure.memory_bytes if figure.memory_bytes is not None else parent.memory_bytes
    memory = gpu.memory_bytes if isinstance(gpu, MigSlice) else whole
    label = f"{model} {gpu.profile}" if isinstance(gpu, MigSlice) else model
    return DeviceType(kind=DeviceKind.MIG if isinstance(gpu, MigSlice) else DeviceKind.GPU, model=model, label=label,
                      peak_tflops=round(figure.peak_tflops * share, 2), memory_bytes=memory, price_units=share,
                      memory_bytes_per_s=(figure.memory_bytes_per_s or UNKNOWN_GPU_MEMORY_BYTES_PER_S) * share,
                      source=figure.source, stated_tflops=round(figure.stated_tflops * share, 2))


def _slice_share(mig: MigSlice, model: str) -> float:
    """The slice's share of its GPU's SMs: exact from the catalog's profile (1/7, not the map's rounded
    0.1429, so planner and bill agree), else as the map gives it."""
    exact = catalog.device_share(f"{model} {mig.profile}") if mig.profile else 1.0
    return exact if exact != 1.0 else (mig.sm_share or 1.0)


def _gpu_domains(topology: ClusterTopology, collectives: CollectiveCostModel, networks: dict[str, Hop],
                 dtype: str, use_mig: bool, figures: FigureBook) -> list[Domain]:
    """NVLink islands (several nodes' GPUs for a fabric that spans nodes), then per node its GPUs
    without NVLink peers and its MIG slices, each split by device type."""
    groups: dict[tuple[str, DeviceType], list[Device]] = defaultdict(list)
    kinds: dict[str, tuple[bool, bool]] = {}
    island_of = {uuid: island for island in topology.nvlink_islands for uuid in island.gpu_uuids}
    types: dict[tuple, DeviceType | None] = {}  # one object per kind of device: cheap to hash and compare

    # Each readable GPU's figures, looked up once: its MIG slices get their share of them.
    whole = {gpu.uuid: figures.of(node, gpu, dtype=dtype) for node, gpu in topology.gpus() if not gpu.error}

    def type_of(device: Gpu | MigSlice, parent: Gpu) -> DeviceType | None:
        figure = whole.get(parent.uuid)
        if figure is None:
            return None
        key = (parent.model, parent.name, getattr(device, "profile", ""), device.memory_bytes, figure,
               getattr(device, "sm_share", 1.0))
        if key not in types:
            types[key] = _gpu_type(device, parent, figure)
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

