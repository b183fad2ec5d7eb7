"""bf16 weights with fp32 masters ([train] bf16_weights): the engine trains a bf16 copy and steps the
fp32 model, alone and under DDP on 2 gloo ranks; what it refuses, and how it restores."""

import copy

import pytest
import torch

from core.config import JobConfig
from core.errors import ConfigError
from tests.engine_support import engine_spec, run_ranks
from tests.unit.test_engine import MICRO, batches_for, job, train
from workers.engine import Engine

CPU = torch.device("cpu")


def config(**train_settings) -> JobConfig:
    sections = job().to_dict()
    sections["train"].update(train_settings)
    return JobConfig.from_dict(sections)


def bf16_weights_engine(world: int = 1, accum: int = 2, rank: int = 0, **parallel) -> Engine:
    cfg = config(precision="bf16", bf16_weights=True)
    if parallel:
        cfg = JobConfig.from_dict({**cfg.to_dict(), "parallel": parallel})
    islands = [list(range(world))] if parallel.get("comm_hook") == "hierarchical" else None
    return Engine(engine_spec(cfg, world, MICRO, accum, islands=islands), rank, CPU)


def test_tracks_bf16_autocast_training_and_keeps_fp32_masters():
    autocast = Engine(engine_spec(config(precision="bf16"), 1, MICRO, 2), 0, CPU)
    ours = bf16_weights_engine()
    theirs_losses, our_losses = train(autocast, 0, 1, 2), train(ours, 0, 1, 2)
    for a, b in zip(our_losses, theirs_losses):
        assert a == pytest.approx(b, rel=2e-3)
    assert our_losses[-1] < our_losses[0] - 0.5
    assert {p.dtype for p in ours.model.parameters()} == {torch.float32}
    assert {p.dtype for p in ours.compute_copy.model.parameters()} == {torch.bfloat16}
    states = [t for s in ours.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.float32}
    assert all(p.grad is None for p in ours.compute_copy.model.parameters())


def test_the_copy_is_the_masters_rounded_to_bf16_at_every_step():
    engine = bf16_weights_engine()
    train(engine, 0, 1, 2, steps=2)
    stale = [p.detach().clone() for p in engine.compute_copy.model.parameters()]
    engine.compute_copy.pull_weights()
    pulled = list(engine.compute_copy.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(stale, pulled))  # the step moved the masters
    for master, bf16 in zip(engine.model.parameters(), pulled):
        assert torch.equal(master.detach().to(torch.bfloat16), bf16)
    embedding, head = engine.compute_copy.model.tok_emb.weight, engine.compute_copy.model.lm_head.weight
    assert embedding is head  # tied in the copy as in the model


def test_a_restored_engine_continues_exactly_from_the_saved_masters():
    """Checkpoints hold the fp32 model and optimizer only: the copy is rebuilt from them at the next step."""
    original = bf16_weights_engine()
    train(original, 0, 1, 2, steps=3)
    saved = copy.deepcopy((original.model.state_dict(), original.optimizer.state_dict()))
    expected = original(batches_for(3, 0, 1, 2), lr=3e-3)[0]
    restored = bf16_weights_engine()
    restored.model.load_state_dict(saved[0])
    restored.optimizer.load_state_dict(saved[1])
    assert torch.equal(restored(batches_for(3, 0, 1, 2), lr=3e-3)[0], expected)


def ddp_runs(rank: int, world: int) -> dict:
    results = {}
    for hook in ("allreduce", "hierarchical"):
        engine = bf16_weights_engine(world=world, accum=1, rank=rank, comm_hook=hook)
        results[hook] = {"losses": train(engine, rank, world, 1), "comm_bytes": engine.window_metrics()["comm_bytes"]}
    return results


def test_ddp_on_two_ranks_tracks_one_process_and_reduces_bf16():
    runs = run_ranks(2, ddp_runs)
    single = train(bf16_weights_engine(), 0, 1, 2)
    for ours, theirs in zip(runs["allreduce"]["losses"], single):
        assert ours == pytest.approx(theirs, rel=5e-3)
    # The island's reduce-scatter and all-gather sum the same bf16 gradients in another order.
    for ours, theirs in zip(runs["hierarchical"]["losses"], runs["allreduce"]["losses"]):
        assert ours == pytest.approx(theirs, rel=5e-3)
    params = sum(p.numel() for p in bf16_weights_engine().model.parameters())
    assert runs["allreduce"]["comm_bytes"] == len(single) * params * 2  # bf16 gradients: half of fp32's bytes
    # Reduce-scatter of the bucket, then all-gather of a half-size shard, in bf16.
    assert runs["hierarchical"]["comm_bytes"] == pytest.approx(1.5 * runs["allreduce"]["comm_bytes"], rel=0.01)


@pytest.mark.parametrize("sections, where", [
    ({"train": {"precision": "fp16"}}, "[train] bf16_weights"),
    ({"train": {"precision": "auto"}}, "[train] bf16_weights"),  # CPU workers: "auto" is fp32
    ({"parallel": {"strategy": "fsdp"}}, "[train] bf16_weights"),
    ({"parallel": {"comm_hook": "topk"}}, "[parallel] comm_hook"),
])
def test_settings_it_cannot_train_with_are_refused_by_name(sections, where):
    raw = job().to_dict()
    raw["train"].update(bf16_weights=True, precision="bf16")  # each case breaks one thing
    for section, values in sections.items():
        raw[section].update(values)
    with pytest.raises(ConfigError) as error:
        JobConfig.from_dict(raw)
    assert error.value.where == where


def test_the_worker_trains_in_the_precision_its_plan_names():
    """A GPU job's "auto" is resolved to bf16 by the planner; the worker takes it as it is, on any device."""
    raw = config(bf16_weights=False).to_dict()
    raw["train"]["bf16_weights"], raw["cluster"]["use_gpu"] = True, True
    spec = engine_spec(JobConfig.from_dict(raw), 1, MICRO, 2)
    assert spec.plan.precision == spec.train.precision == "bf16"
    engine = Engine(spec, 0, CPU)
    assert engine.precision.name == "bf16" and engine.compute_copy is not None


