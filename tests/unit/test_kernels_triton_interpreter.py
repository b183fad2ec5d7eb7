"""The Triton kernels, run by Triton's CPU interpreter, against the torch twins.

Catches logic errors in the kernels on a machine without a GPU, wherever triton is installed
(the CPU-only venv has none, so there this skips). The interpreter runs programs one after
another, in order, so payloads come out in the twin's order and compare whole; it cannot find
races or check speed: tests/gpu does that. It runs in a child
process because TRITON_INTERPRET must be set before the kernels are defined, and must not leak
into compiled runs in this process.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed; install it to check the kernels in its interpreter")

CHILD = r"""
import json, torch
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter turns a scalar into an int with int(array of shape (1,)), which numpy
# >= 2.3 refuses; loops with run-time bounds need it.
_patch_tensor = interpreter._patch_lang_tensor
def _patch_tensor_index(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
interpreter._patch_lang_tensor = _patch_tensor_index

from kernels import reference, triton_kernels
from kernels.payload import PayloadLayout, allocate
from kernels.plan import SelectionPlan

def run(backend, source, residual, plan, layout):
    out, workspace = allocate(layout, plan, source.device)
    backend.select(source, residual, plan, out, workspace)
    return out, workspace

results = []
for numel, dtype, block, k_ratio, with_residual in [(20_011, torch.float32, 512, 0.01, True),
                                                     (12_000, torch.bfloat16, 128, 0.2, True),
                                                     (30_000, torch.float32, None, 0.01, False),
                                                     (50_000, None, 1024, 0.01, True)]:
    gen = torch.Generator().manual_seed(numel)
    if dtype is None:  # all magnitudes tie: every element is chosen, staging flushes mid-run, capacity overflows
        source = torch.randn(numel, generator=gen).sign()
        dtype = torch.float32
    else:
        source = (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)).to(dtype)
    residual = torch.randn(numel, generator=gen) * 0.1 if with_residual else None
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8 if block else dtype, block)
    twin_residual = residual.clone() if with_residual else None
    got, got_hist = run(triton_kernels, source, residual, plan, layout)
    want, want_hist = run(reference, source, twin_residual, plan, layout)
    row = {"payload": torch.equal(got.payload, want.payload), "workspace": torch.equal(got_hist, want_hist),
           "residual": (not with_residual) or torch.equal(residual, twin_residual), "sent": want.sent()}
    if block:
        dense_got, dense_want = torch.full((numel,), 0.5), torch.full((numel,), 0.5)
        triton_kernels.decompress_accumulate(dense_got, got)
        reference.decompress_accumulate(dense_want, want)
        row["decompress"] = torch.equal(dense_got, dense_want)
        # Three ranks' payloads (this one, one from the negated bucket, this one again) summed at once.
        other, _ = run(reference, -source, torch.zeros(numel), plan, layout)
        payloads = torch.stack([want.payload, other.payload, want.payload])
        sum_got, sum_want = torch.full((numel,), float("nan")), torch.full((numel,), float("nan"))
        triton_kernels.decompress_sum(sum_got, payloads, layout, 3.0)
        reference.decompress_sum(sum_want, payloads, layout, 3.0)
        row["decompress_sum"] = torch.equal(sum_got, sum_want)
    results.append(row)
print(json.dumps(results))
"""


def test_interpreted_kernels_match_the_twins_bit_for_bit():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for row in results:
        assert row.pop("sent") > 0
        assert all(row.values()), row
