"""The next-forward overlap (workers/comm/overlap.py) on 2 gloo ranks against plain DDP: the same
weights and losses, buckets applied stage by stage, and the config's refusals."""

import dataclasses

import pytest
import torch

from core.config import JobConfig
from core.errors import ConfigError
from planning.resolve import overlap_backward_share
from tests.engine_support import engine_spec, run_ranks
from workers.engine import Engine
from workers.models.gpt import GPT

STEPS = 6
MICRO = 4
BUCKET_MB = 0.02
"""About 5,000 fp32 gradients a bucket: the tiny model's gradients fill 8 buckets."""


def job(accum: int = 1, **parallel) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"n_layer": 3, "n_head": 2, "n_embd": 32, "seq_len": 32},
        "train": {"steps": STEPS, "global_batch_size": 2 * MICRO * accum, "micro_batch_size": MICRO, "lr": 3e-3,
                  "min_lr": 3e-4, "warmup_steps": 0, "grad_clip": 0.0},
        "parallel": {"bucket_mb": BUCKET_MB, **parallel},
        "cluster": {"num_workers": 2},
    })


def batches(step: int, rank: int, accum: int) -> list[torch.Tensor]:
    data = torch.randint(0, 257, (2 * MICRO * accum, 33), generator=torch.Generator().manual_seed(step))
    return list(data[rank * MICRO * accum:(rank + 1) * MICRO * accum].split(MICRO))


def run(rank: int, world: int, accum: int, lr_of_step, **parallel) -> dict:
    config = job(accum, **parallel)
    engine = Engine(engine_spec(config, world, MICRO, accum), rank, torch.device("cpu"))
    losses, norms = [], []
    for step in range(STEPS):
        loss, norm = engine(batches(step, rank, accum), lr=lr_of_step(step))
        losses.append(loss)
        norms.append(norm)
    engine.settle()
    return {"engine": engine, "losses": [float(x) for x in losses], "norms": [float(x) for x in norms],
            "weights": torch.cat([p.detach().flatten() for p in engine.model.parameters()]),
            "moments": torch.cat([engine.optimizer.state[p]["exp_avg_sq"].flatten()
                                  for p in engine.model.parameters()]),
            "metrics": engine.window_metrics()}


def stage_order(rank: int, world: int) -> dict:
    """After one backward: which buckets wait for which stage, and what one stage's call applies."""
    engine = Engine(engine_spec(job(overlap="next_forward", overlap_backward_share=0.3), world, MICRO, 1), rank,
                    torch.device("cpu"))
    engine(batches(0, rank, 1), lr=1e-3)  # DDP regroups its buckets after the first step
    engine(batches(1, rank, 1), lr=1e-3)
    overlap = engine.overlap
    needs = [r.need for r in overlap.unapplied]
    overlap.before_stage(1)
    stages = engine.model.forward_stages()
    applied_needs = sorted({stages[id(p)] for p in engine.model.parameters() if p.grad is None})
    pending_needs = sorted({stages[id(p)] for p in engine.model.parameters() if p.grad is not None})
    return {"needs": needs, "applied": applied_needs, "pending": pending_needs, "left": len(overlap.unapplied)}


def compare(rank: int, world: int) -> dict:
    lr_of_step = lambda step: 3e-3 * (1 - step / STEPS)  # a different rate every step  # noqa: E731
    results = {}
    for name, accum, parallel in [("plain", 1, {}), ("overlap", 1, {"overlap": "next_forward"}),
                                  ("overlap_held", 1, {"overlap": "next_forward", "overlap_backward_share": 0.2}),
                                  ("plain_accum", 2, {}),
                                  ("overlap_accum", 2, {"overlap": "next_forward", "overlap_backward_share": 0.5}),
                                  ("bf16", 1, {"comm_hook": "bf16"}),
                                  ("overlap_bf16", 1, {"comm_hook": "bf16", "overlap": "next_forward",
                                                       "overlap_backward_share": 0.2})]:
        result = run(rank, world, accum, lr_of_step, **parallel)
        engine = result.pop("engine")
        result["eval"] = engine.evaluate([batches(99, rank, 1)[0]])[0]
        result["weights"] = result["weights"].tolist()
        result["moments"] = result["moments"].tolist()
        results[name] = result
    results["stages"] = stage_order(rank, world)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, compare)


