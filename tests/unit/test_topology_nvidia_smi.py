"""`nvidia-smi -L` + `nvidia-smi topo -m` texts as drivers from R384 to R580 print them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import TopologyError
from topology import ClusterTopology, LinkKind, NicKind
from topology.nvidia_smi import parse_node

EXAMPLES = Path(__file__).parents[2] / "examples/topologies"

# DGX H100, driver 535: tab-separated, NIC columns with a NIC Legend, the GPU NUMA ID column.
DGX_H100 = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-9a1c3e5f-0d2b-4a6c-8e1f-3b5d7f9a1c{i:02d})\n"
                   for i in range(8)) + """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\tPIX\tNODE\t56-111,168-223\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\tPIX\tNODE\t56-111,168-223\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tNODE\tPIX\t56-111,168-223\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tNODE\tPIX\t56-111,168-223\t1\t\tN/A
NIC0\tPIX\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tSYS\tSYS
NIC1\tNODE\tNODE\tPIX\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\t X \tSYS\tSYS
NIC2\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tNODE\tNODE\tSYS\tSYS\t X \tNODE
NIC3\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tPIX\tSYS\tSYS\tNODE\t X 

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
  NIC3: mlx5_3
"""

# DGX-1 V100, driver ~R384: SOC for cross-socket, NICs named by device, CPU Affinity only, pasted with
# spaces instead of tabs, and no `nvidia-smi -L`.
DGX1_V100_OLD = """\
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    mlx5_0  mlx5_2  CPU Affinity
GPU0     X      NV1     NV1     NV2     NV2     SOC     SOC     SOC     PIX     SOC     0-19,40-59
GPU1    NV1      X      NV2     NV1     SOC     NV2     SOC     SOC     PIX     SOC     0-19,40-59
GPU2    NV1     NV2      X      NV2     SOC     SOC     NV1     SOC     PHB     SOC     0-19,40-59
GPU3    NV2     NV1     NV2      X      SOC     SOC     SOC     NV1     PHB     SOC     0-19,40-59
GPU4    NV2     SOC     SOC     SOC      X      NV1     NV1     NV2     SOC     PIX     20-39,60-79
GPU5    SOC     NV2     SOC     SOC     NV1      X      NV2     NV1     SOC     PIX     20-39,60-79
GPU6    SOC     SOC     NV1     SOC     NV1     NV2      X      NV2     SOC     PHB     20-39,60-79
GPU7    SOC     SOC     SOC     NV1     NV2     NV1     NV2      X      SOC     PHB     20-39,60-79
mlx5_0  PIX     PIX     PHB     PHB     SOC     SOC     SOC     SOC      X      SOC
mlx5_2  SOC     SOC     SOC     SOC     PIX     PIX     PHB     PHB     SOC      X

