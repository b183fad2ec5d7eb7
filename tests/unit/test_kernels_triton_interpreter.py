"""The Triton kernels, run by Triton's CPU interpreter, against the torch twins.

Catches logic errors in the kernels on a machine without a GPU, wherever triton is installed
(the CPU-only venv has none, so there this skips). The interpreter runs programs one after
another, in id order, so every wait of the selection kernel's phases is over when it starts and
payloads compare whole. A second run starts every program in a thread of its own, highest id
first, so a program that waits runs before the programs it waits for: one that reads what
another writes before waiting for it reads garbage, and one that forgets a wait sees nothing.
Neither finds what only a GPU's memory ordering or speed shows (nor what Triton's GPU compiler
passes do, which the interpreter skips): tests/gpu does that. Each runs in a child process
(tests/interpreter_support.py).
"""

import importlib.util
import json

import pytest

from tests.interpreter_support import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed; install it to check the kernels in its interpreter")

PRELUDE = r"""
import inspect, json, sys, threading, time, types, torch

from kernels import reference, triton_kernels
from kernels.payload import PayloadLayout, allocate
from kernels.selection import SelectionPlan

# The tuning under test (how the selection pass and decompress_sum are cut into programs).
tuning = json.loads(sys.argv[1])
triton_kernels.COMPRESS_TUNING = triton_kernels.Tuning(**tuning["compress"])
triton_kernels.TOPK_TUNING = triton_kernels.Tuning(**tuning["topk"])
triton_kernels.SUM_TUNING = triton_kernels.SumTuning(**tuning["sum"])

def run(backend, source, residual, plan, layout):
    out, workspace = allocate(layout, plan, source.device)
    backend.select(source, residual, plan, out, workspace)
    return out, workspace

def bucket(numel, dtype, with_residual):
    gen = torch.Generator().manual_seed(numel)
    if dtype is None:  # all magnitudes tie: every element is chosen and capacity overflows
        source = torch.randn(numel, generator=gen).sign()
    else:
        source = (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)).to(dtype)
    return source, torch.randn(numel, generator=gen) * 0.1 if with_residual else None
"""

IN_ORDER = PRELUDE + r"""
results = []
# decompress_sum of 3 ranks divides at the end, of 4 scales first; 10 ranks fill its pipeline.
for numel, dtype, block, k_ratio, with_residual, sums in [(20_011, torch.float32, 512, 0.01, True, (3, 4, 10)),
                                                           (12_000, torch.bfloat16, 128, 0.2, True, (3, 4, 10)),
                                                           (30_000, torch.float32, None, 0.01, False, ()),
                                                           (50_000, None, 1024, 0.01, True, (3,)),
                                                           # sampled in runs; three and two groups of 2**18
                                                           (600_001, torch.float32, 8192, 0.001, True, (2,)),
                                                           (300_001, torch.float32, None, 0.01, False, ())]:
    source, residual = bucket(numel, dtype, with_residual)
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8 if block else source.dtype, block)
    twin_residual = residual.clone() if with_residual else None
    got, got_hist = run(triton_kernels, source, residual, plan, layout)
    want, want_hist = run(reference, source, twin_residual, plan, layout)
    row = {"payload": torch.equal(got.payload, want.payload),
           "histograms": all(map(torch.equal, reference.histograms(got_hist), reference.histograms(want_hist))),
           "residual": (not with_residual) or torch.equal(residual, twin_residual), "sent": want.sent()}
    if block:
        dense_got, dense_want = torch.full((numel,), 0.5), torch.full((numel,), 0.5)
        triton_kernels.decompress_accumulate(dense_got, got)
        reference.decompress_accumulate(dense_want, want)
        row["decompress"] = torch.equal(dense_got, dense_want)
        # Payloads of several ranks (this one, one from the negated bucket, this one again, ...) at once.
        other, _ = run(reference, -source, torch.zeros(numel), plan, layout)
        for ranks in sums:
            payloads = torch.stack([(want, other)[r % 2].payload for r in range(ranks)])
            sum_got, sum_want = torch.full((numel,), float("nan")), torch.full((numel,), float("nan"))
            triton_kernels.decompress_sum(sum_got, payloads, layout, float(ranks))
            reference.decompress_sum(sum_want, payloads, layout, float(ranks))
            row[f"decompress_sum_{ranks}"] = torch.equal(sum_got, sum_want)
    results.append(row)
print(json.dumps(results))
"""

