"""Properties of the compression API on CPU, where it runs the torch twins (kernels/reference.py).

The GPU tests (tests/gpu/test_kernels_triton.py) check that the Triton kernels give the same
bits, so what holds here holds there.
"""

import pickle

import pytest
import torch

from kernels import NonFiniteGradientError, compress, decompress_accumulate, decompress_sum, topk_by_magnitude
from kernels.selection import CAPACITY_SLACK_PERCENT


def layered_gradient(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Like a DDP bucket: several parameters whose gradients differ in scale by 10**4."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-4, 0, 7)[torch.randint(0, 7, (-(-n // 4096),), generator=gen)]
    return (torch.randn(n, generator=gen) * scales.repeat_interleave(4096)[:n]).to(dtype)


def dequantised(c) -> torch.Tensor:
    dense = torch.zeros(c.numel)
    decompress_accumulate(dense, c)
    return dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block,k_ratio", [(4096, 0.01), (128, 0.001), (1024, 0.3)])
def test_error_feedback_is_exact_over_steps(dtype, block, k_ratio):
    n = 100_003
    residual = torch.zeros(n)
    for step in range(3):
        g = layered_gradient(n, seed=step, dtype=dtype)
        before = residual.clone()
        c = compress(g, residual, k_ratio, block)
        assert c.sent() > 0
        # Bitwise: what stays behind plus what the receiver adds is exactly what was there.
        assert torch.equal(residual + dequantised(c), g.float() + before)


def test_codes_of_one_are_exact_next_to_half_a_scale():
    """A code of ±1 comes from |acc| times the block's rounded reciprocal; elements a few ulps
    either side of scale / 2, where that product's rounding decides, keep the residual exact and
    send nothing from below scale / 2 (a product of exactly 0.5 rounds to 0)."""
    block = 128
    amax = torch.rand(64, generator=torch.Generator().manual_seed(3)) * 10 + 0.01
    scale = amax / torch.full_like(amax, 127.0)
    below, above = scale / 2, scale / 2
    rows = []
    for _ in range(4):
        below = torch.nextafter(below, torch.zeros_like(below))
        above = torch.nextafter(above, torch.full_like(above, 1e9))
        rows += [below, -below, above, -above]
    g = torch.zeros(64, block)
    g[:, 0] = amax
    g[:, 1:1 + len(rows)] = torch.stack(rows, dim=1)
    g = g.view(-1)
    residual = torch.zeros_like(g)
    c = compress(g, residual, 1.0, block)  # every non-zero element is selected
    assert torch.equal(residual + dequantised(c), g)
    sent = torch.zeros_like(g, dtype=torch.bool)
    sent[c.element_indices()] = True
    assert sent.sum() > 64 and not (sent & (g.abs() * 2 < scale.repeat_interleave(block))).any()


def test_quantisation_error_is_at_most_half_a_scale_per_block():
    n, block = 200_000, 1024
    g = layered_gradient(n, seed=1)
    residual = torch.randn(n) * 1e-3
    acc = g + residual
    c = compress(g, residual, 0.02, block)
    count = c.sent()
    index = c.element_indices()
    codes = c.values[:count].float()
    scale = c.scales[index // block]
    assert codes.abs().max() <= 127 and (codes != 0).all()
    assert ((acc[index] - codes * scale).abs() <= scale * (0.5 + 2**-16)).all()
    # Each block's scale comes from its largest selected magnitude, which therefore codes to ±127.
    blocks = index // block
    for b in blocks.unique()[:50]:
        here = blocks == b
        assert c.scales[b] == acc[index[here]].abs().max() / 127
        assert codes[here].abs().max() == 127


@pytest.mark.parametrize("shape", ["gaussian", "heavy_tailed", "layered"])
@pytest.mark.parametrize("k_ratio", [0.01, 0.002])
def test_count_is_within_tolerance_and_the_largest_are_kept(shape, k_ratio):
    n = 1 << 20
    gen = torch.Generator().manual_seed(7)
    x = {"gaussian": lambda: torch.randn(n, generator=gen),
         "heavy_tailed": lambda: torch.randn(n, generator=gen) / torch.rand(n, generator=gen).clamp_min(1e-3),
         "layered": lambda: layered_gradient(n, seed=7)}[shape]()
    k = round(k_ratio * n)
    index, values = topk_by_magnitude(x, k)
    assert abs(len(index) - k) <= k * CAPACITY_SLACK_PERCENT / 100
    assert torch.equal(values, x[index.long()])
    # Not approximately the largest: exactly the largest len(index) magnitudes.
    exact = torch.topk(x.abs(), len(index)).indices
    assert set(index.tolist()) == set(exact.tolist())


def test_decompress_sum_writes_the_average_of_every_payload():
    n, ranks = 30_011, 3
    payloads, total = [], torch.zeros(n)
    for r in range(ranks):
        c = compress(layered_gradient(n, seed=20 + r), torch.zeros(n), 0.05, 512)
        payloads.append(c.payload)
        decompress_accumulate(total, c)
    out = torch.full((n,), float("nan"))  # every element must be written, not only those sent
    decompress_sum(out, torch.stack(payloads), c, ranks)
    assert torch.equal(out, total / torch.full_like(total, ranks))
    with pytest.raises(ValueError, match="world_size"):
        decompress_sum(out, torch.stack(payloads)[:, :-16], c, ranks)


def test_small_bucket_is_sampled_whole_and_hits_k_closely():
    x = torch.randn(30_000, generator=torch.Generator().manual_seed(3))
    index, _ = topk_by_magnitude(x, 300)
    assert abs(len(index) - 300) <= 3


def test_all_zero_bucket_sends_nothing_and_keeps_a_zero_residual():
    residual = torch.zeros(50_000)
    c = compress(torch.zeros(50_000), residual, 0.01)
    assert c.counts() == (0, 0)
    assert not c.payload.any()
    assert not residual.any()


def test_empty_bucket():
    residual = torch.zeros(0)
    c = compress(torch.zeros(0), residual, 0.01)
    assert c.counts() == (0, 0) and c.capacity == 0 and c.payload.numel() == 16
    decompress_accumulate(torch.zeros(0), c)
    index, values = topk_by_magnitude(torch.zeros(0), 0)
    assert index.numel() == 0 and values.numel() == 0


@pytest.mark.parametrize("where", ["bucket_nan", "bucket_inf", "residual_nan"])
def test_non_finite_input_raises_a_typed_error(where):
    g, residual = torch.randn(10_000), torch.zeros(10_000)
    bad = float("inf") if where == "bucket_inf" else float("nan")
    (residual if where == "residual_nan" else g)[[5, 77]] = bad
    with pytest.raises(NonFiniteGradientError, match=r"2 of 10000 elements .* NaN or infinite.*residual\.zero_\(\)") as err:
        compress(g, residual, 0.01)
    assert isinstance(err.value, ValueError)
    again = pickle.loads(pickle.dumps(err.value))  # Ray ships worker errors pickled
    assert type(again) is NonFiniteGradientError and str(again) == str(err.value)


def test_deferred_non_finite_check_travels_in_the_payload():
    g, residual = torch.randn(10_000), torch.zeros(10_000)
    g[9] = float("nan")
    c = compress(g, residual, 0.01, check_finite=False)
    assert c.counts()[1] == 1
    receiver_view = c.with_payload(c.payload.clone())
    with pytest.raises(NonFiniteGradientError):
        receiver_view.raise_if_nonfinite()


def test_topk_refuses_nan_and_names_no_residual():
    x = torch.randn(1000)
    x[3] = float("nan")
    with pytest.raises(NonFiniteGradientError) as err:
        topk_by_magnitude(x, 10)
    assert "residual" not in str(err.value)


def test_ties_at_the_threshold_are_all_kept_and_the_excess_stays_in_the_residual():
    n = 20_000
    g = torch.ones(n)
    g[::2] = -1.0  # every magnitude equal: all are selected, only capacity fit
    residual = torch.zeros(n)
    c = compress(g, residual, 0.01)
    selected, _ = c.counts()
    assert selected == n and c.sent() == c.capacity
    assert torch.equal(residual + dequantised(c), g)
    assert (residual == 0).sum() == c.capacity


def test_payloads_of_several_ranks_accumulate_into_an_existing_buffer():
    n = 40_000
    payloads, expected = [], torch.full((n,), 0.25)
    for rank in range(3):
        c = compress(layered_gradient(n, seed=10 + rank), torch.zeros(n), 0.05)
        payloads.append(c.payload)
        expected += dequantised(c)
    gathered = torch.stack(payloads)  # what all_gather_into_tensor would give
    total = torch.full((n,), 0.25)
    for row in gathered:
        decompress_accumulate(total, c.with_payload(row))
    assert torch.equal(total, expected)


def test_decompress_reads_only_valid_entries():
    n = 10_000
    c = compress(torch.randn(n), torch.zeros(n), 0.01)
    clean = dequantised(c)
    count = c.sent()
    c.indices[count:] = 0  # garbage past the count must be ignored
    c.values[count:] = 127
    c.indices[0] = n + 5  # and an offset past the bucket (a corrupted payload) skipped, not written
    dense = dequantised(c)
    assert dense[0] == clean[0]
    assert torch.count_nonzero(dense != clean) == 1


@pytest.mark.parametrize("call,message", [
    (lambda: compress(torch.randn(10), torch.zeros(10, dtype=torch.float64), 0.1), "residual must be a contiguous float32"),
    (lambda: compress(torch.randn(10), torch.zeros(11), 0.1), "torch.zeros\\(bucket.numel"),
    (lambda: compress(torch.arange(10), torch.zeros(10), 0.1), "bucket must be a contiguous float32, bfloat16"),
    (lambda: compress(torch.randn(10, 2).t(), torch.zeros(20), 0.1), "not contiguous"),
    (lambda: compress(torch.randn(10), torch.zeros(10), 0.0), "k_ratio must be a fraction"),
    (lambda: compress(torch.randn(10), torch.zeros(10), float("nan")), "k_ratio must be a fraction"),
    (lambda: compress(torch.randn(10), torch.zeros(10), 0.1, block=1000), "block must be a power of two"),
    (lambda: compress(torch.randn(10), torch.zeros(10), 0.1, block=16384), "block must be a power of two"),
    (lambda: topk_by_magnitude(torch.randn(10), 11), "k must be between 1 and"),
])
def test_bad_arguments_say_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_decompress_checks_its_buffer_and_payload():
    c = compress(torch.randn(100), torch.zeros(100), 0.1)
    with pytest.raises(ValueError, match="accumulate into an fp32 buffer"):
        decompress_accumulate(torch.zeros(100, dtype=torch.bfloat16), c)
    with pytest.raises(ValueError, match="same bucket size, k_ratio and block"):
        c.with_payload(torch.zeros(c.payload.numel() + 16, dtype=torch.uint8))
