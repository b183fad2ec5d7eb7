"""The Triton kernels, run by Triton's CPU interpreter, against the torch twins.

Catches logic errors in the kernels on a machine without a GPU, wherever triton is installed
(`make test` installs it without a GPU; elsewhere this skips, which CI=true turns into a failure).
The cases include magnitudes that tie at the threshold with nothing carried in the residual (a
first step on values that repeat), where `>` instead of `>=` sends nothing. The interpreter runs
programs one after another, in id order, so every wait of the selection kernel's phases is over when it starts and
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

# (source, residual): values "fp32" or "bf16" (random, no two magnitudes alike), or tied ones:
# "signs" (every magnitude 1), "quarters" (multiples of 0.25 up to 1: the threshold lands on a value
# many elements share); residual "random", "zero" (a first step: nothing carried, so ties stay ties)
# or None (top-k).
def bucket(numel, values, residual):
    gen = torch.Generator().manual_seed(numel)
    source = {"fp32": lambda: torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen),
              "bf16": lambda: (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)).bfloat16(),
              "signs": lambda: torch.randn(numel, generator=gen).sign(),
              "quarters": lambda: torch.randint(-4, 5, (numel,), generator=gen) * 0.25}[values]()
    carried = {"random": lambda: torch.randn(numel, generator=gen) * 0.1, "zero": lambda: torch.zeros(numel),
               None: lambda: None}[residual]()
    return source, carried
"""

IN_ORDER = PRELUDE + r"""
results = []
# decompress_sum of 3 ranks divides at the end, of 4 scales first; 10 ranks fill its pipeline.
for numel, values, block, k_ratio, carried, sums in [(20_011, "fp32", 512, 0.01, "random", (3, 4, 10)),
                                                     (12_000, "bf16", 128, 0.2, "random", ()),
                                                     (30_000, "fp32", None, 0.01, None, ()),
                                                     # every magnitude ties: all chosen, capacity overflows
                                                     (20_000, "signs", 1024, 0.01, "zero", ()),
                                                     (20_011, "signs", None, 0.01, None, ()),
                                                     # ties at a threshold inside the values: 0.75 and 1 kept,
                                                     # within capacity (compress) and past it (top-k)
                                                     (20_011, "quarters", 512, 0.42, "zero", (2,)),
                                                     (20_011, "quarters", None, 0.3, None, ()),
                                                     # sampled in runs; three and two groups of 2**18
                                                     (600_001, "fp32", 8192, 0.001, "random", (2,)),
                                                     (300_001, "fp32", None, 0.05, None, ())]:
    source, residual = bucket(numel, values, carried)
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8 if block else source.dtype, block)
    twin_residual = None if residual is None else residual.clone()
    magnitude = (source.float() if residual is None else source.float() + residual).abs()
    got, got_hist = run(triton_kernels, source, residual, plan, layout)
    want, want_hist = run(reference, source, twin_residual, plan, layout)
    row = {"case": f"{numel} {values} block {block} k {k_ratio} residual {carried}",
           "payload": torch.equal(got.payload, want.payload),
           "histograms": all(map(torch.equal, reference.histograms(got_hist), reference.histograms(want_hist))),
           "residual": residual is None or torch.equal(residual, twin_residual),
           "sent": want.sent()}
    # Every element at or above the threshold is selected, ties included (none lost to `>`).
    row["every_tie_kept"] = int(want.header[0]) == int(((magnitude >= want.threshold) & (magnitude > 0)).sum())
    row["ties_at_threshold"] = int((magnitude == want.threshold).sum())
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
# The tied bucket overflows: placing programs give entries past capacity back to the residual the
# quantising ones wrote.
for numel, values, block, k_ratio, carried in [(20_011, "fp32", 512, 0.01, "random"),
                                               (600_001, "fp32", 8192, 0.01, "random"),
                                               (20_011, "fp32", None, 0.01, None),
                                               (20_011, "signs", 512, 0.01, "zero")]:
    source, residual = bucket(numel, values, carried)
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8 if block else source.dtype, block)
    twin_residual = None if residual is None else residual.clone()
    got, _ = run(triton_kernels, source, residual, plan, layout)
    want, _ = run(reference, source, twin_residual, plan, layout)
    results.append({"case": f"{numel} {values} block {block} k {k_ratio} residual {carried}",
                    "payload": torch.equal(got.payload, want.payload),
                    "residual": residual is None or torch.equal(residual, twin_residual), "sent": want.sent()})
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


def run_child(script: str, tuning: dict | None, **run) -> list[dict]:
    if tuning is None:
        from kernels import triton_kernels
        tuning = {"compress": _fields(triton_kernels.COMPRESS_TUNING), "topk": _fields(triton_kernels.TOPK_TUNING),
                  "sum": _fields(triton_kernels.SUM_TUNING)}
    return run_interpreted(script, json.dumps(tuning), **run)


def _fields(tuning) -> dict:
    return {name: getattr(tuning, name) for name in tuning.__slots__}


TIED = {"20000 signs block 1024 k 0.01 residual zero": (20_000, 220),
        "20011 signs block None k 0.01 residual None": (20_011, 220),
        "20011 quarters block 512 k 0.42 residual zero": (4_471, 8_927),
        "20011 quarters block None k 0.3 residual None": (4_471, 6_604)}
"""Cases whose magnitudes tie at the threshold: (elements exactly at it, entries sent). Every sign
is a magnitude of 1, the threshold; of the quarters, the 4,471 of 0.75 tie at it and the 1s are
above: all 8,927 are selected, which the capacity of k = 42 % holds and that of 30 % does not."""


@pytest.mark.parametrize("tuning", TUNINGS)
def test_interpreted_kernels_match_the_twins_bit_for_bit(tuning):
    rows = run_child(IN_ORDER, TUNINGS[tuning])
    assert len(rows) == 9
    for row in rows:
        case, sent, ties = row.pop("case"), row.pop("sent"), row.pop("ties_at_threshold")
        assert sent > 0 and all(row.values()), (case, row)
        assert (ties, sent) == TIED.get(case, (0, sent)), case


@pytest.mark.parametrize("tuning", TUNINGS)
def test_interpreted_kernels_wait_for_what_they_read(tuning):
    # Once in many runs (seen once, on a 2-core machine, 'wide'), two program threads were left spinning
    # after every other had ended, for the child's whole 600 s; the same case takes ~20 s otherwise. Until
    # that is explained (the kernel's waits, or the thread emulation of the grid), a child past 180 s is
    # run again once: a deadlock that repeats still fails, and wrong payloads fail as before.
    rows = run_child(CONCURRENT, TUNINGS[tuning], timeout_s=180, attempts=2)
    assert len(rows) == 4
    for row in rows:
        case = row.pop("case")
        assert row.pop("sent") > 0 and all(row.values()), (case, row)