@pytest.mark.parametrize("overlapped, plain", [("overlap", "plain"), ("overlap_held", "plain"),
                                               ("overlap_accum", "plain_accum"), ("overlap_bf16", "bf16")])
def test_overlap_trains_exactly_as_plain_ddp(runs, overlapped, plain):
    ours, theirs = runs[overlapped], runs[plain]
    # The same collectives on the same gradients and torch's own AdamW per bucket: bit for bit.
    assert ours["weights"] == theirs["weights"]
    assert ours["moments"] == theirs["moments"]
    assert ours["losses"] == theirs["losses"]
    assert ours["eval"] == theirs["eval"]
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-5)  # summed by bucket: rounding differs
    assert theirs["losses"][-1] < theirs["losses"][0]


def test_overlap_counts_bytes_and_leaves_out_ddps_overlap_ratio(runs):
    params = sum(p.numel() for p in GPT(job().model).parameters())
    assert runs["overlap"]["metrics"]["comm_bytes"] == STEPS * params * 4
    assert runs["overlap_bf16"]["metrics"]["comm_bytes"] == STEPS * params * 2
    assert "overlap_ratio" not in runs["overlap"]["metrics"]  # DDP's timers would see every bucket done at once


def test_buckets_wait_in_the_order_the_forward_needs_them(runs):
    stages = runs["stages"]
    assert stages["needs"] == sorted(stages["needs"])
    assert len(set(stages["needs"])) > 2  # the buckets spread over several stages
    # Before block 0 (stage 1): every bucket the embeddings or block 0 use is applied (one may hold
    # some of block 1's parameters too); those only later stages use are not.
    assert {0, 1} <= set(stages["applied"]) and min(stages["pending"]) > 1
    assert stages["left"] == sum(1 for need in stages["needs"] if need > 1)


def test_forward_stages_follow_the_model():
    model = GPT(job().model)
    stages = model.forward_stages()
    assert stages[id(model.tok_emb.weight)] == stages[id(model.lm_head.weight)] == 0  # tied
    assert stages[id(model.blocks[0].attn.qkv.weight)] == 1
    assert stages[id(model.blocks[2].mlp.proj.weight)] == 3
    assert stages[id(model.ln_f.weight)] == 3  # counted with the last block
    assert len(stages) == len(list(model.parameters()))


@pytest.mark.parametrize("setting, field", [
    ({"train": {"grad_clip": 1.0}}, "[parallel] overlap"),
    ({"parallel": {"strategy": "fsdp"}}, "[parallel] overlap"),
    ({"parallel": {"comm_hook": "topk"}}, "[parallel] overlap"),
    ({"train": {"precision": "fp16"}, "cluster": {"use_gpu": True}}, "[parallel] overlap"),
    ({"compile": {"enable": True, "ddp_mode": "compiled_autograd"}}, "[parallel] overlap"),
    ({"parallel": {"overlap_backward_share": 1.5}}, "[parallel] overlap_backward_share"),
])
def test_the_config_refuses_what_the_overlap_cannot_do(setting, field):
    raw = {"train": {"grad_clip": 0.0}, "parallel": {"overlap": "next_forward"}}
    for section, values in setting.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError) as caught:
        JobConfig.from_dict(raw)
    assert caught.value.where == field


def test_the_share_sent_during_backward_comes_from_the_plan_unless_set():
    predicted = engine_spec(job(), 2, MICRO, 1).plan.predicted  # a hand-made plan predicts no communication
    config = job(overlap="next_forward")
    assert overlap_backward_share(config, predicted) == 1.0
    # GPT-2 124M over a 3.4 GB/s link: 60 ms of compute (40 of it backward), 146 ms of all-reduce.
    slow = dataclasses.replace(predicted, compute_seconds=0.060, communication_seconds=0.146)
    assert overlap_backward_share(config, slow) == pytest.approx(0.274, abs=1e-3)
    fast = dataclasses.replace(predicted, compute_seconds=0.060, communication_seconds=0.004)
    assert overlap_backward_share(config, fast) == 1.0
    assert overlap_backward_share(job(overlap="next_forward", overlap_backward_share=0.5), slow) == 0.5
    # The planner writes the share into the plan; the engine's overlap takes it from there.
    assert engine_spec(job(overlap="next_forward", overlap_backward_share=0.3), 2, MICRO, 1).plan.overlap_backward_share == 0.3