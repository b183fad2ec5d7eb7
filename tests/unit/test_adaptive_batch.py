"""The adaptive batch's policy (core/adaptive_batch.py), its re-split of a plan (core/plan.py) and the
config's refusals (core/config.py), all before anything starts: `archipelago fit` stops on a bad
adaptive config with its ConfigError, before Ray starts or the run directory is made."""

import math

import pytest
import ray

from core.adaptive_batch import AdaptiveBatch, BatchPolicy, batch_choices
from core.config import JobConfig, TrainConfig
from core.errors import ConfigError
from core.noise_scale import NoiseScaleEstimator
from core.plan import Plan, split_batch
from core.schedule import LrSchedule
from orchestrator.cli import main
from tests.conftest import toml_text

ADAPTIVE = dict(batch_size="adaptive", global_batch_size=8, min_batch_size=8, max_batch_size=64, micro_batch_size=8)


def state_with_noise(batch: int, noise: float, updates: int = 50) -> AdaptiveBatch:
    estimator = NoiseScaleEstimator(gradient_sq=1.0, trace=noise, weight=1.0, updates=updates)
    return AdaptiveBatch(batch, estimator)


def test_split_batch_takes_the_fewest_accumulation_steps_within_each_replica_s_micro_batch():
    assert split_batch(64, (16, 16)) == ((16, 16), 2)
    assert split_batch(24, (16, 8)) == ((16, 8), 1)        # in proportion to the limits
    assert split_batch(6, (16, 16)) == ((3, 3), 1)
    assert split_batch(7, (2, 2)) is None                   # prime above a full pass: nothing splits it
    for batch in range(2, 100):
        split = split_batch(batch, (5, 3))
        if split is not None:
            sizes, accum = split
            assert sum(sizes) * accum == batch and sizes[0] <= 5 and sizes[1] <= 3


def test_a_plan_re_split_for_another_batch_keeps_its_workers_and_checks_itself():
    plan = Plan.uniform(job_name="t", world_size=2, micro_batch_size=8, grad_accum_steps=1, seq_len=16)
    bigger = plan.with_global_batch(48)
    assert (bigger.global_batch_size, bigger.grad_accum_steps, bigger.replica_micro_batch_sizes()) == (48, 3, (8, 8))
    assert bigger.batch_layout().global_batch == 48 and bigger.workers[1].rank == 1
    assert plan.with_global_batch(4).replica_micro_batch_sizes() == (2, 2)


def test_the_batch_moves_to_the_noise_scale_only_once_it_leaves_the_hysteresis_band():
    policy = BatchPolicy.for_train(TrainConfig(**ADAPTIVE))
    choices = batch_choices(policy, (8, 8))
    assert choices == [8, 10, 12, 14, 16, 32, 48, 64]
    assert policy.decide(state_with_noise(8, 11.0), choices) is None          # inside 8 × 1.5
    assert policy.decide(state_with_noise(8, 14.0), choices) == 14
    assert policy.decide(state_with_noise(8, 500.0), choices) == 16           # at most doubled at once
    assert policy.decide(state_with_noise(32, 500.0), choices) == 64          # and never past max
    assert policy.decide(state_with_noise(16, 9.0), choices) == 10            # back down
    assert policy.decide(state_with_noise(14, 2.0), choices) == 8             # never below min
    assert policy.decide(state_with_noise(8, 30.0, updates=3), choices) is None   # too few measurements yet
    assert BatchPolicy.for_train(TrainConfig()).decide(state_with_noise(32, 500.0), choices) is None  # fixed