CONCURRENT = PRELUDE + r"""
# Every program in a thread of its own (its id kept per thread), all started once the grid is
# laid out, the highest id first.
_local = threading.local()
type(interpreter.interpreter_builder).grid_idx = property(lambda self: getattr(_local, "idx", None),
                                                          lambda self, idx: setattr(_local, "idx", idx))
_call = interpreter.GridExecutor.__call__

def _concurrent_call(self, *args, **kwargs):
    fn, threads, errors = self.fn, [], []
    threading_, builder, local = threading, interpreter.interpreter_builder, _local  # closed over, not globals

    def program(idx, go, arguments):
        local.idx = idx
        go.wait()
        try:
            fn(**arguments)
        except BaseException as e:
            errors.append(e)

    def spawn(**arguments):
        idx, go = builder.grid_idx, threading_.Event()
        thread = threading_.Thread(target=program, args=(idx, go, arguments))
        threads.append((go, thread))
        thread.start()
        if idx == tuple(d - 1 for d in builder.grid_dim):
            for go, _ in reversed(threads):
                go.set()
            for _, thread in threads:
                thread.join()
            if errors:
                raise errors[0]

    # With the kernel's globals and signature, so the interpreter patches and binds as it would.
    self.fn = types.FunctionType(spawn.__code__, fn.__globals__, closure=spawn.__closure__)
    self.fn.__signature__ = inspect.signature(fn)
    try:
        return _call(self, *args, **kwargs)
    finally:
        self.fn = fn

interpreter.GridExecutor.__call__ = _concurrent_call
# A waiting program lets the others run: volatile loads and atomics (what a wait spins on) sleep a little.
_masked_load, _atomic = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_atomic_rmw
def _yielding_load(self, *args):
    if args[-1]:
        time.sleep(0.001)
    return _masked_load(self, *args)
def _yielding_atomic(self, *args):
    time.sleep(0.001)
    return _atomic(self, *args)
interpreter.InterpreterBuilder.create_masked_load = _yielding_load
interpreter.InterpreterBuilder.create_atomic_rmw = _yielding_atomic

results = []
for numel, dtype, block, k_ratio, with_residual in [(20_011, torch.float32, 512, 0.01, True),
                                                     (600_001, torch.float32, 8192, 0.01, True),
                                                     (20_011, torch.float32, None, 0.01, False)]:
    source, residual = bucket(numel, dtype, with_residual)
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8 if block else source.dtype, block)
    twin_residual = residual.clone() if with_residual else None
    got, _ = run(triton_kernels, source, residual, plan, layout)
    want, _ = run(reference, source, twin_residual, plan, layout)
    results.append({"payload": torch.equal(got.payload, want.payload),
                    "residual": (not with_residual) or torch.equal(residual, twin_residual), "sent": want.sent()})
print(json.dumps(results))
"""


TUNINGS = {
    "defaults": None,
    # Several tiles per quantising program (the last unit of a bucket partly past its end),
    # larger top-k tiles, the other way to scan each, and fewer of a rank's entries loaded at once.
    "wide": {"compress": {"tile": 0, "unit": 4, "elements_per_thread": 8, "row_scan": False},
             "topk": {"tile": 2048, "unit": 2, "elements_per_thread": 16, "row_scan": True},
             "sum": {"chunk": 64, "warps": 2}},
}


def run_child(script: str, tuning: dict | None) -> list[dict]:
    if tuning is None:
        from kernels import triton_kernels
        tuning = {"compress": _fields(triton_kernels.COMPRESS_TUNING), "topk": _fields(triton_kernels.TOPK_TUNING),
                  "sum": _fields(triton_kernels.SUM_TUNING)}
    return run_interpreted(script, json.dumps(tuning))


def _fields(tuning) -> dict:
    return {name: getattr(tuning, name) for name in tuning.__slots__}


@pytest.mark.parametrize("tuning", TUNINGS)
def test_interpreted_kernels_match_the_twins_bit_for_bit(tuning):
    for row in run_child(IN_ORDER, TUNINGS[tuning]):
        assert row.pop("sent") > 0
        assert all(row.values()), row


@pytest.mark.parametrize("tuning", TUNINGS)
def test_interpreted_kernels_wait_for_what_they_read(tuning):
    for row in run_child(CONCURRENT, TUNINGS[tuning]):
        assert row.pop("sent") > 0
        assert all(row.values()), row
