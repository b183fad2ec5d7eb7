"""The cluster map: nodes, their GPUs, MIG slices, links, NICs and NUMA nodes, and NVLink islands.

    topology = ClusterTopology(nodes=[...])       # validated on construction
    topology.nvlink_islands                       # computed from the links, never declared
    topology.link("GPU-a…", "MIG-b…")             # any two devices: NVLink, PCIe, host memory, network
    topology.save("cluster.json"); ClusterTopology.load("cluster.json")

Every device is named by its UUID (`GPU-…`, `MIG-…`): NVML numbers GPUs in PCI order, CUDA under
CUDA_VISIBLE_DEVICES does not, so an index means nothing outside the node that printed it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from core import codec
from core.atomic import read_text, write_text_atomically
from core.errors import TopologyError
from topology import catalog, islands
from topology.islands import NvlinkIsland
from topology.links import NETWORK_LATENCY_US, PCIE_PATHS, LinkKind, nvlink_cost, pcie_cost, pcie_gb_per_s

FORMAT = "archipelago.topology"
VERSION = 2
"""2 added each node's `measured` device figures; version 1 maps read with none."""
_WRITE_COMMAND = "archipelago topology --json FILE"
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "archipelago/topology")


def stable_uuid(prefix: str, *parts: object) -> str:
    """A made-up device UUID ("GPU-…", "MIG-…") that is the same every run for the same parts:
    for generated machines and for nvidia-smi text without `-L`. Never a real device's UUID."""
    return f"{prefix}-{uuid.uuid5(_UUID_NAMESPACE, '/'.join(map(str, parts)))}"


class NicKind(StrEnum):
    INFINIBAND = "infiniband"
    ROCE = "roce"
    """RDMA over Converged Ethernet: an RDMA device whose link layer is Ethernet."""
    ETHERNET = "ethernet"


@dataclass(kw_only=True, slots=True)
class NumaNode:
    numa_id: int
    cpus: str
    """CPU list as the kernel prints it, e.g. "0-55,112-167"."""
    memory_bytes: int = 0


@dataclass(kw_only=True, slots=True)
class Nic:
    name: str
    """RDMA device (mlx5_0) or network interface (eth0)."""
    kind: NicKind
    speed_gbit_per_s: float = 0.0
    """Link speed; 0 when the kernel does not say (virtual NICs, nvidia-smi imports)."""
    numa_node: int | None = None
    pci_bus_id: str = ""
    netdev: str = ""
    """The network interface of an RDMA device (ib0, enp1s0f0), if it has one."""
    up: bool = True
    gpu_paths: dict[str, LinkKind] = field(default_factory=dict)
    """PCIe path from this NIC to each GPU of the node, by GPU UUID: pcie_switch (PIX) means
    GPUDirect RDMA at full speed, cross_socket (SYS) means it crosses the socket link."""


@dataclass(kw_only=True, slots=True)
class Gpu:
    uuid: str
    index: int
    """NVML index (PCI bus order) on its node; for display only."""
    name: str
    """As NVML prints it, e.g. "NVIDIA H100 80GB HBM3"."""
    model: str = ""
    """Catalog key (H100-SXM5-80GB), "" when the catalog does not know the GPU."""
    pci_bus_id: str = ""
    """Normalised as the kernel writes it: 0000:18:00.0."""
    memory_bytes: int = 0
    sm_count: int = 0
    compute_capability: str = ""
    numa_node: int | None = None
    cpu_affinity: str = ""
    """CPUs nearest the GPU, a kernel CPU list ("0-55,112-167"); "" when unknown."""
    pcie_generation: int = 0
    pcie_width: int = 0
    nvlink_domain: str = ""
    """NVLink fabric (cluster UUID and clique) the GPU belongs to when its NVSwitches span nodes
    (GH200/GB200 NVL systems); "" for a fabric within one node or no fabric."""
    mig_enabled: bool = False
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak per dtype from the catalog (see catalog.DTYPES); empty for unknown models."""
    error: str = ""
    """Why NVML could not read this GPU; a GPU with an error is listed but not scheduled."""

    @property
    def usable_whole(self) -> bool:
        """Schedulable as one device: readable and not split into MIG slices."""
        return not self.error and not self.mig_enabled


@dataclass(kw_only=True, slots=True)
class MigSlice:
    uuid: str
    parent_uuid: str
    profile: str
    """As nvidia-smi prints it: "1g.10gb"."""
    memory_bytes: int = 0
    sm_count: int = 0
    """As NVML reports it; 0 where the map was imported or generated (sm_share still holds)."""
    sm_share: float = 0.0
    """Fraction of the parent GPU's SMs."""
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """The parent's peaks scaled by sm_share."""


