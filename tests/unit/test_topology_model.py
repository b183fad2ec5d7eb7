"""The map itself: catalog, generated machines, islands, links between any two devices, strict JSON."""

from __future__ import annotations

import json
import time

import pytest

from core.errors import TopologyError
from topology import ClusterTopology, LinkKind, catalog, machines


def test_catalog_knows_every_model_by_the_name_nvml_prints():
    for model in catalog.MODELS:
        assert catalog.lookup(model.nvml_name) is model
    assert catalog.lookup("NVIDIA H100 80GB HBM3").peak_tflops["fp8"] == 1978.9
    assert catalog.lookup("NVIDIA A100-SXM4-40GB").key == "A100-SXM4-40GB"
    assert catalog.lookup("Tesla V100-SXM2-16GB").peak_tflops.get("bf16") is None
    assert catalog.lookup("NVIDIA GeForce RTX 3090") is None
    assert set(catalog.lookup("NVIDIA L40S").peak_tflops) <= set(catalog.DTYPES)


@pytest.mark.parametrize("name, key, bf16", [
    ("NVIDIA B200", "B200-SXM6-180GB", 2250.0), ("NVIDIA GB200", "GB200-186GB", 2500.0),
    ("NVIDIA H20", "H20-96GB", 148.0), ("NVIDIA H200", "H200-SXM5-141GB", 989.4),
    ("NVIDIA GeForce RTX 4090", "RTX-4090", 165.2), ("NVIDIA GeForce RTX 5090", "RTX-5090", 209.5),
    ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada", 364.2), ("NVIDIA RTX A6000", "RTX-A6000", 154.8),
    ("NVIDIA L4", "L4", 121.0), ("NVIDIA A10", "A10", 125.0), ("NVIDIA A10G", "A10G", 70.0),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB", 312.0), ("AMD Instinct MI325X", "MI325X", 1307.4),
    ("AMD Instinct MI300X", "MI300X", 1307.4)])
def test_current_gpus_are_told_apart_by_the_names_nvml_prints(name, key, bf16):
    """Names that contain each other (GB200/B200, H20/H200, A10/A10G/A100, RTX 4090 D) find their own row."""
    assert (catalog.lookup(name).key, catalog.lookup(name).peak_tflops["bf16"]) == (key, bf16)


def test_gpus_without_a_fast_bf16_path_are_costed_at_what_they_have():
    assert catalog.lookup("NVIDIA GeForce RTX 4090 D") is None  # fewer SMs than the 4090: not its figures
    assert catalog.device_peak_tflops("GTX-1080-Ti", "bf16") == 11.34  # Pascal: fp32, no tensor cores
    assert catalog.device_peak_tflops("V100-SXM2-32GB", "bf16") == 125.0  # Volta: the fp16 tensor rate
    assert catalog.device_peak_tflops("GB200-186GB 1g.23gb", "bf16") == pytest.approx(2500.0 / 7)


@pytest.mark.parametrize("name, slices, gb, share", [("1g.10gb", 1, 10, 1 / 7), ("3g.71gb", 3, 71, 3 / 7),
                                                     ("1g.10gb+me", 1, 10, 1 / 7), ("1c.3g.40gb", 1, 40, 1 / 7)])
def test_mig_profiles_give_their_sm_share(name, slices, gb, share):
    profile = catalog.mig_profile(name)
    assert (profile.compute_slices, profile.memory_gb, profile.sm_share(7)) == (slices, gb, share)


def test_a_bad_mig_profile_says_the_form():
    with pytest.raises(TopologyError, match="not of the form 1g.10gb"):
        catalog.mig_profile("one-seventh")


def test_generated_machines_have_the_islands_of_their_design():
    cluster = machines.cluster("8xH100-SXM:2,4xA100-PCIE-bridged:1,8xV100-SXM2:1,8xL40S:1,1xH100-MIG7:1")
    sizes = [(i.island_id, i.size, i.interconnect, i.fully_connected) for i in cluster.nvlink_islands]
    assert sizes[:4] == [("8xh100-sxm-0-nvl0", 8, LinkKind.NVSWITCH, True),
                         ("8xh100-sxm-1-nvl0", 8, LinkKind.NVSWITCH, True),
                         ("4xa100-pcie-bridged-0-nvl0", 2, LinkKind.NVLINK, True),
                         ("4xa100-pcie-bridged-0-nvl1", 2, LinkKind.NVLINK, True)]
    assert sizes[4] == ("8xv100-sxm2-0-nvl0", 8, LinkKind.NVLINK, False)
    assert [s for _, s, _, _ in sizes[5:]] == [1] * 8  # the L40S box; the MIG GPU is in no island
    mig = cluster.node("1xh100-mig7-0")
    assert len(mig.mig_slices) == 7 and {s.profile for s in mig.mig_slices} == {"1g.10gb"}
    assert mig.mig_slices[0].peak_tflops["bf16"] == round(989.4 / 7, 2)


