"""The probe's micro-benchmark on a real GPU: its figures against the catalog's data sheet, and the
child process the live probe runs.

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_device_bench_gpu.py -p no:cacheprovider
"""

import pytest
import torch

from topology import catalog
from topology.cluster import NodeTopology
from topology.device_bench import gpus_to_measure, measure_gpu
from topology.device_figures import DeviceBench

pytestmark = pytest.mark.gpu


def test_the_measured_rates_are_a_plausible_share_of_the_data_sheet():
    notes: list[str] = []
    (index, peer), *_ = gpus_to_measure([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    figures = measure_gpu(index, peer, 0.3, notes)
    model = catalog.lookup(figures.name)
    assert model is not None, f"{figures.name} is not in the catalog"
    # Large GEMMs reach 60-95 % of the dense peak (an H200 at its 700 W cap: 769-798 of 989 TFLOP/s),
    # a copy 75-95 % of the memory's nominal bandwidth (H200: 4.3 of 4.8 TB/s).
    assert 0.6 * model.peak_tflops["bf16"] <= figures.bf16_tflops <= 1.0 * model.peak_tflops["bf16"], figures
    assert 0.7 * model.memory_gb_per_s <= figures.memory_gb_per_s <= 1.0 * model.memory_gb_per_s, figures
    if "fp8" in model.peak_tflops:
        assert figures.fp8_tflops > figures.bf16_tflops, (figures, notes)
    assert 5 <= figures.host_to_device_gb_per_s <= 130, figures  # PCIe 3 x16 … 6 x16
    if peer is not None:
        assert figures.peer_gb_per_s > 5, figures


def test_the_probes_child_process_measures_every_gpu_model(tmp_path):
    node = NodeTopology(node_id="here", hostname="here", driver_version="test")
    figures, notes = DeviceBench(seconds_per_figure=0.1, cache_dir=tmp_path).figures(node)
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    assert {f.name for f in figures} == names | {"cpu"}, notes
    assert all(f.driver_version == "test" for f in figures if f.name != "cpu")
