"""benchmarks/multigpu.py's calibration row: the DDP compute slowdown it measures for the planner."""

import pytest

from tests.benchmark_support import load_benchmark


@pytest.fixture(scope="module")
def multigpu():
    return load_benchmark("multigpu")


def test_the_slowdown_is_the_ddpoptimizer_rows_compute_beyond_one_gpu(multigpu):
    ddp, fsdp = multigpu.ENGINE_CONFIGS["ddp_optimizer"][0], multigpu.ENGINE_CONFIGS["fsdp"][0]
    rows = [{"model": "small", "config": "engine, 1 GPU", "step_ms": 60.0},
            {"model": "small", "config": ddp, "step_ms": 66.0, "compute_slowdown_vs_1gpu": 0.09},
            {"model": "large", "config": ddp, "step_ms": 220.0, "compute_slowdown_vs_1gpu": 0.1},
            {"model": "large", "config": fsdp, "step_ms": 230.0, "step_overhead_vs_1gpu": 0.15},
            {"model": "failed", "config": ddp, "error": "rank 0: out of memory"}]
    assert multigpu.measured_ddp_compute_slowdown(rows) == pytest.approx(0.095)
    assert multigpu.measured_ddp_compute_slowdown(rows[3:]) is None
