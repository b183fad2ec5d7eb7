"""Every machine in examples/topologies plans a GPU job: the probe's own maps, and `nvidia-smi -L;
nvidia-smi topo -m` texts of machines people train on (8x RTX 4090 behind PCIe switches, 4x RTX 6000
Ada on two sockets, 8x RTX A6000 in NVLink pairs, a 4x GB200 tray with Grace, 2x GTX 1080 Ti)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import JobConfig
from planning.memory import profile
from planning.planner import Planner
from topology import LinkKind, load_files

EXAMPLES = Path(__file__).parents[2] / "examples/topologies"
MAPS = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".json", ".txt") and ".calibration." not in p.name)
GPU_JOB = JobConfig.from_dict({"name": "gpu", "cluster": {"use_gpu": True},
                               "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128},
                               "train": {"global_batch_size": 64, "micro_batch_size": 16}})
# name: (device model, GPUs, NVLink islands of 2+, the link class between GPU0 and GPU1)
SHAPES = {
    "8xrtx4090-pcie-switches": ("RTX-4090", 8, 0, LinkKind.HOST_MEMORY),  # no peer-to-peer on GeForce 40
    "4xrtx6000ada-two-sockets": ("RTX-6000-Ada", 4, 0, LinkKind.SAME_SOCKET),
    "8xrtxa6000-nvlink-pairs": ("RTX-A6000", 8, 4, LinkKind.NVLINK),
    "4xgb200-grace": ("GB200-186GB", 4, 1, LinkKind.NVSWITCH),
    "2xgtx1080ti-desktop": ("GTX-1080-Ti", 2, 0, LinkKind.HOST_BRIDGE),
}


@pytest.fixture(scope="module")
def memory():
    return profile(GPU_JOB, device_type="cuda")  # the slow part of planning, the same for every map


def test_the_examples_hold_every_shape_the_planner_is_held_to():
    assert {p.name.split(".")[0] for p in MAPS} >= set(SHAPES)


@pytest.mark.parametrize("path", MAPS, ids=lambda p: p.name)
def test_every_example_machine_plans_a_gpu_job(path, memory):
    cluster = load_files([path])
    plan = Planner(cluster, GPU_JOB, memory=memory, exact_memory=False).plan()
    assert plan.uses_gpus and plan.world_size >= 1 and plan.predicted.step_seconds > 0
    shape = SHAPES.get(path.name.split(".")[0])
    if shape is None:
        return
    model, gpus, islands, link = shape
    node = cluster.nodes[0]
    assert [gpu.model for gpu in node.gpus] == [model] * gpus
    assert sum(1 for island in cluster.nvlink_islands if island.size > 1) == islands
    assert cluster.link(node.gpus[0].uuid, node.gpus[1].uuid).kind == link
    assert {basis.source for basis in plan.device_bases} == {"catalog"}


def test_a_gpu_without_16_bit_tensor_cores_is_planned_at_fp32_and_the_notes_say_so(memory):
    cluster = load_files([EXAMPLES / "2xgtx1080ti-desktop.nvidia-smi.txt"])
    plan = Planner(cluster, GPU_JOB, memory=memory, exact_memory=False).plan()
    assert plan.device_bases[0].tflops == 11.34  # the fp32 rate: Pascal has no tensor cores
    assert 'GTX-1080-Ti has no bf16 or fp16 tensor cores: costed at its fp32 rate; set [train] precision = "fp32"' \
        in " ".join(plan.notes)
