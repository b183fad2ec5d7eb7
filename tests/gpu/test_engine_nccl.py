"""The engine's DDP comm hooks over NCCL on two GPUs: futures chained on CUDA streams, not gloo threads."""

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd_module

from core.config import JobConfig
from planning.hook_costs import CommHookCost
from tests.engine_support import engine_spec, run_ranks
from workers.engine import Engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

HOOKS = {"allreduce": [[0, 1]], "bf16": [[0, 1]], "powersgd": [[0, 1]], "topk": [[0, 1]],
         "hierarchical": [[0], [1]]}
STEPS, WARMUP_STEPS = 12, 2
VARIANTS = {  # name: (hook, [parallel] and [train] settings beyond the hook)
    # 25 % of the entries falling to 5 % over 12 steps: the dense steps send more, Elias-Fano coded all the same.
    "topk ramp": ("topk", {"topk_ramp_steps": 12}, {}),
    "bf16 weights": ("allreduce", {}, {"precision": "bf16", "bf16_weights": True}),
}


class CountingAllReduce:
    """torch.distributed as torch's PowerSGD hook sees it, with the bytes of every all_reduce summed."""

    def __init__(self, inner):
        self.inner, self.bytes = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.bytes += tensor.numel() * tensor.element_size()
        return self.inner.all_reduce(tensor, *args, **kwargs)


def config_for(hook: str, parallel: dict | None = None, train: dict | None = None) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "seq_len": 64},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 0,
                  **(train or {})},
        "parallel": {"comm_hook": hook, "comm_warmup_steps": WARMUP_STEPS, "topk_ratio": 0.05, "bucket_mb": 1.0,
                     **(parallel or {})},
        "cluster": {"num_workers": 2, "use_gpu": True}})


def train_steps(engine: Engine, rank: int, device: torch.device) -> list[float]:
    """STEPS steps cycling three batches; the mean loss over both ranks after each."""
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step % 3)
        data = torch.randint(0, 257, (16, 65), generator=g)[rank * 8:(rank + 1) * 8].to(device)
        loss, _ = engine([data], lr=3e-3)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / 2)
    return losses


def nccl_runs(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    results = {}
    cases = {hook: (hook, {}, {}) for hook in HOOKS} | VARIANTS
    for name, (hook, parallel, train) in cases.items():
        islands = HOOKS[hook]
        config = config_for(hook, parallel, train)
        engine = Engine(engine_spec(config, 2, 8, 1, islands=islands), rank, device)
        counting = CountingAllReduce(powersgd_module.dist)
        powersgd_module.dist = counting  # what torch's PowerSGD hook hands to all_reduce, counted apart from CommStats
        try:
            losses = train_steps(engine, rank, device)
        finally:
            powersgd_module.dist = counting.inner
        metrics = engine.window_metrics()
        results[name] = {"losses": losses, "comm_bytes": metrics["comm_bytes"], "powersgd_all_reduced": counting.bytes,
                         "exposed_comm_s": metrics.get("exposed_comm_s"), "overlap_ratio": metrics.get("overlap_ratio")}
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, nccl_runs, backend="nccl")


def test_every_hook_trains_over_nccl(runs):
    for hook, result in runs.items():
        # The compressing hooks learn this memorisation task more slowly: on the H200 pair, 12 steps
        # took PowerSGD (rank 4) from 5.57 to 5.32 and top-k (5%) to 5.18; the others drop by > 0.5.
        compressing = hook in ("powersgd", "topk", "topk ramp")
        assert result["losses"][-1] < result["losses"][0] - (0.15 if compressing else 0.5), hook
        assert result["comm_bytes"] > 0, hook
        assert result["exposed_comm_s"] is not None and result["exposed_comm_s"] >= 0, hook


