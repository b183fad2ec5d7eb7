"""benchmarks/multigpu.py's calibration row: the DDP compute slowdown it measures for the planner."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "multigpu.py"


@pytest.fixture(scope="module")
def multigpu():
    spec = importlib.util.spec_from_file_location("multigpu_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_slowdown_is_ddps_step_beyond_one_gpus_less_what_it_waited_for(multigpu):
    ddp = multigpu.ENGINE_CONFIGS["ddp_optimizer"][0]
    rows = [{"model": "small", "config": multigpu.ALONE_LABEL, "step_ms": 60.0},
            {"model": "small", "config": ddp, "step_ms": 66.0, "exposed_comm_s": 0.0006},  # 65.4 ms busy: +9 %
            {"model": "large", "config": multigpu.ALONE_LABEL, "step_ms": 200.0},
            {"model": "large", "config": ddp, "step_ms": 220.0},  # +10 %
            {"model": "failed", "config": multigpu.ALONE_LABEL, "error": "rank 0: out of memory"},
            {"model": "failed", "config": ddp, "step_ms": 10.0}]
    assert multigpu.measured_ddp_compute_slowdown(rows) == pytest.approx(0.095)
    assert multigpu.measured_ddp_compute_slowdown(rows[4:]) is None