Legend:

  X    = Self
  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets(e.g. QPI)
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe switches (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing a single PCIe switch
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# 4×A100 PCIe with NVLink bridges on two pairs, driver 470 (NUMA Affinity, no GPU NUMA ID); -L after.
A100_BRIDGED = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\tSYS\t0-31\t0
GPU1\tNV12\t X \tSYS\tSYS\t0-31\t0
GPU2\tSYS\tSYS\t X \tNV12\t32-63\t1
GPU3\tSYS\tSYS\tNV12\t X \t32-63\t1

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
GPU 0: NVIDIA A100 80GB PCIe (UUID: GPU-41255406-c9af-f94b-4ebf-9d57ad1853d0)
GPU 1: NVIDIA A100 80GB PCIe (UUID: GPU-41255406-c9af-f94b-4ebf-9d57ad1853d1)
GPU 2: NVIDIA A100 80GB PCIe (UUID: GPU-41255406-c9af-f94b-4ebf-9d57ad1853d2)
GPU 3: NVIDIA A100 80GB PCIe (UUID: GPU-41255406-c9af-f94b-4ebf-9d57ad1853d3)
"""

# Two A100 SXM4 80GB, the first split 3×1g.10gb + 1×4g.40gb (driver 535, new MIG UUIDs).
A100_MIG = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16)
  MIG 4g.40gb     Device  0: (UUID: MIG-feb88891-0321-5fef-9c87-d4af3b54259e)
  MIG 1g.10gb     Device  1: (UUID: MIG-a25704ba-3a06-5299-a795-fd7cf4d13973)
  MIG 1g.10gb     Device  2: (UUID: MIG-50f1c4c9-1508-5e8d-bb06-d08145b22e01)
  MIG 1g.10gb     Device  3: (UUID: MIG-36c795f2-5cf7-55d6-af30-e535e79b7bb6)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-d8594bd4-0fc3-8595-e355-7c98138f3b95)
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\t0-63\t0\t\tN/A
GPU1\tNV12\t X \t0-63\t0\t\tN/A
"""

# Driver R450: MIG devices carried their parent's UUID and instance ids.
OLD_MIG = """\
GPU 0: A100-SXM4-40GB (UUID: GPU-5b4c3d2e-1f0a-4b3c-8d7e-6f5a4b3c2d1e)
  MIG 3g.20gb Device 0: (UUID: MIG-GPU-5b4c3d2e-1f0a-4b3c-8d7e-6f5a4b3c2d1e/2/0)
  MIG 3g.20gb Device 1: (UUID: MIG-GPU-5b4c3d2e-1f0a-4b3c-8d7e-6f5a4b3c2d1e/1/0)
\tGPU0\tCPU Affinity
GPU0\t X \t0-47
"""


def node(text: str, node_id: str = "n"):
    return parse_node(text, node_id=node_id, source="node.txt")


def test_dgx_h100_is_one_nvswitch_island_with_nics_beside_gpu_pairs():
    n = node(DGX_H100)
    cluster = ClusterTopology(nodes=[n])
    assert [g.uuid[-2:] for g in n.gpus] == [f"{i:02d}" for i in range(8)]
    assert {g.model for g in n.gpus} == {"H100-SXM5-80GB"}
    assert (n.gpus[5].numa_node, n.gpus[5].cpu_affinity) == (1, "56-111,168-223")
    (island,) = cluster.nvlink_islands
    assert (island.size, island.interconnect, island.nvlink_count, island.bandwidth_gb_per_s) == (
        8, LinkKind.NVSWITCH, 18, 450.0)
    assert [nic.name for nic in n.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert all(nic.kind == NicKind.INFINIBAND and nic.speed_gbit_per_s == 0 for nic in n.nics)
    near = {nic.name: sorted(g.index for g in n.gpus if nic.gpu_paths[g.uuid] == LinkKind.PCIE_SWITCH)
            for nic in n.nics}
    assert near == {"mlx5_0": [0, 1], "mlx5_1": [2, 3], "mlx5_2": [4, 5], "mlx5_3": [6, 7]}
    assert [(numa.numa_id, numa.cpus) for numa in n.numa_nodes] == [(0, "0-55,112-167"), (1, "56-111,168-223")]
    assert n.cpu_count == 224


def test_old_dgx1_text_without_gpu_list_is_a_mesh_island_that_is_not_fully_connected():
    n = node(DGX1_V100_OLD, "dgx1")
    cluster = ClusterTopology(nodes=[n])
    assert n.gpus[0].uuid.startswith("GPU-") and n.gpus[0].name == "" and n.gpus[0].model == ""
    assert "no `nvidia-smi -L` text: GPU names, UUIDs and MIG slices are unknown" in n.notes
    (island,) = cluster.nvlink_islands
    assert (island.size, island.interconnect, island.fully_connected, island.nvlink_count) == (
        8, LinkKind.NVLINK, False, 1)
    nv2 = cluster.link(n.gpus[0].uuid, n.gpus[3].uuid)
    assert (nv2.nvlink_count, nv2.bandwidth_gb_per_s) == (2, 40.0)  # generation unknown: counted as NVLink 1
    assert cluster.link(n.gpus[0].uuid, n.gpus[5].uuid).kind == LinkKind.CROSS_SOCKET
    assert [nic.name for nic in n.nics] == ["mlx5_0", "mlx5_2"]
    assert n.nics[0].gpu_paths[n.gpus[2].uuid] == LinkKind.HOST_BRIDGE
    assert n.gpus[4].cpu_affinity == "20-39,60-79" and n.gpus[4].numa_node is None
    assert node(DGX1_V100_OLD, "dgx1").gpus[0].uuid == n.gpus[0].uuid  # stable stand-in UUIDs


def test_bridged_pairs_with_the_gpu_list_after_the_matrix():
    n = node(A100_BRIDGED)
    cluster = ClusterTopology(nodes=[n])
    assert [island.gpu_uuids for island in cluster.nvlink_islands] == [
        [n.gpus[0].uuid, n.gpus[1].uuid], [n.gpus[2].uuid, n.gpus[3].uuid]]
    assert {island.interconnect for island in cluster.nvlink_islands} == {LinkKind.NVLINK}
    assert cluster.link(n.gpus[1].uuid, n.gpus[2].uuid).kind == LinkKind.CROSS_SOCKET
    assert n.gpus[0].model == "A100-PCIE-80GB" and n.gpus[0].peak_tflops["bf16"] == 312.0


def test_mig_devices_become_slices_of_their_gpu():
    n = node(A100_MIG)
    cluster = ClusterTopology(nodes=[n])
    assert [(s.profile, s.parent_uuid[-4:]) for s in n.mig_slices] == [("4g.40gb", "ff16")] + [("1g.10gb", "ff16")] * 3
    big, small = n.mig_slices[0], n.mig_slices[1]
    assert (big.sm_share, small.sm_share) == (round(4 / 7, 4), round(1 / 7, 4))
    assert small.memory_bytes == 81920 * 2**20 // 8 and small.peak_tflops["bf16"] == round(312 / 7, 2)
    assert n.gpus[0].mig_enabled and not n.gpus[1].mig_enabled
    link = cluster.link(n.gpus[0].uuid, n.gpus[1].uuid)
    assert link.kind == LinkKind.HOST_MEMORY  # NV12 in the matrix, but MIG slices cannot use it
    assert [i.gpu_uuids for i in cluster.nvlink_islands] == [[n.gpus[1].uuid]]


def test_gpu_list_pasted_right_after_the_matrix_without_its_legend():
    matrix = A100_BRIDGED.split("\nLegend:")[0]
    gpu_list = A100_BRIDGED.split("NV#  = Connection traversing a bonded set of # NVLinks\n")[1]
    n = node(matrix + "\n\n" + gpu_list)
    assert [g.uuid[-2:] for g in n.gpus] == ["d0", "d1", "d2", "d3"]


def test_old_mig_uuids_carry_instance_ids():
    n = node(OLD_MIG)
    assert [(s.gpu_instance_id, s.compute_instance_id, s.profile) for s in n.mig_slices] == [
        (2, 0, "3g.20gb"), (1, 0, "3g.20gb")]
    assert n.gpus[0].model == "A100-SXM4-40GB"


def test_real_h200_text_agrees_with_the_live_probe():
    n = node((EXAMPLES / "h200-single.nvidia-smi.txt").read_text(), "h200")
    probed = json.loads((EXAMPLES / "h200-single.json").read_text())["nodes"][0]["gpus"][0]
    (gpu,) = n.gpus
    assert (gpu.uuid, gpu.name, gpu.model, gpu.memory_bytes, gpu.cpu_affinity) == (
        probed["uuid"], probed["name"], probed["model"], probed["memory_bytes"], probed["cpu_affinity"])
    assert n.links == [] and ClusterTopology(nodes=[n]).nvlink_islands[0].interconnect is None


def _replace_line(text: str, number: int, new: str) -> str:
    lines = text.splitlines()
    lines[number - 1] = new
    return "\n".join(lines)


@pytest.mark.parametrize("text, where, what", [
    ("\n".join(DGX_H100.splitlines()[:13]), "node.txt:13", "the matrix ends after 4 of 8 GPU rows"),
    (DGX_H100.replace("GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18", "GPU3\tNV18\tNV18\tNV18\t X \tNVX\tNV18"),
     "node.txt:13", "unknown link code 'NVX' in column GPU4"),
    (DGX_H100.replace("GPU2\tNV18\tNV18\t X \tNV18", "GPU2\tNV18\tNV18\t X \tSYS"), "node.txt:12",
     "GPU2→GPU3 is SYS but GPU3→GPU2 is NV18"),
    (A100_BRIDGED.replace("GPU1\tNV12\t X \tSYS\tSYS", "GPU1\tNV12\tSYS\tSYS"), "node.txt:3",
     "row GPU1 has 5 values, the header has 6 columns"),
    (A100_BRIDGED.replace("GPU2\tSYS\tSYS\t X ", "GPU3\tSYS\tSYS\t X "), "node.txt:4",
     "row 'GPU3' where the header's order expects 'GPU2'"),
    (A100_BRIDGED.replace("GPU1\tNV12\t X ", "GPU1\tNV12\tSYS"), "node.txt:3", "GPU1/GPU1 is 'SYS'"),
    (OLD_MIG.replace("GPU 0: A100", "GPU 1: A100"), "node.txt:1", "`nvidia-smi -L` jumps to GPU 1"),
    (DGX_H100.split("\tGPU0")[0], "node.txt", "no `nvidia-smi topo -m` matrix"),
    (DGX_H100.replace(DGX_H100.splitlines(keepends=True)[7], ""), "node.txt",
     "`nvidia-smi -L` lists 7 GPUs but `topo -m` has 8"),
])
def test_bad_text_names_the_line_and_the_problem(text, where, what):
    with pytest.raises(TopologyError) as caught:
        node(text)
    assert caught.value.where == where
    assert what in caught.value.what
