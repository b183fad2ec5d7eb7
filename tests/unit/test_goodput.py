"""The goodput objectives (planning/goodput.py): Pollux's statistical efficiency, the worker count and
global batch they choose, dollars to a target, what the plan shows, and the config they need."""

import dataclasses
import json

import pytest
from rich.console import Console

from core.adaptive_batch import AdaptiveBatch, BatchPolicy, statistical_efficiency
from core.config import JobConfig
from core.errors import ConfigError
from core.plan import Objective
from planning.costing import PlanningJob, rank
from planning.goodput import (
    Statistics,
    Throughput,
    batch_ladder,
    best_size,
    dollars_to_target,
    goodput_samples_per_second,
)
from planning.plan_table import print_plan, significant
from planning.planner import Planner
from tests.conftest import write_job
from topology import machines

TINY_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128, "vocab_size": 257}
CLUSTER = "4xL4:4"
"""Sixteen L4s, four to a node over Ethernet: more workers pay only for a batch large enough to split."""


def job(objective: str = "goodput", **placement) -> JobConfig:
    return JobConfig.from_dict({
        "name": "t", "model": TINY_MODEL, "cluster": {"use_gpu": True},
        "train": {"batch_size": "adaptive", "global_batch_size": 64, "min_batch_size": 16, "max_batch_size": 1024,
                  "micro_batch_size": 16},
        "placement": {"objective": objective, **placement}})


@pytest.fixture(scope="module")
def memory():
    """The tiny model's memory profile, measured once for every planner here."""
    return Planner(machines.cluster(CLUSTER), job(), exact_memory=False).memory


def plan(config: JobConfig, memory, **kwargs):
    return Planner(machines.cluster(CLUSTER), config, memory=memory, exact_memory=False, **kwargs).plan()


def test_efficiency_is_pollux_law_and_the_adascale_gain_is_built_on_it():
    assert statistical_efficiency(256, 64, 192.0) == pytest.approx((192 + 64) / (192 + 256))  # 0.571…
    assert statistical_efficiency(256, 64, None) == 1.0
    assert statistical_efficiency(64, 64, 0.0) == 1.0
    policy = BatchPolicy(base_batch=64, min_batch=16, max_batch=1024, lr_scaling="adascale")
    state = AdaptiveBatch(batch=256)
    for _ in range(30):
        state.measure(small_sq_norm=3.0, small_batch=64, big_sq_norm=1.5)
    noise = state.noise_scale
    assert policy.lr_multiplier(state) == pytest.approx((1 + noise / 64) / (1 + noise / 256))


def test_goodput_and_dollars_to_target_by_hand():
    stats = Statistics(base_batch=64, noise_scale=64.0, samples_to_target=64_000)
    size = Throughput(workers=8, batch=256, step_seconds=1.5, dollars_per_hour=8.0)
    # E = (64 + 64) / (64 + 256) = 0.4; 256 samples / 1.5 s × 0.4
    assert goodput_samples_per_second(size, stats) == pytest.approx(256 / 1.5 * 0.4)
    # 64,000 / 0.4 = 160,000 samples = 625 steps of 1.5 s at $8 an hour
    assert dollars_to_target(size, stats) == pytest.approx(625 * 1.5 * 8 / 3600)


SMALL = Throughput(workers=4, batch=64, step_seconds=1.0, dollars_per_hour=4.0)
LARGE = Throughput(workers=8, batch=256, step_seconds=1.5, dollars_per_hour=8.0)
"""Per sample LARGE is the cheaper: $8 × 1.5 s / 256 = $1.30e-5 against $4 × 1 s / 64 = $1.74e-5."""


@pytest.mark.parametrize("noise, chosen", [(1e6, LARGE), (16.0, SMALL)])
def test_goodput_takes_the_larger_size_only_when_the_noise_scale_says_its_samples_count(noise, chosen):
    # noise 1e6: E ≈ 1, goodput 171 against 64 samples/s; noise 16: E(256) = 80 / 272 = 0.29, goodput
    # 256 / 1.5 × 0.29 = 50 against 64 at the base batch
    assert best_size([SMALL, LARGE], Objective.GOODPUT, Statistics(base_batch=64, noise_scale=noise)) == chosen


def test_cheapest_to_target_ranks_by_dollars_to_the_target_not_per_token():
    config = job("cheapest_to_target", noise_scale=64.0, tokens_to_target=64_000 * 128)
    planning_job = PlanningJob.from_config(config)
    # SMALL: E = 1, 64,000 samples = 1,000 steps × $4/3600 = $1.11; LARGE: E = 0.4, 160,000 samples =
    # 625 steps × 1.5 s × $8/3600 = $2.08. Per million tokens LARGE is the cheaper (above).
    assert dollars_to_target(SMALL, planning_job.statistics) == pytest.approx(1000 * 4 / 3600)
    assert dollars_to_target(LARGE, planning_job.statistics) == pytest.approx(625 * 1.5 * 8 / 3600)
    assert min([SMALL, LARGE], key=lambda size: rank(planning_job, size)) == SMALL
    cheapest = dataclasses.replace(planning_job, objective=Objective.CHEAPEST)
    assert min([SMALL, LARGE], key=lambda size: rank(cheapest, size)) == LARGE


