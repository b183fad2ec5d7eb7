"""Where the planner's device figures come from: a [devices] table, a measured map, or the catalog; and
what it says when nothing describes a GPU."""

from __future__ import annotations

import pytest

from core.config import JobConfig
from core.errors import ConfigError, PlacementError
from core.plan import DeviceBasis
from planning.compute import ComputeModel
from planning.figures import MEASURED_MATMUL_SHARE_OF_PEAK
from planning.planner import Planner
from topology import ClusterTopology, machines
from topology.cluster import MeasuredDevice
from topology.nvidia_smi import parse_node

TINY_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128, "vocab_size": 257}
RTX_3090 = "NVIDIA GeForce RTX 3090"
TWO_3090S = f"""GPU 0: {RTX_3090} (UUID: GPU-0b8a1c55-1d54-4c9e-8f27-3e1c2b6a7d01)
GPU 1: {RTX_3090} (UUID: GPU-0b8a1c55-1d54-4c9e-8f27-3e1c2b6a7d02)
	GPU0	GPU1	CPU Affinity	NUMA Affinity	GPU NUMA ID
GPU0	 X 	NV4	0-31	0		N/A
GPU1	NV4	 X 	0-31	0		N/A
"""
DECLARED = {RTX_3090: {"bf16_tflops": 71.0, "memory_gib": 24.0, "price": 0.35}}