def test_links_between_any_two_devices():
    cluster = machines.cluster("8xH100-SXM:2,8xL40S:1,1xH100-MIG7:1")
    h0, h1, l40s, mig = (cluster.node(n) for n in ("8xh100-sxm-0", "8xh100-sxm-1", "8xl40s-0", "1xh100-mig7-0"))
    inside = cluster.link(h0.gpus[0].uuid, h0.gpus[5].uuid)
    assert (inside.kind, inside.nvlink_count, inside.bandwidth_gb_per_s, inside.pcie_path) == (
        LinkKind.NVSWITCH, 18, 450.0, LinkKind.CROSS_SOCKET)
    across = cluster.link(h0.gpus[0].uuid, h1.gpus[0].uuid)
    assert (across.kind, across.bandwidth_gb_per_s, across.latency_us) == (LinkKind.NETWORK, 200.0, 2.5)
    mixed = cluster.link(h0.gpus[0].uuid, l40s.gpus[0].uuid)
    assert (mixed.bandwidth_gb_per_s, mixed.latency_us) == (100.0, 4.0)  # 4×200G RoCE: the slower end decides
    assert cluster.link(l40s.gpus[0].uuid, l40s.gpus[1].uuid).kind == LinkKind.PCIE_SWITCH
    slices = cluster.link(mig.mig_slices[0].uuid, mig.mig_slices[1].uuid)
    assert (slices.kind, slices.bandwidth_gb_per_s) == (LinkKind.HOST_MEMORY, 23.4)
    assert cluster.island_of(h1.gpus[3].uuid).island_id == "8xh100-sxm-1-nvl0"
    with pytest.raises(TopologyError, match="no GPU or MIG slice 'GPU-nope'"):
        cluster.link("GPU-nope", h0.gpus[0].uuid)



def _in_one_nvlink_domain(spec: str) -> ClusterTopology:
    """`spec` with every GPU reporting one NVLink fabric domain (as NVML does on a GB200 NVL rack)."""
    nodes = machines.cluster(spec).nodes
    for node in nodes:
        for gpu in node.gpus:
            gpu.nvlink_domain = "rack-0"
    return ClusterTopology(nodes=nodes)


def test_an_nvlink_domain_joins_nodes_only_for_whole_gpus_of_one_island():
    whole = _in_one_nvlink_domain("1xH200:2")
    a, b = whole.nodes
    fabric = whole.link(a.gpus[0].uuid, b.gpus[0].uuid)
    assert (fabric.kind, fabric.gpu_a, fabric.gpu_b) == (LinkKind.NVSWITCH, a.gpus[0].uuid, b.gpus[0].uuid)
    mig = _in_one_nvlink_domain("1xH100-MIG7:2")
    a, b = mig.nodes
    assert mig.link(a.mig_slices[0].uuid, b.mig_slices[0].uuid).kind == LinkKind.NETWORK
    assert mig.link(a.gpus[0].uuid, b.gpus[0].uuid).kind == LinkKind.NETWORK  # MIG-mode GPUs: in no island
    assert mig.link(a.mig_slices[0].uuid, a.mig_slices[1].uuid).kind == LinkKind.HOST_MEMORY


def test_json_round_trips_every_machine():
    cluster = machines.cluster([(name, 1) for name in machines.MACHINES])
    loaded = ClusterTopology.from_dict(json.loads(cluster.to_json()))
    assert loaded == cluster and loaded.nvlink_islands == cluster.nvlink_islands


def test_a_thousand_node_cluster_builds_and_loads_quickly():
    started = time.perf_counter()
    cluster = machines.cluster("8xH100-SXM:512,8xA100-SXM:256,8xL40S:192,1xH100-MIG7:64")
    assert sum(len(node.gpus) for node in cluster.nodes) == 7744 and len(cluster.nodes) == 1024
    assert len([i for i in cluster.nvlink_islands if i.size == 8]) == 768
    assert ClusterTopology.from_dict(cluster.to_dict()) == cluster
    assert time.perf_counter() - started < 60  # about 5 s on a 2-core CI machine