def test_the_batch_ladder_doubles_through_the_range_with_both_ends_and_the_base():
    assert batch_ladder(16, 1024, 64) == (16, 32, 64, 128, 256, 512, 1024)
    assert batch_ladder(24, 100, 40) == (24, 40, 48, 96, 100)
    assert PlanningJob.from_config(job("fastest")).batch_sizes == (64,)  # only goodput objectives weigh batches


def test_the_planner_uses_more_workers_and_a_larger_batch_when_the_noise_scale_is_large(memory):
    noisy = plan(job(noise_scale=1e5), memory)
    clean = plan(job(noise_scale=2.0), memory)
    assert noisy.global_batch_size == 1024 and noisy.world_size == 16
    assert clean.global_batch_size == 16 and clean.world_size == 1
    assert noisy.predicted.statistical_efficiency == pytest.approx((1e5 + 64) / (1e5 + 1024))
    assert clean.predicted.goodput_tokens_per_second == pytest.approx(
        clean.predicted.tokens_per_second * (2 + 64) / (2 + 16))
    assert any(note.startswith("goodput took global batch 1024 on 16 workers (other batches: 16: 1 worker,")
               for note in noisy.notes)


def test_a_measured_noise_scale_wins_over_the_configured_one_and_none_is_said(memory):
    measured = plan(job(noise_scale=1e5), memory, measured_noise_scale=2.0)
    assert measured.global_batch_size == 16
    assert "planned with the run's measured gradient noise scale 2 samples" in measured.notes
    unknown = plan(job(), memory)
    assert unknown.predicted.statistical_efficiency == 1.0
    assert any(note.startswith("no gradient noise scale: none measured and [placement] noise_scale left out, "
                               "so every batch is costed at statistical efficiency 1") for note in unknown.notes)


def test_with_a_fixed_batch_goodput_keeps_it_and_picks_the_workers_as_fastest_does(memory):
    fixed = {"train": {"global_batch_size": 256, "micro_batch_size": 16}, "model": TINY_MODEL, "name": "t",
             "cluster": {"use_gpu": True}}
    goodput = JobConfig.from_dict({**fixed, "placement": {"objective": "goodput", "noise_scale": 2.0}})
    fastest = JobConfig.from_dict({**fixed, "placement": {"objective": "fastest"}})
    a, b = plan(goodput, memory), plan(fastest, memory)
    assert a.global_batch_size == b.global_batch_size == 256 and a.world_size == b.world_size


def test_the_plan_table_shows_goodput_and_dollars_to_the_target(memory):
    planner = Planner(machines.cluster(CLUSTER), job("cheapest_to_target", noise_scale=2000.0,
                                                      tokens_to_target=100_000_000), memory=memory, exact_memory=False)
    chosen = planner.plan()
    console = Console(record=True, width=200)
    print_plan(chosen, planner.naive(chosen.world_size, chosen.global_batch_size), console)
    text = console.export_text()
    assert "goodput tokens/s" in text and "batch efficiency" in text and "$ to target" in text
    assert significant(chosen.predicted.dollars_to_target) in text.split("$ to target")[1].splitlines()[0]
    assert "cheapest_to_target took global batch" in text


@pytest.mark.parametrize("placement, key, fix", [
    ({"objective": "cheapest_to_target"}, "[placement] tokens_to_target", "set tokens_to_target"),
    ({"objective": "goodput", "noise_scale": -3.0}, "[placement] noise_scale", "give the gradient noise scale"),
    ({"tokens_to_target": -1}, "[placement] tokens_to_target", "give the tokens"),
])
def test_goodput_settings_that_cannot_be_planned_are_config_errors_naming_key_and_fix(placement, key, fix):
    with pytest.raises(ConfigError) as error:
        JobConfig.from_dict({"placement": placement})
    assert error.value.where == key and error.value.fix.startswith(fix)


@pytest.mark.parametrize("noise", [None, 300.0])
def test_the_noise_scale_survives_the_configs_json_and_toml_round_trips(noise, tmp_path):
    """A report keeps its config as JSON (to_dict), and a job file is TOML, which has no null: a noise
    scale left out is left out of both, and a report written with null before reads back too."""
    config = job(**({} if noise is None else {"noise_scale": noise}))
    assert ("noise_scale" in config.to_dict()["placement"]) == (noise is not None)
    assert JobConfig.from_dict(json.loads(json.dumps(config.to_dict()))).placement == config.placement
    assert JobConfig.from_toml(write_job(tmp_path / "job.toml", config)).placement == config.placement
    with_null = config.to_dict()
    with_null["placement"]["noise_scale"] = noise
    assert JobConfig.from_dict(with_null).placement == config.placement
