"""benchmarks/device_probe.py's CPU row on this machine: the share of the probe's product rate the demo
model's training step reaches on one core (ComputeModel's CPU_UTILISATION_OF_MEASURED comes from it)."""

from tests.benchmark_support import load_benchmark


def test_the_cpu_row_puts_the_demo_step_beside_the_probes_product_rate():
    probe = load_benchmark("device_probe")
    row = probe.cpu_row(rounds=1, steps=1, seconds=0.02)
    assert row["flops_per_step"] > 1e10  # the demo model, micro-batch 16 of 128 tokens: 11.9 GFLOP
    assert 0.001 < row["probe_fp32_tflops"] < 0.5 and row["step_ms"] > 0
    # A small transformer on one core reaches a good part of a large product's rate, never more than all of it.
    assert 0.1 < row["share_of_product_rate"] < 1.2, row