def test_hierarchical_tracks_flat_allreduce(runs):
    for ours, theirs in zip(runs["hierarchical"]["losses"], runs["allreduce"]["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-3)


def test_compressed_hooks_send_fewer_bytes(runs):
    plain = runs["allreduce"]["comm_bytes"]
    assert runs["bf16"]["comm_bytes"] == plain // 2
    assert runs["topk"]["comm_bytes"] < 0.3 * plain
    assert runs["powersgd"]["comm_bytes"] < plain


def test_a_ramp_sends_more_while_it_ramps_and_bf16_weights_reduce_half_the_bytes(runs):
    """The ramp's dense steps cost more than steady top-k but far less than all-reduce; bf16 weights
    all-reduce bf16 gradients and train as fp32 weights under autocast do."""
    plain = runs["allreduce"]["comm_bytes"]
    assert runs["topk"]["comm_bytes"] < runs["topk ramp"]["comm_bytes"] < 0.5 * plain
    assert runs["bf16 weights"]["comm_bytes"] == plain // 2
    for ours, theirs in zip(runs["bf16 weights"]["losses"], runs["allreduce"]["losses"]):
        assert ours == pytest.approx(theirs, rel=0.02)


def test_the_planner_costs_the_bytes_powersgd_sent(runs):
    """PowerSGD hangs over gloo, so here is where the planner's wire bytes meet what torch's hook
    all-reduces once it compresses (its warm-up steps all-reduce through the process group directly)."""
    plain_step = runs["allreduce"]["comm_bytes"] // STEPS
    wire = CommHookCost.for_job(config_for("powersgd")).wire_bytes
    assert runs["powersgd"]["powersgd_all_reduced"] == (STEPS - WARMUP_STEPS) * wire
    assert runs["powersgd"]["comm_bytes"] == WARMUP_STEPS * plain_step + (STEPS - WARMUP_STEPS) * wire


OVERLAP_CASES = {  # name: ([parallel], compile); every case without clipping, which the overlap needs.
    # Eager with 0.25 MB buckets (7 of them); compiled with 1 MB, the least Dynamo's DDPOptimizer takes.
    "plain": ({"bucket_mb": 0.25}, False),
    "overlap": ({"bucket_mb": 0.25, "overlap": "next_forward", "overlap_backward_share": 0.3}, False),
    "plain compiled": ({"bucket_mb": 1.0}, True),
    "overlap compiled": ({"bucket_mb": 1.0, "overlap": "next_forward", "overlap_backward_share": 0.3}, True),
}


def overlap_runs(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    results = {}
    for name, (parallel, compiled) in OVERLAP_CASES.items():
        config = config_for("allreduce", parallel, {"grad_clip": 0.0})
        config.compile.enable = compiled
        engine = Engine(engine_spec(config, 2, 8, 1), rank, device)
        losses = []
        for step in range(STEPS):  # no collective between steps: the reduction runs into the next forward
            g = torch.Generator().manual_seed(step % 3)
            data = torch.randint(0, 257, (16, 65), generator=g)[rank * 8:(rank + 1) * 8].to(device)
            losses.append(engine([data], lr=3e-3)[0].detach())
        engine.settle()
        total = torch.stack(losses)
        torch.distributed.all_reduce(total)
        weights = torch.cat([p.detach().flatten() for p in engine.model.parameters()])
        results[name] = {"losses": (total / 2).tolist(), "weights_sum": float(weights.double().sum()),
                         "weights_head": weights[:256].tolist(), "metrics": engine.window_metrics().get("exposed_comm_s")}
    return results


@pytest.fixture(scope="module")
def overlapped():
    return run_ranks(2, overlap_runs, backend="nccl")


def test_the_next_forward_overlap_trains_as_plain_ddp_over_nccl(overlapped):
    """Eager, the same kernels on the same gradients: the same weights bit for bit. Compiled block by
    block against DDP compiled whole, other fusions: the same losses to rounding."""
    assert overlapped["overlap"]["losses"] == overlapped["plain"]["losses"]
    assert overlapped["overlap"]["weights_head"] == overlapped["plain"]["weights_head"]
    assert overlapped["overlap"]["weights_sum"] == overlapped["plain"]["weights_sum"]
    for ours, theirs in zip(overlapped["overlap compiled"]["losses"], overlapped["plain compiled"]["losses"]):
        assert ours == pytest.approx(theirs, rel=0.01)
    assert overlapped["overlap compiled"]["losses"][-1] < overlapped["overlap compiled"]["losses"][0] - 0.5
    assert overlapped["overlap"]["metrics"] is not None and overlapped["overlap"]["metrics"] >= 0