def test_the_learning_rate_follows_the_batch_by_adascale_or_sqrt_and_the_schedule_by_samples():
    adascale = BatchPolicy.for_train(TrainConfig(**ADAPTIVE))
    assert adascale.lr_multiplier(state_with_noise(32, 1e6)) == pytest.approx(4.0, rel=1e-3)   # noise: linear
    assert adascale.lr_multiplier(state_with_noise(32, 1e-6)) == pytest.approx(1.0)          # clean: none
    assert adascale.lr_multiplier(state_with_noise(32, 24.0)) == pytest.approx(4 / 1.75)
    assert adascale.lr_multiplier(AdaptiveBatch(32)) == 1.0                                  # not measured yet
    sqrt = BatchPolicy.for_train(TrainConfig(**ADAPTIVE, lr_scaling="sqrt"))
    assert sqrt.lr_multiplier(AdaptiveBatch(32)) == pytest.approx(2.0)
    schedule = LrSchedule.for_train(TrainConfig(**ADAPTIVE, steps=100, warmup_steps=10))
    # 40 steps of 8 then 10 of 32 have trained 640 samples: the schedule stands at base step 80 either way
    assert adascale.progress(40 * 8 + 10 * 32) == 80 and adascale.total_samples(100) == 800
    assert schedule.lr_at(adascale.progress(640)) == schedule.lr_at(80)
    assert math.isclose(schedule.lr_at(4.5), 1e-3 * 5.5 / 10)


def test_an_adaptive_run_is_finished_by_its_samples_and_a_fixed_one_by_its_steps():
    """[train] steps = 50 of 8 samples: 400 samples, however many steps its batches take (what --resume and
    the workers both ask)."""
    adaptive = BatchPolicy(base_batch=8, min_batch=4, max_batch=32, lr_scaling="sqrt")
    assert not adaptive.finished(60, 320, 50)  # smaller batches: past step 50, short of its samples
    assert adaptive.finished(40, 400, 50)  # larger ones: done before step 50
    fixed = BatchPolicy(8, 8, 8, "sqrt", adaptive=False)
    assert fixed.finished(50, 320, 50) and not fixed.finished(49, 400, 50)


def test_the_state_a_checkpoint_keeps_round_trips():
    state = state_with_noise(32, 12.0)
    state.changes = 3
    assert AdaptiveBatch.from_dict(state.to_dict()) == state


@pytest.mark.parametrize("train, elastic, cluster, key", [
    (dict(min_batch_size=64, max_batch_size=16), {}, {}, "[train] min_batch_size"),          # min above max
    (dict(lr_scaling="linear-ish"), {}, {}, "[train] lr_scaling"),                           # unknown LR rule
    (dict(min_batch_size=2), dict(min_workers=3), dict(num_workers=3), "[train] min_batch_size"),  # 2 over 3 workers
    (dict(min_batch_size=2, micro_batch_size=2), {}, dict(num_workers=4), "[train] min_batch_size"),  # a fixed size of 4
    (dict(global_batch_size=128), {}, {}, "[train] global_batch_size"),                      # start outside range
])
def test_bad_adaptive_configs_stop_fit_before_ray_starts_naming_the_key_and_the_fix(capsys, tmp_path, train, elastic,
                                                                                   cluster, key):
    table = {"runs_dir": str(tmp_path / "runs"), "data": {"path": str(tmp_path / "data"), "prepare_from": ""},
             "train": {**ADAPTIVE, **train}, "elastic": elastic, "cluster": cluster}
    job = tmp_path / "job.toml"
    job.write_text(toml_text(table) + "\n")
    with pytest.raises(ConfigError) as error:
        JobConfig.from_toml(job)
    assert key in str(error.value) and error.value.fix
    assert main(["fit", str(job)]) == 2
    assert str(error.value) in capsys.readouterr().out.replace("\n", "")
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


def test_an_adaptive_batch_refuses_what_it_cannot_measure():
    with pytest.raises(ConfigError, match='"adaptive" does not run with strategy = "fsdp"'):
        JobConfig.from_dict({"train": ADAPTIVE, "parallel": {"strategy": "fsdp"}})
    with pytest.raises(ConfigError, match="only apply to an adaptive batch"):
        JobConfig.from_dict({"train": {"max_batch_size": 64}})
