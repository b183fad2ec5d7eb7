"""NVLink islands: the connected components of the NVLink graph, computed from the links.

Only whole, readable GPUs take part: MIG slices have no NVLink or peer-to-peer, and a GPU NVML
could not read has no trustworthy links. GPUs of different nodes join one island when they share
an NVLink fabric domain (NVSwitch trays of a GH200/GB200 NVL rack). A GPU without NVLink peers is
an island of one, so every schedulable whole GPU is in exactly one island.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

from core.errors import TopologyError
from topology.links import LinkKind

if TYPE_CHECKING:
    from topology.cluster import GpuLink, NodeTopology


@dataclass(kw_only=True, slots=True)
class NvlinkIsland:
    island_id: str
    """"<node_id>-nvl<k>" for an island inside one node, "nvl-<domain>" for a fabric domain."""
    gpu_uuids: list[str]
    node_ids: list[str]
    """More than one when an NVLink fabric spans nodes."""
    interconnect: LinkKind | None
    """nvswitch, nvlink, or None for a GPU with no NVLink peer."""
    fully_connected: bool
    """Every pair has a direct NVLink or a switch between them (bridged pairs joined by nothing
    else are separate islands; a hybrid cube mesh is one island that is not fully connected)."""
    nvlink_count: int
    """Fewest NVLinks between two directly linked GPUs of the island; 0 for a lone GPU."""
    bandwidth_gb_per_s: float
    """Slowest directly linked pair, one direction; 0 for a lone GPU."""

    @property
    def size(self) -> int:
        return len(self.gpu_uuids)


def compute(nodes: list[NodeTopology], links: dict[frozenset[str], GpuLink]) -> list[NvlinkIsland]:
    members = [(node, gpu) for node in nodes for gpu in node.gpus if gpu.usable_whole]
    parent = {gpu.uuid: gpu.uuid for _, gpu in members}

    def root(uuid: str) -> str:
        while parent[uuid] != uuid:
            parent[uuid] = parent[parent[uuid]]
            uuid = parent[uuid]
        return uuid

    nvlinks = [link for link in links.values()
               if link.kind.is_nvlink and link.gpu_a in parent and link.gpu_b in parent]
    for link in nvlinks:
        parent[root(link.gpu_a)] = root(link.gpu_b)
    first_in_domain: dict[str, str] = {}
    for _, gpu in members:
        if gpu.nvlink_domain:
            parent[root(gpu.uuid)] = root(first_in_domain.setdefault(gpu.nvlink_domain, gpu.uuid))

    components: dict[str, list] = {}
    for node, gpu in members:  # dicts keep insertion order: islands come out in node, then PCI order
        components.setdefault(root(gpu.uuid), []).append((node, gpu))
    per_node_count: dict[str, int] = {}
    return [_island(component, links, per_node_count) for component in components.values()]


def _island(component: list, links: dict[frozenset[str], GpuLink], per_node_count: dict[str, int]) -> NvlinkIsland:
    node_ids = list(dict.fromkeys(node.node_id for node, _ in component))
    domain = component[0][1].nvlink_domain
    if domain:
        island_id = f"nvl-{domain}"
    else:
        k = per_node_count.get(node_ids[0], 0)
        per_node_count[node_ids[0]] = k + 1
        island_id = f"{node_ids[0]}-nvl{k}"
    direct = [links[pair] for pair in (frozenset((a.uuid, b.uuid)) for (_, a), (_, b) in combinations(component, 2))
              if pair in links and links[pair].kind.is_nvlink]
    pairs = len(component) * (len(component) - 1) // 2
    fabric_pairs = sum(1 for (na, a), (nb, b) in combinations(component, 2) if na is not nb)
    if len(component) == 1:
        interconnect = None
    elif fabric_pairs or any(link.kind == LinkKind.NVSWITCH for link in direct):
        interconnect = LinkKind.NVSWITCH
    else:
        interconnect = LinkKind.NVLINK
    return NvlinkIsland(island_id=island_id, gpu_uuids=[gpu.uuid for _, gpu in component], node_ids=node_ids,
                        interconnect=interconnect, fully_connected=len(direct) + fabric_pairs == pairs,
                        nvlink_count=min((link.nvlink_count for link in direct), default=0),
                        bandwidth_gb_per_s=min((link.bandwidth_gb_per_s for link in direct), default=0.0))


def check_declared(declared: list[NvlinkIsland], computed: list[NvlinkIsland], *, where: str) -> None:
    """A file's islands must match what its links say: each GPU in one island, the same groups."""
    seen: dict[str, int] = {}
    for i, island in enumerate(declared):
        for uuid in island.gpu_uuids:
            if uuid in seen:
                raise TopologyError(f"GPU {uuid} is in two islands ({declared[seen[uuid]].island_id} and "
                                    f"{island.island_id})", where=f"{where}[{i}].gpu_uuids",
                                    fix="a GPU belongs to one NVLink island; delete nvlink_islands to recompute them")
            seen[uuid] = i
    expected = {frozenset(island.gpu_uuids): island for island in computed}
    for i, island in enumerate(declared):
        if frozenset(island.gpu_uuids) not in expected:
            raise TopologyError(f"island {island.island_id} ({', '.join(island.gpu_uuids)}) does not match the "
                                "NVLink links of its GPUs", where=f"{where}[{i}]",
                                fix="islands are computed from the links: delete nvlink_islands to recompute them")
    declared_groups = {frozenset(island.gpu_uuids) for island in declared}
    missing = [island for key, island in expected.items() if key not in declared_groups]
    if missing:
        raise TopologyError(f"island {missing[0].island_id} ({', '.join(missing[0].gpu_uuids)}) is missing",
                            where=where, fix="delete nvlink_islands to recompute them")