def _two_gpu_json() -> dict:
    return machines.cluster("4xA100-PCIE-bridged:1").to_dict()


def _load(data: dict, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    return ClusterTopology.load(path)


def _gpu_in_two_islands(d):
    d["nvlink_islands"][1]["gpu_uuids"].append(d["nvlink_islands"][0]["gpu_uuids"][0])


def _orphan_slice(d):
    d["nodes"][0]["mig_slices"].append({"uuid": "MIG-x", "parent_uuid": "GPU-gone", "profile": "1g.10gb"})


def _slice_of_non_mig_gpu(d):
    d["nodes"][0]["mig_slices"].append({"uuid": "MIG-x", "parent_uuid": d["nodes"][0]["gpus"][0]["uuid"],
                                        "profile": "1g.10gb"})


@pytest.mark.parametrize("damage, where, what", [
    (_gpu_in_two_islands, "t.json: nvlink_islands[1].gpu_uuids", "is in two islands"),
    (_orphan_slice, "t.json: nodes[0].mig_slices[0].parent_uuid", "has no parent GPU 'GPU-gone'"),
    (_slice_of_non_mig_gpu, "t.json: nodes[0].mig_slices[0].parent_uuid", "which is not in MIG mode"),
    (lambda d: d["nodes"][0]["gpus"][1].update(uuid=d["nodes"][0]["gpus"][0]["uuid"]),
     "t.json: nodes[0].gpus[1].uuid", "is listed twice"),
    (lambda d: d["nodes"][0]["links"][0].update(kind="warp_drive"), "t.json: nodes[0].links[0].kind", "is not one of"),
    (lambda d: d["nodes"][0]["links"][0].update(kind=["nvswitch"]), "t.json: nodes[0].links[0].kind",
     "['nvswitch'] is not one of"),
    (lambda d: d["nodes"][0]["links"][0].update(nvlink_count=0), "t.json: nodes[0].links[0]", "with nvlink_count 0"),
    (lambda d: d["nodes"][0]["links"][0].update(gpu_b="GPU-elsewhere"), "t.json: nodes[0].links[0].gpu_b",
     "is not a GPU of node"),
    (lambda d: d["nodes"][0]["gpus"][0].update(memory_bytes="80GB"), "t.json: nodes[0].gpus[0].memory_bytes",
     "expected a whole number, got str"),
    (lambda d: d["nodes"][0]["gpus"][0].update(colour="green"), "t.json: nodes[0].gpus[0]", "unknown field 'colour'"),
    (lambda d: d["nodes"][0]["gpus"][0].pop("uuid"), "t.json: nodes[0].gpus[0]", "missing field 'uuid'"),
    (lambda d: d["nvlink_islands"].pop(), "t.json: nvlink_islands", "is missing"),
    (lambda d: d["nvlink_islands"][0]["gpu_uuids"].pop(), "t.json: nvlink_islands[0]", "does not match the NVLink"),
    (lambda d: d.update(version=9), "t.json: version", "topology version 9"),
])
def test_bad_json_names_the_field(tmp_path, damage, where, what):
    data = _two_gpu_json()
    damage(data)
    with pytest.raises(TopologyError) as caught:
        _load(data, tmp_path)
    assert caught.value.where == f"{tmp_path}/{where}"
    assert what in caught.value.what


def test_a_file_that_is_not_json_says_where(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"format": ')
    with pytest.raises(TopologyError, match=r"t.json: not JSON: Expecting value at line 1 column 12"):
        ClusterTopology.load(path)



def test_a_topology_path_that_is_not_a_readable_file_says_so(tmp_path):
    for path, reason in [(tmp_path, "Is a directory"), (tmp_path / "none.json", "No such file or directory")]:
        with pytest.raises(TopologyError) as refused:
            ClusterTopology.load(path)
        assert refused.value.where == str(path) and refused.value.what == f"cannot read it ({reason})"


def test_from_json_reads_what_to_json_wrote():
    cluster = machines.cluster("4xA100-PCIE-bridged:1")
    assert ClusterTopology.from_json(cluster.to_json()) == cluster
    with pytest.raises(TopologyError, match="node-a.json: not an archipelago topology"):
        ClusterTopology.from_json('{"format": "archipelago.plan"}', where="node-a.json")

def test_islands_are_recomputed_when_the_file_has_none(tmp_path):
    data = _two_gpu_json()
    del data["nvlink_islands"]
    assert [i.size for i in _load(data, tmp_path).nvlink_islands] == [2, 2]
