"""benchmarks/compile_check.py on CPU: a row compiles the old head (final norm outside the fused loss
op), records both of the check's comparisons, and puts GPT.head back."""

import os

import pytest

from tests.benchmark_support import load_benchmark
from workers.models.gpt import GPT

CACHES_OFF = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"


@pytest.fixture
def compile_check(monkeypatch):
    was_set = CACHES_OFF in os.environ
    module = load_benchmark("compile_check")
    if not was_set:  # the script turns the caches off for its own process, not for the test session's
        os.environ.pop(CACHES_OFF, None)
    monkeypatch.setattr(module.step, "DEVICE", "cpu")
    monkeypatch.setitem(module.step.MODELS, "tiny", ({"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 32,
                                                     "vocab_size": 257}, 4))
    monkeypatch.setattr(module, "PRECISIONS", {"fp32": {"train": {"precision": "fp32"},
                                                        "cluster": {"use_gpu": False, "num_workers": 1}}})
    return module


def test_a_row_with_the_old_head_records_both_comparisons_and_restores_the_head(compile_check):
    head = GPT.head
    data = compile_check.step.TextBatches(4, 32, steps=1)
    row = compile_check.first_step("tiny", "fp32", "norm outside, largest block", data)
    assert GPT.head is head
    assert row["compiled_loss"] == pytest.approx(row["eager_loss"], rel=1e-5)
    assert row["relative_difference"] < 1e-5 and row["gradient_difference"] < 1e-4
    assert row["gradient_worst"] in row["largest_gradient_differences"]
    assert row["stopped_by"] == [] and row["held"] == {}  # no Triton kernels on CPU to hold
