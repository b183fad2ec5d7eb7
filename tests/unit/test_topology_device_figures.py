"""Measured device figures: the micro-benchmark on this machine's CPUs, and the per-node, per-driver cache
the probe keeps them in (with the child process replaced by a fake that counts its runs)."""

from __future__ import annotations

import os
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from core.errors import TopologyError
from topology import ClusterTopology, Gpu, NodeTopology
from topology.cluster import MeasuredDevice
from topology.device_bench import (REFERENCE_BLOCK, BlockShape, block_training_flops, copy_gb_per_s, gpus_to_measure,
                                   measure_cpu)
from topology.device_figures import CACHE_FILE, DeviceBench
from topology.probe import probe_local_node

H200 = MeasuredDevice(name="NVIDIA H200", bf16_tflops=781.0, fp8_tflops=1304.0, fp32_tflops=51.0,
                      memory_gb_per_s=4290.0, host_to_device_gb_per_s=52.0, device_to_host_gb_per_s=49.0,
                      peer_gb_per_s=370.0, seconds=2.9)
CPU = MeasuredDevice(name="cpu", fp32_tflops=0.051, bf16_tflops=0.006, memory_gb_per_s=5.1, cores=2, seconds=1.8)


class FakeChild:
    """What `python -m topology.device_bench --json` prints, and how often it was asked."""

    def __init__(self, *devices: MeasuredDevice, fail: bool = False):
        self.devices, self.fail, self.runs = devices, fail, 0

    def __call__(self, seconds: float, timeout_s: float) -> dict:
        self.runs += 1
        if self.fail:
            raise TopologyError("the device micro-benchmark failed (CUDA error: out of memory)", where="topology probe")
        cores = len(os.sched_getaffinity(0))
        return {"devices": [asdict(d) | ({"cores": cores} if d.name == "cpu" else {}) for d in self.devices],
                "notes": [], "torch": torch.__version__}


def node(driver: str = "580.159.04", *names: str) -> NodeTopology:
    gpus = [Gpu(uuid=f"GPU-{i}", index=i, name=name) for i, name in enumerate(names or ("NVIDIA H200",))]
    return NodeTopology(node_id="h200-host", hostname="h200-host", driver_version=driver, gpus=gpus)


def test_the_benchmark_measures_this_machines_cpus_per_core():
    figures = measure_cpu(seconds=0.02)
    assert figures.name == "cpu" and figures.cores == len(os.sched_getaffinity(0))
    # Per core: a 2026 server core does 10-300 GFLOP/s of fp32 products, not the machine's total; bf16 up
    # to a few TFLOP/s where the core has AMX tiles (1.48 on a Sapphire Rapids-class Xeon core).
    assert 0.002 < figures.fp32_tflops < 0.5 and 0 < figures.bf16_tflops < 5.0
    assert 0.1 < figures.memory_gb_per_s < 200
    # Training the reference block reaches less than the big product, never 100x less (on the 2-core EPYC: 55 of ~100).
    assert 0.001 < figures.fp32_block_tflops < 0.5
    both_ends = copy_gb_per_s(torch.device("cpu"), torch.device("cpu"), 2**20, 0.01, count_both_ends=True)
    assert both_ends > 0


def test_the_reference_block_is_counted_as_the_planner_counts_a_models_flops():
    """6 FLOPs a weight a token (12·width² weights) and attention in full (12·width·T), as model_size counts:
    the block's rate then prices the model's counted FLOPs."""
    assert (REFERENCE_BLOCK.width, REFERENCE_BLOCK.seq_len, REFERENCE_BLOCK.batch) == (128, 128, 16)
    tokens, width, seq_len = 16 * 128, 128, 128
    assert block_training_flops(REFERENCE_BLOCK) == tokens * (72 * width**2 + 12 * width * seq_len) == 2_818_572_288
    assert block_training_flops(BlockShape(width=64, heads=2, seq_len=32, batch=2)) == 64 * (72 * 64**2 + 12 * 64 * 32)


