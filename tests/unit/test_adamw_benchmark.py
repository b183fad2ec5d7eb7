"""benchmarks/adamw.py's smoke run on the CPU: every row steps the model's own parameters and is set
beside the baselines (its figures are a GPU's to give; on the CPU the rows run the kernels' twins)."""

import pytest

from tests.benchmark_support import load_benchmark


def test_every_row_runs_on_the_model_s_parameters_beside_the_baselines():
    adamw = load_benchmark("adamw")
    shapes = adamw.parameter_shapes("tiny")
    rows = adamw.main(["--cpu", "--model", "tiny", "--steps", "2", "--warmup", "1"])
    assert [r["row"] for r in rows] == list(adamw.ROWS)
    assert all(r["parameters"] == sum(s.numel() for s in shapes) and r["tensors"] == len(shapes) for r in rows)
    assert all(r["ms"] > 0 and r["gb_per_s"] > 0 for r in rows)
    scaled = next(r for r in rows if r["row"] == "fused + scale")
    assert scaled["vs_fused_scale"] == 1.0
    assert scaled["gb_per_s"] == pytest.approx(32 * scaled["parameters"] / scaled["ms"] / 1e6)  # 32 bytes a parameter
