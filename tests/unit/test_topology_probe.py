"""The local probe against a fake NVML module injected at the facade, and a fake /sys tree."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from topology import ClusterTopology, LinkKind, NicKind
from topology.probe import probe_local_node
from topology.sysfs import format_cpu_list

NOT_SUPPORTED, GPU_IS_LOST, LIBRARY_NOT_FOUND, NOT_FOUND, INVALID_ARGUMENT = 3, 15, 12, 6, 2


class NVMLError(Exception):
    def __init__(self, value: int):
        self.value = value
        super().__init__({3: "Not Supported", 15: "GPU is lost", 12: "NVML Shared Library Not Found",
                          6: "Not Found", 2: "Invalid Argument"}.get(value, f"error {value}"))


@dataclass
class FakeMig:
    uuid: str
    name: str
    memory: int
    sms: int
    gi: int
    ci: int


@dataclass
class FakeGpu:
    uuid: str
    name: str
    bus: str
    memory: int
    sms: int
    cc: tuple[int, int]
    numa: int = 0
    cpus: tuple[int, ...] = ()
    pcie: tuple[int, int] = (5, 16)
    nvlinks: list[tuple[str, bool]] = field(default_factory=list)
    """(remote NVML bus id, remote is an NVSwitch) per active link."""
    inactive_links: int = 0
    mig: list[FakeMig] | None = None
    fabric: tuple[bytes, int] | None = None
    fail: dict[str, int] = field(default_factory=dict)
    """NVML function name → error code this GPU answers with."""


class FakeNvml:
    """The subset of pynvml the facade calls, answering from a list of FakeGpu."""
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], *, ancestor=lambda a, b: 50, p2p=lambda a, b: 0, init_error=0):
        self.gpus, self.ancestor, self.p2p, self.init_error = gpus, ancestor, p2p, init_error
        self.shutdown_called = False

    def _check(self, handle, function: str) -> None:
        code = getattr(handle, "fail", {}).get(function)
        if code:
            raise NVMLError(code)

    def nvmlInit(self):
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlSystemGetDriverVersion(self):
        return "580.159.03"

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check(self.gpus[index], "nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, h):
        self._check(h, "nvmlDeviceGetUUID")
        return h.uuid

    def nvmlDeviceGetName(self, h):
        return h.name.encode()  # old pynvml returns bytes

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=h.bus)

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=h.memory)

    def nvmlDeviceGetAttributes(self, h):
        return SimpleNamespace(multiprocessorCount=h.sms)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h.cc

    def nvmlDeviceGetNumaNodeId(self, h):
        self._check(h, "nvmlDeviceGetNumaNodeId")
        return h.numa

    def nvmlDeviceGetCpuAffinity(self, h, words):
        masks = [0] * words
        for cpu in h.cpus:
            if cpu < 64 * words:  # NVML fills only the words asked for
                masks[cpu // 64] |= 1 << (cpu % 64)
        return masks

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return h.pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return h.pcie[1]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(h.nvlinks) + h.inactive_links:
            raise NVMLError(INVALID_ARGUMENT if h.nvlinks else NOT_SUPPORTED)
        return 1 if link < len(h.nvlinks) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=h.nvlinks[link][0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2 if h.nvlinks[link][1] else 0

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor(a, b)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == 0
        return self.p2p(a, b)

    def nvmlDeviceGetMigMode(self, h):
        if h.mig is None:
            raise NVMLError(NOT_SUPPORTED)
        return [1 if h.mig else 0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if i >= len(h.mig):
            raise NVMLError(NOT_FOUND)
        return h.mig[i]

    def nvmlDeviceGetGpuInstanceId(self, m):
        return m.gi

    def nvmlDeviceGetComputeInstanceId(self, m):
        return m.ci

    def c_nvmlGpuFabricInfo_t(self):
        return SimpleNamespace(clusterUuid=bytes(16), status=0, cliqueId=0, state=0)

    def byref(self, value):
        return value

    def nvmlDeviceGetGpuFabricInfo(self, h, info):
        if h.fabric is None:
            raise NVMLError(NOT_SUPPORTED)
        info.clusterUuid, info.cliqueId, info.state = h.fabric[0], h.fabric[1], 3
        return 0


def bus(i: int) -> str:
    return f"00000000:{0x18 + 16 * i:02X}:00.0"


def kernel_bus(i: int) -> str:
    return f"0000:{0x18 + 16 * i:02x}:00.0"


def h100(i: int, **kw) -> FakeGpu:
    return FakeGpu(uuid=f"GPU-h100-{i}", name="NVIDIA H100 80GB HBM3", bus=bus(i), memory=81559 * 2**20, sms=132,
                   cc=(9, 0), numa=i // 4, cpus=tuple(range(56 * (i // 4), 56 * (i // 4) + 56)), **kw)


def probe(nvml, tmp_path: Path, visible=None):
    online = tmp_path / "sys/devices/system/cpu/online"
    if not online.exists():
        online.parent.mkdir(parents=True)
        online.write_text("0-255\n")
    return probe_local_node(nvml_module=nvml, root=tmp_path, hostname="box", visible_devices=visible)


def test_nvswitch_box_is_one_island_of_eight(tmp_path):
    gpus = [h100(i, nvlinks=[(f"00000000:0{1 + s % 4}:00.0", True) for s in range(18)], mig=[]) for i in range(8)]
    node = probe(FakeNvml(gpus, ancestor=lambda a, b: 40 if a.numa == b.numa else 50), tmp_path)
    cluster = ClusterTopology(nodes=[node])

    assert [g.uuid for g in node.gpus] == [f"GPU-h100-{i}" for i in range(8)]
    assert node.gpus[0].model == "H100-SXM5-80GB" and node.gpus[0].peak_tflops["bf16"] == 989.4
    assert node.gpus[0].name == "NVIDIA H100 80GB HBM3" and node.gpus[5].pci_bus_id == kernel_bus(5)
    assert node.gpus[5].numa_node == 1 and node.gpus[5].cpu_affinity == "56-111"
    assert len(node.links) == 28
    link = cluster.link("GPU-h100-0", "GPU-h100-7")
    assert (link.kind, link.nvlink_count, link.nvlink_generation) == (LinkKind.NVSWITCH, 18, 4)
    assert link.bandwidth_gb_per_s == 450.0 and link.pcie_path == LinkKind.CROSS_SOCKET
    (island,) = cluster.nvlink_islands
    assert island.island_id == "box-nvl0" and island.size == 8 and island.interconnect == LinkKind.NVSWITCH
    assert island.fully_connected and island.bandwidth_gb_per_s == 450.0
    assert node.driver_version == "580.159.03" and node.notes == []


def test_bridged_pairs_are_two_islands_and_pcie_between_them(tmp_path):
    names = "NVIDIA A100 80GB PCIe"
    gpus = [FakeGpu(uuid=f"GPU-a{i}", name=names, bus=bus(i), memory=81920 * 2**20, sms=108, cc=(8, 0),
                    pcie=(4, 16), nvlinks=[(bus(i ^ 1), False)] * 12, inactive_links=0, mig=[]) for i in range(4)]
    node = probe(FakeNvml(gpus, ancestor=lambda a, b: 30, p2p=lambda a, b: 0), tmp_path)
    cluster = ClusterTopology(nodes=[node])

    assert [i.gpu_uuids for i in cluster.nvlink_islands] == [["GPU-a0", "GPU-a1"], ["GPU-a2", "GPU-a3"]]
    assert [i.island_id for i in cluster.nvlink_islands] == ["box-nvl0", "box-nvl1"]
    pair = cluster.link("GPU-a0", "GPU-a1")
    assert (pair.kind, pair.nvlink_count, pair.bandwidth_gb_per_s) == (LinkKind.NVLINK, 12, 300.0)
    across = cluster.link("GPU-a1", "GPU-a2")
    assert (across.kind, across.bandwidth_gb_per_s, across.latency_us) == (LinkKind.HOST_BRIDGE, 20.8, 2.5)


def test_no_nvlink_gives_lone_islands_and_host_memory_without_p2p(tmp_path):
    gpus = [FakeGpu(uuid=f"GPU-l{i}", name="NVIDIA L40S", bus=bus(i), memory=46068 * 2**20, sms=142, cc=(8, 9),
                    pcie=(4, 16), numa=i // 2) for i in range(4)]
    nvml = FakeNvml(gpus, ancestor=lambda a, b: 10 if a.numa == b.numa else 50,
                    p2p=lambda a, b: 0 if a.numa == b.numa else 2)  # 2 = GPU_NOT_SUPPORTED across sockets
    cluster = ClusterTopology(nodes=[probe(nvml, tmp_path)])

    assert [(i.size, i.interconnect) for i in cluster.nvlink_islands] == [(1, None)] * 4
    assert cluster.link("GPU-l0", "GPU-l1").kind == LinkKind.PCIE_SWITCH
    across = cluster.link("GPU-l1", "GPU-l2")
    assert (across.kind, across.pcie_path, across.bandwidth_gb_per_s) == (LinkKind.HOST_MEMORY,
                                                                        LinkKind.CROSS_SOCKET, 11.7)


def test_mig_slices_have_parents_shares_and_host_memory_links(tmp_path):
    slices = [FakeMig(uuid=f"MIG-s{k}", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", memory=9856 * 2**20, sms=16,
                      gi=7 + k, ci=0) for k in range(7)]
    gpus = [h100(0, mig=slices, nvlinks=[("00000000:01:00.0", True)] * 18), h100(1, mig=[])]
    node = probe(FakeNvml(gpus, ancestor=lambda a, b: 10), tmp_path)
    cluster = ClusterTopology(nodes=[node])

    assert [s.uuid for s in node.mig_slices] == [f"MIG-s{k}" for k in range(7)]
    first = node.mig_slices[0]
    assert (first.parent_uuid, first.profile, first.sm_count, first.gpu_instance_id) == ("GPU-h100-0", "1g.10gb", 16, 7)
    assert first.sm_share == round(16 / 132, 4) and first.peak_tflops["bf16"] == round(989.4 * 16 / 132, 2)
    assert node.gpus[0].mig_enabled and not node.gpus[1].mig_enabled
    assert cluster.island_of("GPU-h100-0") is None and cluster.island_of("MIG-s0") is None
    assert [i.gpu_uuids for i in cluster.nvlink_islands] == [["GPU-h100-1"]]
    assert cluster.link("MIG-s0", "MIG-s1").kind == LinkKind.HOST_MEMORY
    assert cluster.link("MIG-s0", "GPU-h100-1").pcie_path == LinkKind.PCIE_SWITCH
    assert "GPU 0 is in MIG mode: its 18 NVLinks carry no traffic" in node.notes


def test_a_failing_gpu_is_reported_and_the_rest_still_maps(tmp_path):
    gpus = [h100(i, mig=[], nvlinks=[("00000000:01:00.0", True)] * 18) for i in range(4)]
    gpus[1].fail = {"nvmlDeviceGetUUID": GPU_IS_LOST}
    gpus[2].fail = {"nvmlDeviceGetNumaNodeId": GPU_IS_LOST}
    node = probe(FakeNvml(gpus, ancestor=lambda a, b: 40), tmp_path)
    cluster = ClusterTopology(nodes=[node])

    assert node.gpus[1].uuid == "unreadable-box-gpu1" and node.gpus[1].error == "NVML GPU is lost (reading the UUID)"
    assert node.gpus[2].uuid == "GPU-h100-2" and node.gpus[2].error == "NVML GPU is lost (reading the GPU)"
    assert [i.gpu_uuids for i in cluster.nvlink_islands] == [["GPU-h100-0", "GPU-h100-3"]]
    assert len(node.links) == 1


def test_no_nvml_gives_a_cpu_only_node(tmp_path):
    node = probe(FakeNvml([], init_error=LIBRARY_NOT_FOUND), tmp_path)
    assert node.gpus == [] and node.notes == [
        "no GPUs mapped: NVML did not start (NVML Shared Library Not Found): no NVIDIA driver on this machine"]
    assert ClusterTopology(nodes=[node]).nvlink_islands == []


def test_cuda_visible_devices_limits_the_node_to_its_gpus(tmp_path):
    gpus = [h100(i, mig=[]) for i in range(4)]
    node = probe(FakeNvml(gpus), tmp_path, visible="GPU-h100-3,GPU-h100-1")
    assert [g.uuid for g in node.gpus] == ["GPU-h100-3", "GPU-h100-1"]
    assert "CUDA_VISIBLE_DEVICES=GPU-h100-3,GPU-h100-1 gives this node 2 of 4 GPUs" in node.notes


def test_fabric_domain_joins_nvswitch_gpus_of_two_nodes(tmp_path):
    def tray(first: int):
        return [h100(i, mig=[], nvlinks=[("00000000:01:00.0", True)] * 18, fabric=(b"\x12" * 16, 7))
                for i in range(first, first + 2)]
    a, b = probe(FakeNvml(tray(0)), tmp_path), probe(FakeNvml(tray(2)), tmp_path)
    a.node_id, b.node_id = "tray-a", "tray-b"
    cluster = ClusterTopology(nodes=[a, b])

    (island,) = cluster.nvlink_islands
    assert island.island_id == "nvl-" + "12" * 16 + ".7" and island.node_ids == ["tray-a", "tray-b"]
    link = cluster.link("GPU-h100-0", "GPU-h100-3")
    assert (link.kind, link.bandwidth_gb_per_s) == (LinkKind.NVSWITCH, 450.0)


def _sysfs(tmp_path: Path) -> None:
    """Host bridge pci0000:17 → root port → PCIe switch with a GPU and an InfiniBand HCA; a second GPU
    on host bridge pci0000:9a of NUMA node 1; an Ethernet NIC on the first root complex."""
    devices = tmp_path / "sys/devices"
    switch = devices / "pci0000:17/0000:17:01.0/0000:18:00.0"
    paths = {"0000:1a:00.0": switch / "0000:19:00.0/0000:1a:00.0",  # GPU 0
             "0000:1c:00.0": switch / "0000:19:04.0/0000:1c:00.0",  # mlx5_0
             "0000:9b:00.0": devices / "pci0000:9a/0000:9a:01.0/0000:9b:00.0",  # GPU 1
             "0000:17:02.0": devices / "pci0000:17/0000:17:02.0"}  # eth NIC
    for bdf, path in paths.items():
        path.mkdir(parents=True)
        (path / "numa_node").write_text("1\n" if bdf.startswith("0000:9") else "0\n")
        link = tmp_path / "sys/bus/pci/devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, link)
    hca = tmp_path / "sys/class/infiniband/mlx5_0"
    (hca / "ports/1").mkdir(parents=True)
    os.symlink(paths["0000:1c:00.0"], hca / "device")
    (paths["0000:1c:00.0"] / "net/ib0").mkdir(parents=True)
    for name, text in {"rate": "400 Gb/sec (4X NDR)\n", "link_layer": "InfiniBand\n", "state": "4: ACTIVE\n"}.items():
        (hca / "ports/1" / name).write_text(text)
    net = tmp_path / "sys/class/net"
    for iface, target in {"ib0": paths["0000:1c:00.0"], "eno1": paths["0000:17:02.0"]}.items():
        (net / iface).mkdir(parents=True)
        os.symlink(target, net / iface / "device")
        (net / iface / "operstate").write_text("up\n")
    (net / "eno1/speed").write_text("25000\n")
    (net / "ib0/type").write_text("32\n")
    (net / "lo").mkdir()
    node = tmp_path / "sys/devices/system/node"
    for n, cpus in enumerate(("0-3", "4-7")):
        (node / f"node{n}").mkdir(parents=True)
        (node / f"node{n}/cpulist").write_text(cpus + "\n")
        (node / f"node{n}/meminfo").write_text(f"Node {n} MemTotal:       1048576 kB\nNode {n} MemFree: 5 kB\n")
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-7\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:        2097152 kB\nMemFree: 1 kB\n")


def test_sysfs_gives_numa_nodes_nics_and_gpu_nic_paths(tmp_path):
    _sysfs(tmp_path)
    gpus = [FakeGpu(uuid="GPU-0", name="NVIDIA L4", bus="00000000:1A:00.0", memory=1, sms=58, cc=(8, 9),
                    fail={"nvmlDeviceGetNumaNodeId": NOT_SUPPORTED}),
            FakeGpu(uuid="GPU-1", name="NVIDIA L4", bus="00000000:9B:00.0", memory=1, sms=58, cc=(8, 9), numa=1)]
    node = probe(FakeNvml(gpus), tmp_path)

    assert (node.cpu_count, node.memory_bytes) == (8, 2 * 2**30)
    assert [(n.numa_id, n.cpus, n.memory_bytes) for n in node.numa_nodes] == [(0, "0-3", 2**30), (1, "4-7", 2**30)]
    assert node.gpus[0].numa_node == 0  # NVML could not say; the kernel could
    ib, eth = node.nics
    assert (ib.name, ib.kind, ib.speed_gbit_per_s, ib.netdev, ib.numa_node, ib.up) == (
        "mlx5_0", NicKind.INFINIBAND, 400.0, "ib0", 0, True)
    assert ib.gpu_paths == {"GPU-0": LinkKind.PCIE_SWITCH, "GPU-1": LinkKind.CROSS_SOCKET}
    assert (eth.name, eth.kind, eth.speed_gbit_per_s) == ("eno1", NicKind.ETHERNET, 25.0)
    assert eth.gpu_paths == {"GPU-0": LinkKind.HOST_BRIDGE, "GPU-1": LinkKind.CROSS_SOCKET}
    assert node.network_gb_per_s == 50.0


def test_probe_json_round_trips(tmp_path):
    _sysfs(tmp_path)
    gpus = [h100(i, nvlinks=[("00000000:01:00.0", True)] * 18, mig=[]) for i in range(2)]
    cluster = ClusterTopology(nodes=[probe(FakeNvml(gpus), tmp_path)])
    loaded = ClusterTopology.load(cluster.save(tmp_path / "out/cluster.json"))
    assert loaded == cluster and loaded.nvlink_islands == cluster.nvlink_islands


@pytest.mark.parametrize("cpus", [(0, 63, 64, 200), (5,)])
def test_cpu_affinity_masks_span_64_bit_words(tmp_path, cpus):
    gpu = h100(0, mig=[])
    gpu.cpus = cpus
    node = probe(FakeNvml([gpu]), tmp_path)
    assert node.gpus[0].cpu_affinity == format_cpu_list(list(cpus))