def test_one_gpu_of_each_model_is_measured_with_a_peer_of_its_model():
    names = ["NVIDIA H200", "NVIDIA L4", "NVIDIA H200", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H200"]
    assert gpus_to_measure(names) == [(0, 2), (1, None)]  # no MIG device: a slice is its parent's share


def test_figures_are_measured_once_per_node_and_driver(tmp_path):
    child = FakeChild(CPU, H200)
    bench = DeviceBench(cache_dir=tmp_path, run_child=child)
    first, notes = bench.figures(node())
    assert child.runs == 1 and notes == [] and (tmp_path / CACHE_FILE).is_file()
    assert {d.name: d.driver_version for d in first} == {"cpu": "", "NVIDIA H200": "580.159.04"}
    again, notes = DeviceBench(cache_dir=tmp_path, run_child=child).figures(node())  # another probe on the host
    assert child.runs == 1 and again == first and notes == []


def test_figures_from_another_driver_are_dropped_with_a_note_and_measured_again(tmp_path):
    child = FakeChild(CPU, H200)
    bench = DeviceBench(cache_dir=tmp_path, run_child=child)
    bench.figures(node("570.86.15"))
    figures, notes = bench.figures(node("580.159.04"))
    assert child.runs == 2
    assert notes == ["dropped device figures measured under driver 570.86.15: the driver is now 580.159.04; "
                     "measured again"]
    assert [d.driver_version for d in figures if d.name != "cpu"] == ["580.159.04"]
    bench.figures(node("580.159.04", "NVIDIA H200", "NVIDIA L4"))  # a GPU model the cache has no figure for
    assert child.runs == 3


def test_figures_older_than_an_hour_are_measured_again_with_a_note(tmp_path):
    """A shared host's speed drifts: the CPU demo planned from two-hour-old figures was 25 % off."""
    child, now = FakeChild(CPU, H200), [1_000_000.0]
    bench = DeviceBench(cache_dir=tmp_path, run_child=child, clock=lambda: now[0])
    bench.figures(node())
    now[0] += 3599
    _, notes = bench.figures(node())
    assert child.runs == 1 and notes == []
    now[0] += 2
    _, notes = bench.figures(node())
    assert child.runs == 2 and notes == ["dropped device figures measured 60 min ago (more than 60 min: a host's "
                                         "speed drifts); measured again"]
    now[0] -= 600  # a clock set back: figures "from the future" are not trusted either
    _, notes = bench.figures(node())
    assert child.runs == 3 and notes == ["dropped device figures dated after now (the clock was set back); "
                                         "measured again"]


def test_a_failed_or_switched_off_benchmark_is_a_note_and_no_figures(tmp_path, monkeypatch):
    figures, notes = DeviceBench(cache_dir=tmp_path, run_child=FakeChild(fail=True)).figures(node())
    assert figures == [] and notes[0].startswith("device figures not measured: the device micro-benchmark failed")
    assert not (tmp_path / CACHE_FILE).exists()  # nothing cached: the next probe tries again
    monkeypatch.setenv("ARCHIPELAGO_DEVICE_BENCH_S", "0")
    monkeypatch.setenv("ARCHIPELAGO_CACHE_DIR", str(tmp_path))
    figures, notes = DeviceBench.from_environment().figures(node())
    assert figures == [] and "ARCHIPELAGO_DEVICE_BENCH_S=0" in notes[0]
    monkeypatch.setenv("ARCHIPELAGO_DEVICE_BENCH_S", "fast")
    with pytest.raises(TopologyError, match="'fast' is not a number"):
        DeviceBench.from_environment()


def test_a_damaged_cache_is_measured_again(tmp_path):
    (tmp_path / CACHE_FILE).write_text('{"format": "archipelago.device-figures", "version": 1, "hosts": [')
    child = FakeChild(CPU, H200)
    figures, _ = DeviceBench(cache_dir=tmp_path, run_child=child).figures(node())
    assert child.runs == 1 and len(figures) == 2


def test_the_probe_records_the_figures_in_the_map_and_json_keeps_them(tmp_path):
    class NVMLError(Exception):
        value = 9  # NVML_ERROR_DRIVER_NOT_LOADED

    def no_driver():
        raise NVMLError()
    nvml = SimpleNamespace(NVMLError=NVMLError, nvmlInit=no_driver)
    bench = DeviceBench(cache_dir=tmp_path, run_child=FakeChild(CPU))
    probed = probe_local_node(nvml_module=nvml, root=tmp_path, hostname="cpu-host", bench=bench)
    assert [d.name for d in probed.measured] == ["cpu"] and probed.measured[0].fp32_tflops == 0.051
    loaded = ClusterTopology.from_json(ClusterTopology(nodes=[probed]).to_json())
    assert loaded.nodes[0].measured == probed.measured
