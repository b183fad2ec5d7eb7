"""What the driver and the workers check of a custom factory beyond tests/unit/test_custom_model.py: a forward
the meta device cannot run is tried on fake tensors before it is refused, a factory that builds other weights
on each worker is refused by the workers, a factory may return a workload of its own.
The module imports no driver code: its two ranks start quicker without it."""

from __future__ import annotations

import pytest
import torch

from core.config import JobConfig
from core.errors import ConfigError
from planning import memory
from planning.model_size import model_facts
from tests.engine_support import engine_spec, run_ranks
from tests.custom_workloads import LabelSmoothedLstm
from workers.activation_checkpointing import set_activation_checkpointing
from workers.engine import Engine
from workers.models import make_workload

MODEL = {"kind": "custom", "seq_len": 16, "vocab_size": 257}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0}


def config(factory: str, **train) -> JobConfig:
    return JobConfig.from_dict({"model": {**MODEL, "factory": factory}, "train": {**TRAIN, **train}})


def test_a_forward_that_reads_a_value_is_checked_on_fake_tensors_and_its_flops_and_memory_counted():
    job = config("tests.custom_workloads:reads_a_value")
    workload = make_workload(job.model)  # .item(): not on meta
    facts = model_facts(workload, 16)
    assert facts.counted and facts.flops_per_token > 6 * facts.parameters * 0.5
    step = memory.measure_step(memory.StepSpec.for_job(job, device_type="cpu"), 4)  # the plan's memory estimate
    assert step.parameter_bytes == facts.parameters * 4 and step.activation_bytes > 0


def test_a_forward_whose_output_hangs_on_a_value_is_refused_with_what_fake_tensors_said():
    with pytest.raises(ConfigError) as caught:
        make_workload(config("tests.custom_workloads:shape_hangs_on_a_value").model)
    said = str(caught.value)
    assert caught.value.where == "[model] factory" and "\n" not in said
    assert "fails on a batch of token ids (batch 2, seq 8): GuardOnDataDependentSymNode: Could not guard on " \
           "data-dependent expression" in said and "meta" not in said  # the fake tensors' error, not the meta device's
    assert "no branch on a tensor's value" in said


def weights_on_each_rank(rank: int, world: int) -> dict:
    said = {}
    for factory in ("tests.custom_models:lstm", "tests.custom_workloads:seeded_by_rank"):
        try:
            Engine(engine_spec(config(factory), world, 4, 1), rank, torch.device("cpu"))
            said[factory] = None
        except ConfigError as e:
            said[factory] = [type(e).__name__, e.where, str(e)]
    return said


def test_workers_that_build_different_weights_refuse_to_train():
    said = run_ranks(2, weights_on_each_rank)  # seeded_by_rank passes the driver's check: it is rank 0 there
    assert said["tests.custom_models:lstm"] is None
    kind, where, message = said["tests.custom_workloads:seeded_by_rank"]
    assert kind == "ConfigError" and where == "[model] factory"
    assert "the workers built different initial weights (their fingerprints are" in message
    assert "draw the initial weights from torch's random generator only" in message


def test_a_factory_may_return_its_own_workload_and_the_engine_trains_it_with_its_loss():
    workload = make_workload(config("tests.custom_workloads:label_smoothed").model)
    assert isinstance(workload, LabelSmoothedLstm) and model_facts(workload, 16).counted
    engine = Engine(engine_spec(config("tests.custom_workloads:label_smoothed"), 1, 4, 1), 0, torch.device("cpu"))
    torch.manual_seed(0)
    batch = torch.randint(0, 257, (4, 17))
    with torch.no_grad():
        logits = engine.model(batch[:, :-1]).flatten(0, 1)
        smoothed = torch.nn.functional.cross_entropy(logits, batch[:, 1:].flatten(), label_smoothing=0.1)
        plain = torch.nn.functional.cross_entropy(logits, batch[:, 1:].flatten())
    losses = [float(engine([batch], 1e-2)[0]) for _ in range(3)]
    assert losses[0] == pytest.approx(float(smoothed), rel=1e-6) and abs(float(smoothed) - float(plain)) > 1e-4
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0] - 0.01



def test_a_partly_frozen_model_is_planned_with_gradients_and_adamw_states_for_its_trained_part_only():
    job = config("tests.custom_models:partly_frozen")
    model = make_workload(job.model).build()
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    everything = sum(p.numel() for p in model.parameters())
    step = memory.measure_step(memory.StepSpec.for_job(job, device_type="cpu"), 4)
    assert sum(trained) < everything
    assert step.parameter_bytes == everything * 4 and step.gradient_bytes == sum(trained) * 4
    assert step.optimizer_bytes == sum(trained) * 8 + len(trained) * 4  # exp_avg, exp_avg_sq; a step count each


