"""archipelago fit trains more than its GPT: a tiny Llama from [model], and the user's own LSTM from a
factory handed to the Python API, on two gloo workers; each is checkpointed and resumed exactly."""

import shutil

import pytest

from orchestrator import Orchestrator
from tests.custom_models import lstm
from tests.integration.conftest import job

pytestmark = pytest.mark.integration

LLAMA = {"kind": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "rope_scaling": 8.0}
LSTM = {"kind": "custom", "factory": "tests.custom_models:lstm", "width": 32, "output_dropout": 0.2}
"""Dropout: a resumed run must draw the masks the uninterrupted one drew at each step."""
STEPS, CUT = 6, 3


def losses(rows) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def straight_and_resumed(small_dataset, runs, name: str, table: dict, **api) -> tuple[dict, dict, list]:
    """An uninterrupted run of the [model] `table`, then a copy of it cut back to its first checkpoint
    and resumed; `api`: keyword arguments for Orchestrator."""
    sections = {"model": table, "checkpoint": {"every_steps": CUT, "keep_last": 2}}
    straight = Orchestrator(job(small_dataset, runs, name, STEPS, **sections), **api).fit()
    shutil.copytree(runs / name, runs / f"{name}-cut")
    shutil.rmtree(runs / f"{name}-cut" / f"step_{STEPS:08d}")
    resumed = Orchestrator(job(small_dataset, runs, f"{name}-cut", STEPS, **sections), resume=True, **api).fit()
    return losses(straight.metrics), losses(resumed.metrics), straight.metrics


def test_a_llama_trains_and_resumes_where_it_stopped(cluster, small_dataset, tmp_path):
    straight, resumed, rows = straight_and_resumed(small_dataset, tmp_path, "llama", LLAMA)
    assert straight[STEPS] < straight[1] - 0.5
    assert sorted(resumed) == list(range(CUT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=1e-5)
    start = next(r for r in rows if r.get("event") == "start")
    assert start["model"] == "llama" and start["flops_per_token"] > 6 * start["params"]


def script_factory(table: dict):
    return lstm(table)


script_factory.__module__ = "__main__"  # as if defined in the script that calls fit(): importable nowhere else


def test_a_factory_handed_to_the_python_api_trains_and_resumes(cluster, small_dataset, tmp_path):
    """The factory is the driver script's own: it reaches the plan coordinator and the workers pickled
    by value inside the workload (no process but the driver could import it by name)."""
    straight, resumed, rows = straight_and_resumed(small_dataset, tmp_path, "lstm", LSTM, model=script_factory)
    assert straight[STEPS] < straight[1] - 0.5
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=1e-5)
    start = next(r for r in rows if r.get("event") == "start")
    assert start["model"] == "__main__:script_factory"