@dataclass(kw_only=True, slots=True)
class GpuLink:
    gpu_a: str
    gpu_b: str
    kind: LinkKind
    pcie_path: LinkKind | None = None
    """The PCIe relationship between the two GPUs (pcie_switch … cross_socket), when known."""
    nvlink_count: int = 0
    nvlink_generation: int = 0
    bandwidth_gb_per_s: float = 0.0
    """Nominal, one direction (see links.py)."""
    latency_us: float = 0.0


@dataclass(kw_only=True, slots=True)
class MeasuredDevice:
    """What the probe's micro-benchmark measured on one device model of a node (topology/device_bench.py).

    Rates are per device: one GPU, or for "cpu" one core while every core of the node works. 0 means
    not measured (no such path on the device, or it failed; the node's notes say which)."""

    name: str
    """The device as NVML prints it ("NVIDIA H200"), or "cpu"."""
    driver_version: str = ""
    """The NVIDIA driver the figures were measured under; "" for CPUs. A figure from another driver
    than the node's is stale: the planner drops it and says so."""
    bf16_tflops: float = 0.0
    """Dense bf16 matrix product at training shapes (8192³ on GPUs)."""
    fp8_tflops: float = 0.0
    """float8 (e4m3, torch._scaled_mm) product at the same shape; GPUs of compute capability 8.9 and up."""
    fp32_tflops: float = 0.0
    """fp32 product (TF32 off): what CPU workers train in."""
    fp32_block_tflops: float = 0.0
    """For "cpu": a small transformer block trained in fp32, forward and backward, its FLOPs counted as
    planning/model_size.py counts a model's (device_bench.REFERENCE_BLOCK): the rate a CPU worker's
    step reaches, which a product rate does not say. Its small matrices, attention, GELU and layer
    norms reach a share of the product rate that differs from CPU to CPU (the demo's step: 0.3 on an Intel Xeon,
    0.4-0.7 on an AMD EPYC; benchmarks/RESULTS.md)."""
    memory_gb_per_s: float = 0.0
    """Copying a buffer far larger than the caches, counting bytes read and written (HBM, or DRAM)."""
    host_to_device_gb_per_s: float = 0.0
    """From pinned host memory."""
    device_to_host_gb_per_s: float = 0.0
    peer_gb_per_s: float = 0.0
    """Copying from one GPU of this model to another on the node (0 with one GPU)."""
    cores: int = 0
    """For "cpu": the cores that worked together (the rates are per core)."""
    seconds: float = 0.0
    """How long the measurement took."""


@dataclass(kw_only=True, slots=True)
class NodeTopology:
    node_id: str
    """Unique in the cluster map: the hostname, made unique when Ray runs several nodes on one host."""
    hostname: str = ""
    address: str = ""
    ray_node_id: str = ""
    cpu_count: int = 0
    memory_bytes: int = 0
    numa_nodes: list[NumaNode] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    mig_slices: list[MigSlice] = field(default_factory=list)
    links: list[GpuLink] = field(default_factory=list)
    """One entry per pair of GPUs of this node that NVML (or nvidia-smi) could relate."""
    driver_version: str = ""
    source: str = ""
    """Where the map came from: nvml, nvidia-smi, generated."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    ray_labels: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What the probe could not see or had to assume, in words."""
    measured: list[MeasuredDevice] = field(default_factory=list)
    """The micro-benchmark's figures, one entry per device model of the node and one for its CPUs;
    empty where nothing was measured (imported or generated maps, `node-resources`)."""

    @property
    def network_gb_per_s(self) -> float:
        """Bandwidth off the node: all active RDMA NICs together, else the fastest Ethernet NIC."""
        up = [nic for nic in self.nics if nic.up and nic.speed_gbit_per_s > 0]
        rdma = [nic for nic in up if nic.kind != NicKind.ETHERNET]
        if rdma:
            return sum(nic.speed_gbit_per_s for nic in rdma) / 8
        return max((nic.speed_gbit_per_s for nic in up), default=0.0) / 8

    @property
    def network_kind(self) -> NicKind:
        kinds = {nic.kind for nic in self.nics if nic.up}
        return next((kind for kind in (NicKind.INFINIBAND, NicKind.ROCE) if kind in kinds), NicKind.ETHERNET)