def losses_on_each_rank(rank: int, world: int, factories: list[str]) -> dict:
    """Each factory under DDP and FSDP2, rank r training on its half of a fixed batch: the global loss per step;
    and each rank's loss of a model with dropout on one batch, the same for both."""
    engine = Engine(engine_spec(config("tests.custom_models:with_dropout"), world, 4, 1), rank, torch.device("cpu"))
    engine.seed_step(0)
    local = engine(_halves(world)[:1], 1e-2)[0].detach().reshape(1)
    gathered = [torch.zeros(1) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    said = {"dropout": [float(t) for t in gathered]}
    for factory in factories:
        for strategy in ("ddp", "fsdp"):
            job = JobConfig.from_dict({**config(factory).to_dict(), "parallel": {"strategy": strategy}})
            engine = Engine(engine_spec(job, world, 4, 1), rank, torch.device("cpu"))
            said[f"{factory} {strategy}"] = [_global(engine(_halves(world)[rank:rank + 1], 1e-2)[0], world)
                                            for _ in range(4)]
    return said


def _halves(world: int) -> list[torch.Tensor]:
    return list(torch.randint(0, 257, (8, 17), generator=torch.Generator().manual_seed(3)).split(8 // world))


def _global(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(total)
    return float(total) / world


FROZEN_AND_SHARED = ["tests.custom_models:partly_frozen", "tests.custom_models:shared_layers"]


@pytest.fixture(scope="module")
def frozen_and_shared_runs() -> dict:
    return run_ranks(2, losses_on_each_rank, FROZEN_AND_SHARED)


@pytest.mark.parametrize("factory", FROZEN_AND_SHARED)
def test_a_partly_frozen_model_and_one_sharing_a_block_across_depth_train_under_ddp_and_fsdp2(
        factory, frozen_and_shared_runs):
    single = Engine(engine_spec(config(factory), 1, 4, 2), 0, torch.device("cpu"))
    embedding_before = single.model.embed.weight.detach().clone()
    alone = [float(single(_halves(2), 1e-2)[0]) for _ in range(4)]
    assert alone[-1] < alone[0] - 0.05
    for strategy in ("ddp", "fsdp"):
        assert frozen_and_shared_runs[f"{factory} {strategy}"] == pytest.approx(alone, rel=1e-5), strategy
    frozen = not single.model.embed.weight.requires_grad
    assert torch.equal(single.model.embed.weight, embedding_before) == frozen


def test_replicas_draw_their_own_dropout_masks(frozen_and_shared_runs):
    first, second = frozen_and_shared_runs["dropout"]  # one batch, one model: only the masks differ
    assert abs(first - second) > 1e-4


def test_a_step_draws_the_same_dropout_masks_again_when_resumed():
    engine = Engine(engine_spec(config("tests.custom_models:with_dropout"), 1, 4, 1), 0, torch.device("cpu"))
    batch = _halves(2)[:1]
    losses = {}
    for step in (5, 6, 5):
        engine.seed_step(step)
        losses.setdefault(step, []).append(float(engine(batch, 0.0)[0]))  # lr 0: the weights stay
    assert losses[5][0] == losses[5][1] and abs(losses[5][0] - losses[6][0]) > 1e-4


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_a_block_with_the_masks_its_forward_drew(mode):
    model = make_workload(config("tests.custom_models:with_dropout").model).build()
    batch = _halves(2)[0]
    gradients = {}
    for checkpointing in ("off", mode):
        set_activation_checkpointing(model.layers, checkpointing)
        model.zero_grad()
        torch.manual_seed(7)
        torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        gradients[checkpointing] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(gradients["off"], gradients[mode]))


def test_the_compile_check_stays_off_for_a_model_with_its_own_dropout():
    compiled = {"compile": {"enable": True}}
    with_dropout = JobConfig.from_dict({**config("tests.custom_models:with_dropout").to_dict(), **compiled})
    without = JobConfig.from_dict({**config("tests.custom_models:shared_layers").to_dict(), **compiled})
    engines = [Engine(engine_spec(job, 1, 4, 1), 0, torch.device("cpu")) for job in (with_dropout, without)]
    assert engines[0].compile_checker is None and engines[1].compile_checker is not None


def test_a_workload_keeping_a_tensor_of_its_own_is_planned_and_trains_with_it():
    job = config("tests.custom_workloads:token_weighted")
    workload = make_workload(job.model)
    assert workload.weights.device.type == "cpu"  # made off the meta device: the workers get its values
    step = memory.measure_step(memory.StepSpec.for_job(job, device_type="cpu"), 4)  # fake tensors meet a real one
    assert step.activation_bytes > 0 and model_facts(workload, 16).counted
    engine = Engine(engine_spec(job, 1, 4, 2), 0, torch.device("cpu"))
    batch = _halves(2)
    with torch.no_grad():
        logits = engine.model(batch[0][:, :-1]).flatten(0, 1)
        weighted = torch.nn.functional.cross_entropy(logits, batch[0][:, 1:].flatten(), weight=workload.weights)
    assert float(engine([batch[0], batch[0]], 0.0)[0]) == pytest.approx(float(weighted), rel=1e-6)
