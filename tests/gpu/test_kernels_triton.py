"""The Triton kernels on a GPU against the torch twins, bit for bit, and the API's promises there.

Run on a CUDA machine from the repository root:
    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_kernels_triton.py -p no:cacheprovider
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: it comes with CUDA builds of torch, so no CUDA here")

from kernels import (  # noqa: E402
    NonFiniteGradientError,
    compress,
    decompress_accumulate,
    decompress_sum,
    reference,
    topk_by_magnitude,
    triton_kernels,
)
from kernels.compression import _backend  # noqa: E402
from kernels.payload import PayloadLayout, allocate  # noqa: E402
from kernels.selection import CAPACITY_SLACK_PERCENT, SelectionPlan  # noqa: E402

pytestmark = pytest.mark.gpu


def gradient(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Layers of different scale, as in a DDP bucket, made on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scales = torch.logspace(-4, 0, 7, device="cuda")[torch.randint(0, 7, (-(-n // 4096),), device="cuda", generator=gen)]
    return (torch.randn(n, device="cuda", generator=gen) * scales.repeat_interleave(4096)[:n]).to(dtype)


def run(backend, source, residual, plan, layout):
    out, workspace = allocate(layout, plan, source.device)
    backend.select(source, residual, plan, out, workspace)
    return out, workspace


@pytest.mark.parametrize("numel,dtype,block,k_ratio", [
    (1_000, torch.float32, 128, 0.05),            # smaller than one block, sampled whole
    (50_001, torch.float32, 4096, 0.01),          # odd size: unaligned tail, scalar loads
    (3_000_000, torch.bfloat16, 1024, 0.01),      # sampled threshold, bf16 bucket
    (3_000_000, torch.float16, 8192, 0.2),
    (2_000_000, torch.float32, 2048, 0.05),
    ((1 << 24) + 3, torch.float32, 4096, 0.001),  # capped sample
])
def test_compress_matches_the_twin_bit_for_bit(numel, dtype, block, k_ratio):
    source = gradient(numel, seed=numel, dtype=dtype)
    residual = torch.randn(numel, device="cuda") * 1e-3
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8, block)
    twin_residual = residual.clone()
    got, got_workspace = run(triton_kernels, source, residual, plan, layout)
    want, want_workspace = run(reference, source, twin_residual, plan, layout)
    for got_counts, want_counts in zip(reference.histograms(got_workspace), reference.histograms(want_workspace)):
        assert torch.equal(got_counts, want_counts)
    assert torch.equal(got.payload, want.payload)  # header, entries in index order, scales, segment starts
    assert torch.equal(residual, twin_residual)
    assert abs(got.counts()[0] - plan.k) <= plan.k * CAPACITY_SLACK_PERCENT / 100


def test_decompress_matches_the_twin_bit_for_bit():
    numel = 5_000_000
    c = compress(gradient(numel, seed=1), torch.zeros(numel, device="cuda"), 0.01)
    start = torch.randn(numel, device="cuda")
    got, want = start.clone(), start.clone()
    triton_kernels.decompress_accumulate(got, c)
    reference.decompress_accumulate(want, c)
    assert torch.equal(got, want)


@pytest.mark.parametrize("numel,block,k_ratio,ranks", [
    (5_000_000, 1024, 0.01, 8),   # scaled by 1/8 before adding
    (1_000_003, 128, 0.2, 3),     # divided at the end; thousands of entries per segment and rank
    (50_001, 4096, 0.001, 2),
    (3_000_017, 1024, 0.01, 11),  # more ranks than the pipeline holds at once
])
def test_decompress_sum_matches_the_twin_bit_for_bit(numel, block, k_ratio, ranks):
    rows = [compress(gradient(numel, seed=r), torch.zeros(numel, device="cuda"), k_ratio, block) for r in range(ranks)]
    payloads = torch.stack([c.payload for c in rows])
    got = torch.full((numel,), float("nan"), device="cuda")
    want = got.clone()
    triton_kernels.decompress_sum(got, payloads, rows[0].layout, float(ranks))
    reference.decompress_sum(want, payloads, rows[0].layout, float(ranks))
    assert torch.equal(got, want)


def test_selection_is_the_same_every_time():
    # The selection kernel's phases wait on counters other programs advance; a missing wait or
    # fence would show as payloads that differ from run to run.
    numel = 30_000_001
    source = gradient(numel, seed=9)
    start = torch.randn(numel, device="cuda") * 1e-3
    first = None
    for _ in range(10):
        residual = start.clone()
        c = compress(source, residual, 0.01, check_finite=False)
        if first is None:
            first, first_residual = c.payload.clone(), residual.clone()
        assert torch.equal(c.payload, first) and torch.equal(residual, first_residual)
    twin_residual, plan = start.clone(), SelectionPlan.for_ratio(numel, 0.01)
    want, _ = run(reference, source, twin_residual, plan, PayloadLayout(numel, plan.capacity, torch.int8, 1024))
    assert torch.equal(first, want.payload) and torch.equal(first_residual, twin_residual)


def test_public_functions_pick_triton_for_cuda_tensors():
    assert _backend(torch.zeros(1, device="cuda")) is triton_kernels
    assert _backend(torch.zeros(1)) is reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_is_exact_on_the_gpu(dtype):
    numel = 4_000_037
    residual = torch.zeros(numel, device="cuda")
    for step in range(3):
        g = gradient(numel, seed=100 + step, dtype=dtype)
        before = residual.clone()
        c = compress(g, residual, 0.01)
        dense = torch.zeros(numel, device="cuda")
        decompress_accumulate(dense, c)
        assert torch.equal(residual + dense, g.float() + before)
        index = c.element_indices()
        assert len(index) == c.sent() and index.unique().numel() == index.numel()


def test_topk_matches_the_twin_and_keeps_exactly_the_largest():
    x = torch.randn(20_000_000, device="cuda")
    k = 200_000
    index, values = topk_by_magnitude(x, k)
    twin_index, twin_values = reference_topk(x, k)
    assert torch.equal(index, twin_index) and torch.equal(values, twin_values)
    assert torch.equal(values, x[index.long()])
    assert abs(len(index) - k) <= k * CAPACITY_SLACK_PERCENT / 100
    exact = torch.topk(x.abs(), len(index)).indices
    assert torch.equal(index.long().sort().values, exact.sort().values)


def reference_topk(x, k):
    plan = SelectionPlan.for_k(x.numel(), k)
    out, _ = run(reference, x, None, plan, PayloadLayout(x.numel(), plan.capacity, x.dtype, None))
    return out.indices[:out.sent()], out.values[:out.sent()]


def test_nan_raises_now_or_from_the_payload():
    g, residual = gradient(1_000_000, seed=5), torch.zeros(1_000_000, device="cuda")
    g[123_456] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="1 of 1000000"):
        compress(g, residual.clone(), 0.01)
    deferred = compress(g, residual, 0.01, check_finite=False)
    with pytest.raises(NonFiniteGradientError):
        deferred.with_payload(deferred.payload.clone()).raise_if_nonfinite()


@pytest.mark.parametrize("bad_count", [5, 1_000_000])
def test_topk_counts_every_nan_and_inf_even_past_capacity(bad_count):
    # Top-k selects NaN and inf and counts them as it places entries; a million of them is far
    # more than the 1 % it has room for, and each must still be counted.
    x = torch.randn(2_000_000, device="cuda")
    where = torch.randperm(2_000_000, device="cuda")[:bad_count]
    x[where] = float("nan")
    x[where[:2]] = float("inf")
    with pytest.raises(NonFiniteGradientError, match=f"{bad_count} of 2000000"):
        topk_by_magnitude(x, 20_000)


def test_all_zero_and_empty_buckets_send_nothing():
    residual = torch.zeros(3_000_000, device="cuda")
    c = compress(torch.zeros(3_000_000, device="cuda"), residual, 0.01)
    assert c.counts() == (0, 0) and not c.payload.any() and not residual.any()
    empty = compress(torch.zeros(0, device="cuda"), torch.zeros(0, device="cuda"), 0.01)
    assert empty.counts() == (0, 0)


def test_topk_of_a_nearly_empty_bucket_keeps_its_nonzeros_even_subnormal():
    # Fewer non-zeros than k: the threshold is 0 and every non-zero is kept, a subnormal one too
    # (the kernel compares against the smallest subnormal; flushed to zero, it would keep zeros).
    x = torch.zeros(1_000_000, device="cuda")
    x[10], x[20], x[999_999] = 1e-40, -3.0, 2.0
    index, values = topk_by_magnitude(x, 100)
    assert index.tolist() == [10, 20, 999_999] and values.tolist() == x[[10, 20, 999_999]].tolist()


def test_ties_overflow_capacity_and_the_excess_stays_in_the_residual():
    numel = 2_000_000
    g = torch.ones(numel, device="cuda")
    g[::3] = -1.0
    residual = torch.zeros(numel, device="cuda")
    twin_residual = residual.clone()
    c = compress(g, residual, 0.01)
    twin = compress(g.cpu(), twin_residual.cpu(), 0.01)
    assert c.counts()[0] == numel and c.sent() == c.capacity
    assert torch.equal(c.payload.cpu(), twin.payload)  # the lowest indices fill the capacity
    dense = torch.zeros(numel, device="cuda")
    decompress_accumulate(dense, c)
    assert torch.equal(residual + dense, g)


@pytest.mark.parametrize("numel,values,block,k_ratio", [
    (3_000_001, "signs", 1024, 0.01),     # every magnitude ties at the threshold: all chosen, capacity overflows
    (3_000_001, "signs", None, 0.01),
    (2_000_003, "quarters", 512, 0.42),   # multiples of 0.25: the 0.75s tie at it, the 1s above; within capacity
    (2_000_003, "quarters", None, 0.3),   # ... and past it
])
def test_ties_at_the_threshold_match_the_twin_with_a_zero_residual(numel, values, block, k_ratio):
    """A first step (nothing carried in the residual) on values that repeat: the threshold lands on a
    value many elements share, and `>=` keeps every one of them (the interpreter tests run the same
    cases, tests/unit/test_kernels_triton_interpreter.py)."""
    gen = torch.Generator(device="cuda").manual_seed(numel)
    source = (torch.randn(numel, device="cuda", generator=gen).sign() if values == "signs"
              else torch.randint(-4, 5, (numel,), device="cuda", generator=gen) * 0.25)
    residual = torch.zeros(numel, device="cuda") if block else None
    plan = SelectionPlan.for_ratio(numel, k_ratio)
    layout = PayloadLayout(numel, plan.capacity, torch.int8 if block else source.dtype, block)
    twin_residual = None if residual is None else residual.clone()
    got, _ = run(triton_kernels, source, residual, plan, layout)
    want, _ = run(reference, source, twin_residual, plan, layout)
    assert want.threshold == (1.0 if values == "signs" else 0.75)
    assert int(want.header[0]) == int((source.abs() >= want.threshold).sum())  # every tie kept
    assert torch.equal(got.payload, want.payload)
    assert residual is None or torch.equal(residual, twin_residual)


@pytest.mark.parametrize("numel,k_ratio", [(3_000_000, 0.25), (50_001, 0.5), (1 << 20, 0.06), (6_000_000, 0.01)])
def test_the_wire_round_trips_triton_payloads(numel, k_ratio):
    """kernels.wire on the device: its Triton kernels write the twins' bytes both ways, the payloads
    come back byte for byte from one batched decode, and the decoded rows average exactly as the
    payloads themselves do."""
    from kernels.wire import decode_wires, encode_wire

    mine = [compress(gradient(numel, seed=11 + r), torch.zeros(numel, device="cuda"), k_ratio) for r in range(3)]
    wires = torch.stack([encode_wire(m) for m in mine])
    twins = torch.stack([encode_wire(m.with_payload(m.payload.cpu())) for m in mine])  # on CPU: the torch twins
    assert torch.equal(wires.cpu(), twins)
    decoded = decode_wires(wires, mine[0].layout)
    assert torch.equal(decoded.cpu(), decode_wires(twins, mine[0].layout))
    direct, via_wire = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
    payloads = torch.stack([m.payload for m in mine])
    assert torch.equal(decoded, payloads)
    decompress_sum(direct, payloads, mine[0], 3)
    decompress_sum(via_wire, decoded, mine[0], 3)
    assert torch.equal(direct, via_wire)


def test_a_new_k_reuses_the_compiled_decompress_sum():
    """A sparsity ramp changes k every step. decompress_sum once took the payload's array offsets
    as compile-time constants and compiled anew for every k: 250-360 ms a step on an H200."""
    kernel_caches = getattr(triton_kernels._decompress_sum_kernel, "device_caches", None)
    if kernel_caches is None:
        pytest.skip("this triton keeps no device_caches to count compiled kernels in")
    compiled = lambda: sum(len(entry[0]) for entry in kernel_caches.values())  # noqa: E731
    numel = 1_000_000
    out = torch.empty(numel, device="cuda")

    def sum_at(k_ratio: float) -> None:
        rows = [compress(gradient(numel, seed=r), torch.zeros(numel, device="cuda"), k_ratio) for r in range(2)]
        decompress_sum(out, torch.stack([c.payload for c in rows]), rows[0], 2)

    sum_at(0.25)
    before = compiled()
    for step in range(12):
        sum_at(0.25 * (0.01 / 0.25) ** (step / 11))
    # Triton specialises integer arguments on divisibility by 16: at most a few variants, not one per k.
    assert compiled() - before <= 3
