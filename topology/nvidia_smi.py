"""Import a node from the text `nvidia-smi topo -m` prints, with `nvidia-smi -L` for names and UUIDs.

    (nvidia-smi -L; nvidia-smi topo -m) > node.txt        # on the machine
    node = parse_node(Path("node.txt").read_text(), node_id="node-a", source="node.txt")

Reads what drivers from R384 to R580 print: tab- or space-separated columns, the ANSI underline
newer drivers put on the header, NV# / PIX / PXB / PHB / NODE / SYS (SOC before R384) codes, NIC
columns named NIC# (with a "NIC Legend") or by device (mlx5_0), and the affinity columns CPU
Affinity, NUMA Affinity and GPU NUMA ID where present. The -L text may come before or after.
What the text does not say (memory, SMs, link speeds) comes from the device catalog, and the
node's notes say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from core.errors import TopologyError
from topology import catalog, sysfs
from topology.cluster import Gpu, GpuLink, MigSlice, Nic, NicKind, NodeTopology, NumaNode, stable_uuid
from topology.links import NVIDIA_SMI_PCIE_CODES, LinkKind, nvlink_cost, pcie_cost, pcie_gb_per_s

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+")
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9A-Fa-f-]+)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)\s*$")
_OLD_MIG_UUID = re.compile(r"^MIG-GPU-[0-9A-Fa-f-]+/(\d+)/(\d+)$")  # R450: MIG-GPU-<uuid>/<gi>/<ci>
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")
_NVLINK_CODE = re.compile(r"^NV(\d+)$")


@dataclass(slots=True)
class _Listed:
    """One GPU from `nvidia-smi -L`."""
    name: str
    uuid: str
    migs: list[tuple[str, str]] = field(default_factory=list)
    """(profile, MIG UUID) in the order printed."""


@dataclass(slots=True)
class _Matrix:
    columns: list[str]
    """Device columns: GPU0…GPUn-1, then NICs."""
    affinity_columns: list[str]
    rows: dict[str, tuple[int, list[str], list[str]]]
    """Row name → (line number, link codes, affinity values)."""
    nic_names: dict[str, str]


def parse_node(text: str, *, node_id: str, source: str = "nvidia-smi text") -> NodeTopology:
    lines = _ANSI.sub("", text).splitlines()
    listed = _parse_list(lines, source)
    matrix = _parse_matrix(lines, source)
    gpu_columns = [c for c in matrix.columns if re.fullmatch(r"GPU\d+", c)]
    if listed and len(listed) != len(gpu_columns):
        raise TopologyError(f"`nvidia-smi -L` lists {len(listed)} GPUs but `topo -m` has {len(gpu_columns)}",
                            where=source, fix="take both outputs from the same machine at the same time")
    node = NodeTopology(node_id=node_id, hostname=node_id, source="nvidia-smi")
    node.gpus = [_gpu(i, column, listed, matrix, node_id) for i, column in enumerate(gpu_columns)]
    node.mig_slices = [s for gpu, entry in zip(node.gpus, listed or []) for s in _mig_slices(gpu, entry, source)]
    node.links = _links(node.gpus, gpu_columns, matrix, source)
    node.nics = _nics(node.gpus, matrix)
    node.numa_nodes = _numa_nodes(node.gpus)
    node.cpu_count = len(sysfs.parse_cpu_list(",".join(n.cpus for n in node.numa_nodes)))
    node.notes.append("from nvidia-smi text: memory, SMs and link speeds are the catalog's; NIC link layers and "
                      "speeds are unknown; CPUs and NUMA nodes are those the GPU affinity columns cover")
    if not listed:
        node.notes.append("no `nvidia-smi -L` text: GPU names, UUIDs and MIG slices are unknown")
    return node


# ---- nvidia-smi -L ------------------------------------------------------------------------------
def _parse_list(lines: list[str], source: str) -> list[_Listed]:
    listed: list[_Listed] = []
    for number, line in enumerate(lines, 1):
        if match := _GPU_LINE.match(line):
            if int(match[1]) != len(listed):
                raise TopologyError(f"`nvidia-smi -L` jumps to GPU {match[1]} after {len(listed)} GPUs",
                                    where=f"{source}:{number}", fix="paste the whole `nvidia-smi -L` output")
            listed.append(_Listed(name=match[2], uuid=match[3]))
        elif match := _MIG_LINE.match(line):
            if not listed:
                raise TopologyError("MIG device listed before any GPU", where=f"{source}:{number}",
                                    fix="paste the whole `nvidia-smi -L` output")
            listed[-1].migs.append((match[1], match[3]))
    return listed


# ---- nvidia-smi topo -m -------------------------------------------------------------------------
def _parse_matrix(lines: list[str], source: str) -> _Matrix:
    start = next((i for i, line in enumerate(lines) if _is_header(line)), None)
    if start is None:
        raise TopologyError("no `nvidia-smi topo -m` matrix (no header line starting with GPU0)", where=source,
                            fix="save the output of `nvidia-smi -L; nvidia-smi topo -m` from the node")
    tokens = _HEADER_TOKEN.findall(lines[start])
    split = next((i for i, token in enumerate(tokens) if token in _AFFINITY_COLUMNS), len(tokens))
    columns, affinity_columns = tokens[:split], tokens[split:]
    rows: dict[str, tuple[int, list[str], list[str]]] = {}
    for number, line in enumerate(lines[start + 1:], start + 2):
        if not line.strip() or line.strip().startswith("Legend"):
            if rows:  # the matrix ends at its first blank line (before the legend, or pasted -L text)
                break
            continue
        values = line.split()
        name, codes, affinity = values[0], values[1:1 + len(columns)], values[1 + len(columns):]
        expected = columns[len(rows)] if len(rows) < len(columns) else None
        if name != expected:
            raise TopologyError(f"row {name!r} where the header's order expects {expected!r}",
                                where=f"{source}:{number}", fix="paste the matrix unchanged")
        # GPU rows end with one value per affinity column ("N/A" when unknown); NIC rows have none.
        expected_values = len(columns) + (len(affinity_columns) if name.startswith("GPU") else 0)
        if len(values) - 1 != expected_values:
            raise TopologyError(f"row {name} has {len(values) - 1} values, the header has {expected_values} columns",
                                where=f"{source}:{number}", fix="the text is truncated or garbled: paste it whole")
        rows[name] = (number, codes, affinity)
    nic_names = {m[1]: m[2] for line in lines if (m := _NIC_LEGEND.match(line))}
    matrix = _Matrix(columns=columns, affinity_columns=affinity_columns, rows=rows, nic_names=nic_names)
    gpu_rows = [c for c in columns if c.startswith("GPU") and c in rows]
    gpu_count = sum(1 for c in columns if re.fullmatch(r"GPU\d+", c))
    if len(gpu_rows) < gpu_count:
        last = max((number for number, _, _ in rows.values()), default=start + 1)
        raise TopologyError(f"the matrix ends after {len(gpu_rows)} of {gpu_count} GPU rows",
                            where=f"{source}:{last}", fix="the text is truncated: paste the whole `nvidia-smi topo -m` output")
    return matrix


def _is_header(line: str) -> bool:
    tokens = line.split()
    return bool(tokens) and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1] != "X")


def _code(matrix: _Matrix, row: str, column: str, source: str) -> str:
    number, codes, _ = matrix.rows[row]
    code = codes[matrix.columns.index(column)]
    if code != "X" and code not in NVIDIA_SMI_PCIE_CODES and not _NVLINK_CODE.match(code):
        raise TopologyError(f"unknown link code {code!r} in column {column}", where=f"{source}:{number}",
                            fix="codes are X, NV#, PIX, PXB, PHB, NODE, SYS (SOC on old drivers)")
    if (code == "X") != (row == column):
        raise TopologyError(f"{row}/{column} is {code!r}: X belongs on the diagonal only",
                            where=f"{source}:{number}", fix="the text is garbled: paste it unchanged")
    return code


# ---- building the node --------------------------------------------------------------------------
def _gpu(index: int, column: str, listed: list[_Listed], matrix: _Matrix, node_id: str) -> Gpu:
    entry = listed[index] if listed else None
    name = entry.name if entry else ""
    model = catalog.lookup(name) if name else None
    _, _, affinity = matrix.rows[column]
    values = dict(zip(matrix.affinity_columns, affinity))
    cpus = values.get("CPU Affinity", "N/A")
    numa = values.get("NUMA Affinity", "N/A").split("-")[0].split(",")[0]
    return Gpu(uuid=entry.uuid if entry else stable_uuid("GPU", node_id, index), index=index, name=name,
               model=model.key if model else "", memory_bytes=model.memory_mib * 2**20 if model else 0,
               sm_count=model.sm_count if model else 0,
               compute_capability=model.compute_capability if model else "",
               numa_node=int(numa) if numa.isdigit() else None, cpu_affinity=cpus if cpus != "N/A" else "",
               pcie_generation=model.pcie_generation if model else 0, pcie_width=16 if model else 0,
               mig_enabled=bool(entry and entry.migs), peak_tflops=dict(model.peak_tflops) if model else {})


def _mig_slices(gpu: Gpu, entry: _Listed, source: str) -> list[MigSlice]:
    model = catalog.lookup(gpu.name)
    slices = []
    for profile_name, mig_uuid in entry.migs:
        profile = catalog.mig_profile(profile_name)
        share = profile.sm_share(model.mig_slices) if model and model.mig_slices else 0.0
        memory = (gpu.memory_bytes * profile.memory_gb // catalog.full_gpu_memory_gb(model)
                  if model and model.mig_profiles else profile.memory_gb * 10**9)
        ids = _OLD_MIG_UUID.match(mig_uuid)
        slices.append(MigSlice(uuid=mig_uuid, parent_uuid=gpu.uuid, profile=profile_name, memory_bytes=memory,
                               sm_share=round(share, 4),
                               gpu_instance_id=int(ids[1]) if ids else None,
                               compute_instance_id=int(ids[2]) if ids else None,
                               peak_tflops=catalog.scaled_peaks(gpu.peak_tflops, share)))
    return slices


def _links(gpus: list[Gpu], columns: list[str], matrix: _Matrix, source: str) -> list[GpuLink]:
    codes = {(a, b): _code(matrix, columns[a], columns[b], source) for a in range(len(gpus)) for b in range(len(gpus))}
    for (a, b), code in codes.items():
        if code != codes[b, a]:
            raise TopologyError(f"{columns[a]}→{columns[b]} is {code} but {columns[b]}→{columns[a]} is "
                                f"{codes[b, a]}", where=f"{source}:{matrix.rows[columns[a]][0]}",
                                fix="the matrix must be symmetric: paste it unchanged")
    switched = _through_nvswitch(gpus, codes)
    links = []
    for a in range(len(gpus)):
        for b in range(a + 1, len(gpus)):
            links.append(_link(gpus[a], gpus[b], codes[a, b], switched))
    return links


def _through_nvswitch(gpus: list[Gpu], codes: dict[tuple[int, int], str]) -> bool:
    """A GPU whose NV# counts to its peers add up to more links than it has is behind NVSwitches:
    8×H100 SXM show NV18 to all 7 peers with 18 links each; a bridged pair shows NV12 once."""
    for a, gpu in enumerate(gpus):
        total = sum(int(m[1]) for (x, _), code in codes.items() if x == a and (m := _NVLINK_CODE.match(code)))
        model = catalog.lookup(gpu.name) if gpu.name else None
        if total > (model.nvlink_links if model and model.nvlink_links else 18):
            return True
    return False


def _link(a: Gpu, b: Gpu, code: str, switched: bool) -> GpuLink:
    nvlinks = _NVLINK_CODE.match(code)
    if nvlinks and not (a.mig_enabled or b.mig_enabled):
        kind = LinkKind.NVSWITCH if switched else LinkKind.NVLINK
        generation = catalog.nvlink_generation(catalog.lookup(a.name) if a.name else None, a.compute_capability)
        bandwidth, latency = nvlink_cost(kind, int(nvlinks[1]), generation)
        return GpuLink(gpu_a=a.uuid, gpu_b=b.uuid, kind=kind, nvlink_count=int(nvlinks[1]),
                       nvlink_generation=generation, bandwidth_gb_per_s=bandwidth, latency_us=latency)
    pcie_path = NVIDIA_SMI_PCIE_CODES.get(code)
    kind = pcie_path if pcie_path and _peer_to_peer(a) and _peer_to_peer(b) else LinkKind.HOST_MEMORY
    slower = min(pcie_gb_per_s(g.pcie_generation, g.pcie_width or 16) for g in (a, b))
    bandwidth, latency = pcie_cost(kind, slower)
    return GpuLink(gpu_a=a.uuid, gpu_b=b.uuid, kind=kind, pcie_path=pcie_path, bandwidth_gb_per_s=bandwidth,
                   latency_us=latency)


def _peer_to_peer(gpu: Gpu) -> bool:
    """Whether the GPU copies to a peer over PCIe: the text does not say (NVML does, live), so not in MIG
    mode, and not a model the catalog knows to have it turned off (GeForce 40 and 50 series)."""
    model = catalog.lookup(gpu.name) if gpu.name else None
    return not gpu.mig_enabled and (model is None or model.peer_to_peer)


def _nics(gpus: list[Gpu], matrix: _Matrix) -> list[Nic]:
    columns, nics = matrix.columns, []
    for column in columns[len(gpus):]:
        paths = {gpu.uuid: NVIDIA_SMI_PCIE_CODES[code] for gpu, code in
                 zip(gpus, (matrix.rows[c][1][columns.index(column)] for c in columns[:len(gpus)]))
                 if code in NVIDIA_SMI_PCIE_CODES}
        # nvidia-smi lists RDMA devices (from /sys/class/infiniband); their link layer is not in the text.
        nics.append(Nic(name=matrix.nic_names.get(column, column), kind=NicKind.INFINIBAND, gpu_paths=paths))
    return nics


def _numa_nodes(gpus: list[Gpu]) -> list[NumaNode]:
    cpus: dict[int, set[int]] = {}
    for gpu in gpus:
        if gpu.numa_node is not None:
            cpus.setdefault(gpu.numa_node, set()).update(sysfs.parse_cpu_list(gpu.cpu_affinity))
    return [NumaNode(numa_id=numa_id, cpus=sysfs.format_cpu_list(sorted(cpus[numa_id]))) for numa_id in sorted(cpus)]
