"""DDP comm hooks on 4 gloo ranks in 2 fake NVLink islands: results and bytes on the wire."""

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from core.plan import cross_island_groups
from kernels.selection import CAPACITY_SLACK_PERCENT
from tests.engine_support import run_ranks
from workers.comm.groups import build_island_groups
from workers.comm.hooks import RAMP_START_RATIO, make_hook, ramped_k_ratio
from workers.comm.stats import CommStats

ISLANDS = [[0, 1], [2, 3]]
SIZES = (1000, 37, 4099)  # odd sizes: the hierarchical hook pads to the island size


class Params(torch.nn.Module):
    """Gradient of each parameter = the input given for it, so tests choose the gradients exactly."""

    def __init__(self, sizes: tuple[int, ...] = SIZES):
        super().__init__()
        self.p = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in sizes)

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.p, xs))


def gradients(rank: int, integer: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    if integer:  # sums of small integers, divided by 4: exact in fp32 whatever the order
        return [torch.randint(-1000, 1000, (n,), generator=g).float() for n in SIZES]
    return [torch.randn(n, generator=g) for n in SIZES]


def reduce_with(hook_name: str, rank: int, world: int, integer: bool, steps: int = 1, topk_ramp_steps: int = 0,
                warmup_steps: int = 0):
    """The averaged gradients after `steps` steps, and the bytes handed to collectives in each step."""
    islands = build_island_groups(ISLANDS, cross_island_groups(ISLANDS)) if hook_name == "hierarchical" else None
    stats = CommStats()
    model = DistributedDataParallel(Params(), bucket_cap_mb=0.004)  # ~1000 floats: several buckets
    hook, state = make_hook(hook_name, stats=stats, world_size=world, islands=islands, warmup_steps=warmup_steps,
                            powersgd_rank=2, topk_ratio=0.1, topk_ramp_steps=topk_ramp_steps)
    model.register_comm_hook(state, hook)
    step_bytes = []
    for _ in range(steps):
        model.zero_grad()
        model(gradients(rank, integer)).backward()
        step_bytes.append(stats.take())
    return [p.grad.clone() for p in model.module.p], step_bytes


FEEDBACK_SIZE = 2048
"""One parameter, one bucket of two 1024-element scale blocks, for the error-feedback test."""


def feedback_gradient(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient, where it is large): 10 % of the entries ±127 (a scale of exactly 1, codes ±127, so
    what is sent is exact) at places that differ by rank, the rest small multiples of 2**-8."""
    g = torch.Generator().manual_seed(7 + rank)
    large = torch.zeros(FEEDBACK_SIZE, dtype=torch.bool)
    large[torch.randperm(FEEDBACK_SIZE, generator=g)[:FEEDBACK_SIZE // 10]] = True
    small = torch.randint(-4, 5, (FEEDBACK_SIZE,), generator=g) / 256
    signs = torch.randint(0, 2, (FEEDBACK_SIZE,), generator=g) * 2 - 1
    return torch.where(large, 127.0 * signs, small), large


def carried_residuals(rank: int, world: int, steps: int = 3) -> dict:
    """The top-k hook's residual after each step (the same gradient every step), and the averaged
    gradient of the last."""
    stats = CommStats()
    model = DistributedDataParallel(Params((FEEDBACK_SIZE,)))
    hook, state = make_hook("topk", stats=stats, world_size=world, islands=None, warmup_steps=0, powersgd_rank=2,
                            topk_ratio=0.1)
    model.register_comm_hook(state, hook)
    residuals = []
    for _ in range(steps):
        model.zero_grad()
        model([feedback_gradient(rank)[0]]).backward()
        (residual,) = state.residuals.values()
        residuals.append(residual.tolist())
    return {"residuals": residuals, "averaged": model.module.p[0].grad.tolist()}


def hook_ranks(rank: int, world: int) -> dict:
    plain, plain_bytes = reduce_with("allreduce", rank, world, integer=True)
    hier, hier_bytes = reduce_with("hierarchical", rank, world, integer=True)
    bf16, bf16_bytes = reduce_with("bf16", rank, world, integer=False)
    reference, _ = reduce_with("allreduce", rank, world, integer=False)
    topk, topk_bytes = reduce_with("topk", rank, world, integer=False)
    _, ramp_bytes = reduce_with("topk", rank, world, integer=False, steps=5, topk_ramp_steps=3)
    _, warm_bytes = reduce_with("topk", rank, world, integer=False, steps=3, warmup_steps=1)
    expected = [sum(gradients(r, True)[i] for r in range(world)) / world for i in range(len(SIZES))]
    return {
        "hier_equals_plain": all(torch.equal(a, b) for a, b in zip(hier, plain)),
        "plain_equals_expected": all(torch.equal(a, b) for a, b in zip(plain, expected)),
        "bf16_max_rel_err": max(float(((a - b).abs() / b.abs().clamp_min(1e-3)).median()) for a, b in zip(bf16, reference)),
        "bytes": {"allreduce": plain_bytes[0], "hierarchical": hier_bytes[0], "bf16": bf16_bytes[0],
                  "topk": topk_bytes[0]},
        "topk_ramp_bytes": ramp_bytes,
        "topk_warmup_bytes": warm_bytes,
        "topk_nonzero_share": sum(int((g != 0).sum()) for g in topk) / sum(SIZES),
        "feedback": carried_residuals(rank, world),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, hook_ranks)


def test_hierarchical_allreduce_equals_plain_allreduce_exactly(results):
    assert results["plain_equals_expected"]
    assert results["hier_equals_plain"]


def test_bytes_each_hook_hands_to_collectives(results):
    fp32 = sum(SIZES) * 4
    assert results["bytes"]["allreduce"] == fp32
    assert results["bytes"]["bf16"] == fp32 // 2
    # reduce-scatter input (padded) plus the shard twice (cross-island all-reduce, all-gather)
    assert fp32 <= results["bytes"]["hierarchical"] <= 2 * fp32 + 64


def test_bf16_hook_is_close(results):
    assert results["bf16_max_rel_err"] < 1e-2


def test_topk_ramp_sends_a_falling_share_then_topk_ratio(results):
    # 25% of entries on the first compressed step, then 25% * (0.1 / 0.25) ** (t / 3): 18.4%,
    # 13.6%, then topk_ratio's 10% from the third step on.
    # (DDP regroups its buckets after the first step, so only steps 3 and 4 compare exactly.)
    # A slot (the share plus 10 % slack) costs its int8 code and an Elias-Fano place: L + 1 bits,
    # L = floor(log2(1 / slot share)), and 2**-L bits an element for the unary high parts. The
    # buckets here are small, so headers, scales and alignment pull the ratio below the formula's.
    ramp = results["topk_ramp_bytes"]
    assert ramp[0] > ramp[1] > ramp[2] > ramp[3] == ramp[4]

    def bits_per_element(share: float) -> float:
        slots = share * (1 + CAPACITY_SLACK_PERCENT / 100)
        low_bits = math.floor(math.log2(1 / slots))
        return slots * (8 + low_bits + 1) + 2.0 ** -low_bits

    assert ramp[0] / ramp[3] == pytest.approx(bits_per_element(0.25) / bits_per_element(0.1), rel=0.12)


def test_topk_warmup_is_whole_steps_though_ddp_regroups_its_buckets(results):
    # One dense step, then every bucket compressed, including buckets whose index first appears
    # when DDP regroups its buckets after the first step.
    warm = results["topk_warmup_bytes"]
    assert warm[0] == results["bytes"]["allreduce"] == sum(SIZES) * 4
    assert warm[1] == warm[2] < 0.1 * warm[0]


def test_ramped_share_falls_exponentially_to_topk_ratio():
    assert ramped_k_ratio(0.01, 0, 100) == RAMP_START_RATIO
    assert ramped_k_ratio(0.01, 50, 100) == pytest.approx((0.25 * 0.01) ** 0.5)
    assert ramped_k_ratio(0.01, 100, 100) == ramped_k_ratio(0.01, 7, 0) == 0.01
    assert ramped_k_ratio(0.3, 0, 100) == 0.3  # already above where the ramp starts


def test_topk_sends_a_fraction_and_reduces_to_sparse_gradients(results):
    # 10% of entries (11% of slots): an int8 code and an Elias-Fano place (4 bits and 1/8 of a bit
    # an element) a slot is 4.5% of fp32, plus headers and scales (3-byte entries would be 8.25%)
    assert results["bytes"]["topk"] < 0.055 * sum(SIZES) * 4
    assert 0.1 <= results["topk_nonzero_share"] <= 4 * 0.1 + 0.01  # union of 4 ranks' selections


def test_topk_carries_what_it_did_not_send_into_the_next_step(results):
    """Error feedback: each step sends the 10 % large entries of gradient + residual and keeps the rest
    in the residual, so after step t it holds t times the small entries, exactly (the large ones are
    sent exactly: codes ±127 at a scale of 1). A residual zeroed or lost between steps holds them
    once; one never cleared of what was sent holds the large entries too."""
    gradient, large = feedback_gradient(0)
    for step, residual in enumerate(results["feedback"]["residuals"], start=1):
        assert torch.equal(torch.tensor(residual), torch.where(large, 0.0, step * gradient)), step
    # What the 4 ranks sent, averaged: their large entries, each rank's at its own places.
    sent = sum(torch.where(large, gradient, 0.0) for gradient, large in map(feedback_gradient, range(4))) / 4
    assert torch.equal(torch.tensor(results["feedback"]["averaged"]), sent)


def test_an_unknown_topk_wire_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown topk wire 'auto' \(\[parallel\] topk_wire\); choose one of "
                                         "elias_fano, offsets"):
        make_hook("topk", stats=CommStats(), world_size=2, islands=None, warmup_steps=0, powersgd_rank=2,
                  topk_ratio=0.1, topk_wire="auto")