def job(**sections) -> JobConfig:
    base = {"name": "t", "model": TINY_MODEL, "cluster": {"use_gpu": True},
            "train": {"global_batch_size": 64, "micro_batch_size": 16, "steps": 1000}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return JobConfig.from_dict(base)


def plan(topology: ClusterTopology, config: JobConfig | None = None, **kwargs):
    return Planner(topology, config or job(), exact_memory=False, **kwargs).plan()


def text_node(text: str = TWO_3090S, node_id: str = "box-a"):
    """The two-GPU box's text, with UUIDs of its own for each node id."""
    return parse_node(text.replace("GPU-0b8a1c55", f"GPU-{sum(map(ord, node_id)):08x}"), node_id=node_id,
                      source=f"{node_id}.txt")


def test_gpus_nothing_describes_are_named_with_both_ways_to_describe_them():
    with pytest.raises(PlacementError) as refused:
        plan(ClusterTopology(nodes=[text_node()]))
    assert "models the device catalog lacks" in refused.value.what and f"2× {RTX_3090}" in refused.value.what
    assert "has no GPUs" not in str(refused.value)
    assert f'[devices."{RTX_3090}"]' in refused.value.fix and "archipelago topology --local --json" in refused.value.fix
    without_names = "\n".join(TWO_3090S.splitlines()[2:])  # the matrix alone, no `nvidia-smi -L` lines
    with pytest.raises(PlacementError, match="2 GPUs have no model name") as refused:
        plan(ClusterTopology(nodes=[text_node(without_names)]))
    assert "nvidia-smi -L" in refused.value.fix


def test_a_devices_table_plans_them_at_its_figures_and_price():
    result = plan(ClusterTopology(nodes=[text_node()]), job(devices=DECLARED))
    assert result.world_size == 2
    assert result.device_bases == [DeviceBasis(device_model=RTX_3090, model=RTX_3090, source="declared", tflops=71.0)]
    assert {w.memory_capacity_bytes for w in result.workers} == {24 * 2**30}  # the text has no memory
    assert result.predicted.dollars_per_hour == pytest.approx(2 * 0.35)
    # Spelled as a catalog key or in another case, a table names the same GPUs.
    assert plan(ClusterTopology(nodes=[text_node()]), job(devices={RTX_3090.upper(): DECLARED[RTX_3090]})).world_size == 2


def test_a_declared_bandwidth_prices_a_compiled_steps_memory_traffic():
    """Without one, a declared GPU's traffic runs at an A100's 2 TB/s; the RTX 3090's data sheet says 936 GB/s."""
    def compute_seconds(devices: dict) -> float:
        return plan(ClusterTopology(nodes=[text_node()]), job(devices=devices, compile={"enable": True})).predicted.compute_seconds

    default = compute_seconds(DECLARED)
    slower = compute_seconds({RTX_3090: {**DECLARED[RTX_3090], "memory_gb_per_s": 936.0}})
    faster = compute_seconds({RTX_3090: {**DECLARED[RTX_3090], "memory_gb_per_s": 4000.0}})
    assert faster < default < slower


@pytest.mark.parametrize("figures, problem", [({"bf16_tflops": -71.0, "memory_gib": 24.0, "price": 0.35},
                                               "bf16_tflops: must be a positive number, got -71.0"),
                                              ({"bf16_tflops": 71.0, "price": 0.35}, "memory_gib: is missing"),
                                              ({"bf16_tflops": 71.0, "memory_gib": 24.0, "price": float("nan")},
                                               "price: must be a number ≥ 0, got nan"),
                                              ({**DECLARED[RTX_3090], "memory_gb_per_s": float("nan")},
                                               "memory_gb_per_s: must be a positive number, got nan")])
def test_a_devices_table_with_a_bad_or_missing_figure_is_refused_by_name(figures, problem):
    with pytest.raises(ConfigError) as refused:
        job(devices={RTX_3090: figures})
    assert str(refused.value).startswith(f'[devices."{RTX_3090}"] {problem}')


def test_a_measured_map_plans_the_same_model_on_nodes_imported_from_text():
    probed = text_node(node_id="box-a")
    probed.driver_version = "580.95.05"
    for gpu in probed.gpus:  # what NVML said on the probed machine
        gpu.memory_bytes = 24 * 2**30
    probed.measured = [MeasuredDevice(name=RTX_3090, driver_version="580.95.05", bf16_tflops=61.0)]
    result = plan(ClusterTopology(nodes=[probed, text_node(node_id="box-b")]), job(placement={"min_gpus": 4}))
    assert result.world_size == 4 and {w.node_id for w in result.workers} == {"box-a", "box-b"}
    assert result.device_bases == [DeviceBasis(device_model=RTX_3090, model=RTX_3090, source="measured", tflops=61.0)]
    assert {w.memory_capacity_bytes for w in result.workers} == {24 * 2**30}


def test_a_measured_gpu_plans_as_fast_as_its_measured_rate_says():
    flops_only = ComputeModel(micro_step_overhead_s_per_layer=0.0)
    catalog_plan = plan(machines.cluster("1xH200:1"), compute=flops_only)
    assert catalog_plan.device_bases == [DeviceBasis(device_model="H200-SXM5-141GB", model="H200-SXM5-141GB", source="catalog", tflops=989.4)]
    for rate, ratio in ((989.4 * MEASURED_MATMUL_SHARE_OF_PEAK, 1.0), (989.4 * MEASURED_MATMUL_SHARE_OF_PEAK / 2, 2.0)):
        measured = machines.cluster("1xH200:1")
        measured.nodes[0].measured = [MeasuredDevice(name="NVIDIA H200", bf16_tflops=rate)]
        result = plan(measured, compute=flops_only)
        assert result.device_bases[0].source == "measured"
        assert result.predicted.compute_seconds == pytest.approx(catalog_plan.predicted.compute_seconds * ratio, rel=0.03)


def test_a_figure_measured_under_another_driver_is_dropped_with_a_note():
    cluster = machines.cluster("1xH200:1")
    cluster.nodes[0].driver_version = "580.159.04"
    cluster.nodes[0].measured = [MeasuredDevice(name="NVIDIA H200", driver_version="570.86.15", bf16_tflops=400.0)]
    result = plan(cluster)
    assert result.device_bases[0].source == "catalog"
    assert any(note.startswith("dropped the NVIDIA H200 figures measured under driver 570.86.15 for 1xh200-0, "
                               "which runs driver 580.159.04") for note in result.notes)


def test_known_gpus_plan_and_the_notes_name_the_ones_left_out():
    cluster = machines.cluster("1xH200:1")
    cluster.nodes.append(text_node())
    result = plan(ClusterTopology(nodes=cluster.nodes), job(devices={"NVIDIA B300": DECLARED[RTX_3090]}))
    assert {w.device_model for w in result.workers} == {"H200-SXM5-141GB"}
    assert any(f"left out GPUs nothing gives figures for (2× {RTX_3090})" in note for note in result.notes)
    assert any('[devices."NVIDIA B300"] matches no GPU of the cluster' in note for note in result.notes)


def test_no_gpus_at_all_and_gpus_all_in_mig_mode_say_what_the_cluster_has():
    laptop = ClusterTopology(nodes=[machines.node("8xL40S", "l40s")])
    laptop.nodes[0].gpus, laptop.nodes[0].links, laptop.nodes[0].nics = [], [], []
    with pytest.raises(PlacementError, match="the cluster has no GPUs and MIG slices") as refused:
        plan(ClusterTopology(nodes=laptop.nodes))
    assert "use_gpu = false" in refused.value.fix
    with pytest.raises(PlacementError, match="none of the cluster's 1 GPUs can take a worker: 1 in MIG mode, and "
                                             r"\[placement\] use_mig = false"):
        plan(machines.cluster("1xH100-MIG7:1"), job(placement={"use_mig": False}))
