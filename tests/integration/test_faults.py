"""Faults told apart on a real Ray cluster (conftest.py's): a damaged shard is the user's data, not a node
failure, so the run stops at its first read of it, with one line naming the file and the fix, and without
spending the [elastic] failure budget on retries that would fail the same way."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from rich.console import Console

from core.errors import DataError, RepeatedFailureError
from orchestrator import Orchestrator
from storage.shards import HEADER_BYTES
from tests.integration.conftest import job

pytestmark = pytest.mark.integration


def test_a_corrupt_shard_stops_the_run_at_once_naming_it(cluster, small_dataset, tmp_path_factory):
    data = tmp_path_factory.mktemp("corrupt") / "bytes"
    shutil.copytree(small_dataset[0], data)
    shard = data / "train-00000.tokens"
    payload = shard.read_bytes()
    shard.write_bytes(payload[:HEADER_BYTES] + b"\xff" * (len(payload) - HEADER_BYTES))  # same size, other bytes
    runs = tmp_path_factory.mktemp("runs")
    config = job((data, small_dataset[1]), runs, "corrupt", 20, elastic={"max_failures": 3})
    with pytest.raises(DataError) as info:
        Orchestrator(config, console=Console(file=io.StringIO())).fit()
    message = str(info.value)
    assert message.startswith(f"{shard}: token id 65535 ≥ vocabulary size 257 at offset {HEADER_BYTES}")
    assert f"run `archipelago verify {data}` for every bad shard" in message
    rows = [json.loads(line) for line in (runs / "corrupt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows if r.get("event") == "worker_lost"] == ["worker_lost"]  # no retries


def test_a_model_that_fails_the_same_way_after_a_restart_stops_the_run_naming_the_error(cluster, small_dataset,
                                                                                         tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    config = job(small_dataset, runs, "model-bug", 4, elastic={"max_failures": 3},
                 model={"kind": "custom", "factory": "tests.custom_models:fails_where_it_trains"})
    with pytest.raises(RepeatedFailureError) as info:
        Orchestrator(config, console=Console(file=io.StringIO())).fit()
    assert info.value.where == "step 1, rank 0"
    assert info.value.what.startswith("the workers failed twice with the same error, so restarting cannot fix it: "
                                      "IndexError: index 67 is out of bounds for dimension 1 with size 64")
    assert "custom_models.py" in info.value.what and "in forward)" in info.value.what
    rows = [json.loads(line) for line in (runs / "model-bug" / "metrics.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in rows if r.get("event") == "worker_lost"] == [1, 2]  # one retry, not three