@dataclass(slots=True)
class ClusterTopology:
    nodes: list[NodeTopology]
    nvlink_islands: list[NvlinkIsland] = field(init=False, compare=False)
    """Connected components of the NVLink graph over whole GPUs (MIG-mode and unreadable GPUs
    are in none); a GPU without NVLink peers is an island of one."""
    _devices: dict[str, tuple[NodeTopology, Gpu | MigSlice]] = field(init=False, compare=False, repr=False)
    _island_of: dict[str, NvlinkIsland] = field(init=False, compare=False, repr=False)
    _links: dict[frozenset[str], GpuLink] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._devices = _index_devices(self.nodes)
        self._links = _index_links(self.nodes, self._devices)
        self.nvlink_islands = islands.compute(self.nodes, self._links)
        self._island_of = {uuid: island for island in self.nvlink_islands for uuid in island.gpu_uuids}

    # ---- queries the planner uses -------------------------------------------------------------
    def gpus(self) -> Iterator[tuple[NodeTopology, Gpu]]:
        for node in self.nodes:
            for gpu in node.gpus:
                yield node, gpu

    def node(self, node_id: str) -> NodeTopology:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise TopologyError(f"no node {node_id!r} in the topology", fix="list nodes with `archipelago topology`")

    def device(self, uuid: str) -> tuple[NodeTopology, Gpu | MigSlice]:
        try:
            return self._devices[uuid]
        except KeyError:
            raise TopologyError(f"no GPU or MIG slice {uuid!r} in the topology",
                                fix="use a UUID that `archipelago topology` lists") from None

    def island_of(self, gpu_uuid: str) -> NvlinkIsland | None:
        """The NVLink island of a whole GPU; None for MIG slices and MIG-mode or unreadable GPUs."""
        self.device(gpu_uuid)
        return self._island_of.get(gpu_uuid)

    def link(self, uuid_a: str, uuid_b: str) -> GpuLink:
        """How data moves between two devices (GPUs or MIG slices), on one node or across nodes."""
        node_a, device_a = self.device(uuid_a)
        node_b, device_b = self.device(uuid_b)
        gpu_a, gpu_b = self._whole_gpu(device_a), self._whole_gpu(device_b)
        if node_a is not node_b:
            # One NVLink fabric spans the nodes only for whole GPUs of one island: a MIG slice, a
            # MIG-mode or an unreadable GPU is in no island, whatever nvlink_domain NVML reported.
            island = self._island_of.get(uuid_a)
            if island is not None and island is self._island_of.get(uuid_b):
                return _fabric_link(uuid_a, uuid_b, gpu_a, island)
            return _network_link(uuid_a, uuid_b, node_a, node_b)
        if gpu_a.uuid == gpu_b.uuid:  # two slices of one GPU: staged through host memory
            return _host_memory_link(uuid_a, uuid_b, None, gpu_a, gpu_b)
        physical = self._links.get(frozenset((gpu_a.uuid, gpu_b.uuid)))
        if physical is None:
            raise TopologyError(f"no link recorded between {gpu_a.uuid} and {gpu_b.uuid}",
                                where=f"nodes[{self.nodes.index(node_a)}].links",
                                fix="re-run discovery; an unreadable GPU has no links")
        if isinstance(device_a, MigSlice) or isinstance(device_b, MigSlice):
            return _host_memory_link(uuid_a, uuid_b, physical.pcie_path, gpu_a, gpu_b)
        return replace(physical, gpu_a=uuid_a, gpu_b=uuid_b)

    def _whole_gpu(self, device: Gpu | MigSlice) -> Gpu:
        if isinstance(device, Gpu):
            return device
        return self._devices[device.parent_uuid][1]  # type: ignore[return-value]

    # ---- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "nodes": [asdict(node) for node in self.nodes],
                "nvlink_islands": [asdict(island) for island in self.nvlink_islands]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: object, *, where: str = "topology") -> ClusterTopology:
        if isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == 1:
            data = {**data, "version": VERSION}  # version 1 is version 2 without measured figures
        fields = codec.check_header(data, format=FORMAT, version=VERSION, noun="topology", command=_WRITE_COMMAND,
                                    error=TopologyError, where=where)
        unknown = sorted(set(fields) - {"nodes", "nvlink_islands"})
        if unknown:
            raise TopologyError(f"unknown field {unknown[0]!r}", where=where,
                                fix="remove it; fields are format, version, nodes, nvlink_islands")
        nodes = codec.decode(list[NodeTopology], fields.get("nodes"), f"{where}: nodes")
        try:
            topology = cls(nodes=nodes)
        except TopologyError as e:
            raise TopologyError(e.what, where=f"{where}: {e.where}", fix=e.fix) from None
        if "nvlink_islands" in fields:
            declared = codec.decode(list[NvlinkIsland], fields["nvlink_islands"], f"{where}: nvlink_islands")
            islands.check_declared(declared, topology.nvlink_islands, where=f"{where}: nvlink_islands")
        return topology

    @classmethod
    def from_json(cls, text: str, *, where: str = "topology") -> ClusterTopology:
        data = codec.parse_json(text, error=TopologyError, where=where, fix=f"write it with `{_WRITE_COMMAND}`")
        return cls.from_dict(data, where=where)

    def save(self, path: str | Path) -> Path:
        return write_text_atomically(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ClusterTopology:
        text = read_text(path, error=TopologyError, fix=f"write one with `{_WRITE_COMMAND}`")
        return cls.from_json(text, where=str(path))


def _index_devices(nodes: list[NodeTopology]) -> dict[str, tuple[NodeTopology, Gpu | MigSlice]]:
    devices: dict[str, tuple[NodeTopology, Gpu | MigSlice]] = {}
    node_ids: dict[str, int] = {}
    for n, node in enumerate(nodes):
        if not node.node_id:
            raise TopologyError("node_id is empty", where=f"nodes[{n}].node_id", fix="name every node")
        if node.node_id in node_ids:
            raise TopologyError(f"node_id {node.node_id!r} is also nodes[{node_ids[node.node_id]}]",
                                where=f"nodes[{n}].node_id", fix="give every node its own node_id")
        node_ids[node.node_id] = n
        for g, gpu in enumerate(node.gpus):
            _add_device(devices, gpu.uuid, node, gpu, f"nodes[{n}].gpus[{g}].uuid")
        for s, mig in enumerate(node.mig_slices):
            where = f"nodes[{n}].mig_slices[{s}]"
            _add_device(devices, mig.uuid, node, mig, f"{where}.uuid")
            parent = devices.get(mig.parent_uuid)
            if parent is None or parent[0] is not node or not isinstance(parent[1], Gpu):
                raise TopologyError(f"MIG slice {mig.uuid} has no parent GPU {mig.parent_uuid!r} on node "
                                    f"{node.node_id!r}", where=f"{where}.parent_uuid",
                                    fix="set parent_uuid to the UUID of a GPU listed under the same node")
            if not parent[1].mig_enabled:
                raise TopologyError(f"MIG slice {mig.uuid} belongs to GPU {mig.parent_uuid}, which is not in MIG mode",
                                    where=f"{where}.parent_uuid",
                                    fix="set mig_enabled: true on the parent GPU or remove the slice")
    return devices


def _add_device(devices: dict, uuid: str, node: NodeTopology, device: Gpu | MigSlice, where: str) -> None:
    if not uuid:
        raise TopologyError("UUID is empty", where=where, fix="every GPU and MIG slice needs its UUID")
    if uuid in devices:
        raise TopologyError(f"{uuid} is listed twice (also on node {devices[uuid][0].node_id!r})", where=where,
                            fix="two Ray nodes on one machine must each own different GPUs: start them with "
                                "CUDA_VISIBLE_DEVICES set to different GPU UUIDs")
    devices[uuid] = (node, device)


def _index_links(nodes: list[NodeTopology], devices: dict) -> dict[frozenset[str], GpuLink]:
    links: dict[frozenset[str], GpuLink] = {}
    for n, node in enumerate(nodes):
        for k, link in enumerate(node.links):
            where = f"nodes[{n}].links[{k}]"
            for end in ("gpu_a", "gpu_b"):
                uuid = getattr(link, end)
                owner = devices.get(uuid)
                if owner is None or owner[0] is not node or not isinstance(owner[1], Gpu):
                    raise TopologyError(f"{uuid!r} is not a GPU of node {node.node_id!r}", where=f"{where}.{end}",
                                        fix="links join two whole GPUs of the same node")
            if link.gpu_a == link.gpu_b:
                raise TopologyError(f"links {link.gpu_a} to itself", where=where, fix="remove the link")
            if link.kind.is_nvlink != (link.nvlink_count > 0):
                raise TopologyError(f"kind {link.kind.value} with nvlink_count {link.nvlink_count}", where=where,
                                    fix="nvswitch and nvlink links need nvlink_count > 0, other kinds 0")
            if link.kind == LinkKind.NETWORK or (link.pcie_path is not None and link.pcie_path not in PCIE_PATHS):
                raise TopologyError(f"kind {link.kind.value} / pcie_path {link.pcie_path} cannot join two GPUs "
                                    "of one node", where=where,
                                    fix=f"pcie_path is one of {', '.join(p.value for p in PCIE_PATHS)}")
            pair = frozenset((link.gpu_a, link.gpu_b))
            if pair in links:
                raise TopologyError(f"second link between {link.gpu_a} and {link.gpu_b}", where=where,
                                    fix="keep one link per pair of GPUs")
            links[pair] = link
    return links


def _pcie_gb_per_s(gpu: Gpu) -> float:
    return pcie_gb_per_s(gpu.pcie_generation, gpu.pcie_width or 16)


def _host_memory_link(uuid_a: str, uuid_b: str, pcie_path: LinkKind | None, gpu_a: Gpu, gpu_b: Gpu) -> GpuLink:
    """MIG slices have no peer-to-peer: a copy goes device → host → device over both GPUs' PCIe links."""
    slower = min(_pcie_gb_per_s(gpu_a), _pcie_gb_per_s(gpu_b))
    bandwidth, latency = pcie_cost(LinkKind.HOST_MEMORY, slower)
    return GpuLink(gpu_a=uuid_a, gpu_b=uuid_b, kind=LinkKind.HOST_MEMORY, pcie_path=pcie_path,
                   bandwidth_gb_per_s=bandwidth, latency_us=latency)


def _fabric_link(uuid_a: str, uuid_b: str, gpu_a: Gpu, island: NvlinkIsland) -> GpuLink:
    generation = catalog.nvlink_generation(catalog.lookup(gpu_a.name), gpu_a.compute_capability)
    _, latency = nvlink_cost(LinkKind.NVSWITCH, island.nvlink_count, generation)
    return GpuLink(gpu_a=uuid_a, gpu_b=uuid_b, kind=LinkKind.NVSWITCH, nvlink_count=island.nvlink_count,
                   nvlink_generation=generation, bandwidth_gb_per_s=island.bandwidth_gb_per_s, latency_us=latency)


def _network_link(uuid_a: str, uuid_b: str, node_a: NodeTopology, node_b: NodeTopology) -> GpuLink:
    kind = max(node_a.network_kind, node_b.network_kind, key=lambda k: NETWORK_LATENCY_US[k.value])  # slower end
    return GpuLink(gpu_a=uuid_a, gpu_b=uuid_b, kind=LinkKind.NETWORK,
                   bandwidth_gb_per_s=min(node_a.network_gb_per_s, node_b.network_gb_per_s),
                   latency_us=NETWORK_LATENCY_US[kind.value])
