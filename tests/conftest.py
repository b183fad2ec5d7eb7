"""Shared fixtures: a small real corpus and a tiny job config that trains in seconds; and, under
CI=true, no test skips but those marked gpu.

The topology probe's device micro-benchmark (topology/device_figures.py) writes its cache into a
directory of this session and spends little time per figure: tests never touch ~/.cache, and only
the first probe of a session measures."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import pytest

from core.config import JobConfig
from storage.prepare import prepare_dataset


_SESSION_CACHE: list[str] = []
"""The cache directory this session made (none when ARCHIPELAGO_CACHE_DIR was set already): removed at its end."""


def pytest_configure(config) -> None:
    if "ARCHIPELAGO_CACHE_DIR" not in os.environ:
        _SESSION_CACHE.append(tempfile.mkdtemp(prefix="archipelago-test-cache-"))
        os.environ["ARCHIPELAGO_CACHE_DIR"] = _SESSION_CACHE[-1]
    os.environ.setdefault("ARCHIPELAGO_DEVICE_BENCH_S", "0.05")


def pytest_unconfigure(config) -> None:
    for directory in _SESSION_CACHE:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skip fails the test, unless it is marked gpu: CI runs everything a CPU can run,
    and a skip there is a missing install (triton, Chromium) hiding a test that never ran."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and os.environ.get("CI") == "true" and item.get_closest_marker("gpu") is None
            and not hasattr(report, "wasxfail")):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true ({reason}): CI must run every test a CPU can run; install "
                           "what it needs in the Makefile or .ci/run, or mark it gpu")


# A slice of the standard library: real text, present on every machine, a few hundred KB.
CORPUS_SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "email"


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A directory of text files (copied so tests can add or damage files)."""
    target = tmp_path_factory.mktemp("corpus") / "email"
    shutil.copytree(CORPUS_SOURCE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture(scope="session")
def dataset_dir(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "email-bytes"
    # One process: the corpus is small, and a pool of fresh interpreters would take longer to start than it saves.
    prepare_dataset(str(corpus_dir), out, val_percent=25.0, shard_tokens=64 * 1024, workers=1)
    return out


def tiny_job(dataset_dir: Path, runs_dir: Path, **sections) -> JobConfig:
    """A job small enough to run a dozen steps in a few seconds on two CPU workers."""
    base = {
        "name": "tiny",
        "runs_dir": str(runs_dir),
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 32},
        "data": {"path": str(dataset_dir), "prepare_from": ""},
        "train": {"steps": 8, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-2, "min_lr": 1e-2,
                  "warmup_steps": 0, "log_every": 2, "eval_every": 4, "eval_samples": 8},
        "checkpoint": {"every_steps": 4, "keep_last": 2},
        "cluster": {"num_workers": 2},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            base[section] = {**base.get(section, {}), **values}
        else:
            base[section] = values
    return JobConfig.from_dict(base)


def write_job(path: Path, config: JobConfig) -> Path:
    """`config` as a TOML file at `path`, for the command line."""
    path.write_text(toml_text(config.to_dict()) + "\n")
    assert JobConfig.from_toml(path) == config  # the file says exactly this job
    return path


def toml_text(table: dict, prefix: str = "") -> str:
    """A config dict as TOML: its values (JSON writes strings, numbers, booleans and lists as TOML does),
    then each sub-table under its header."""
    lines = [f"{key} = {json.dumps(value)}" for key, value in table.items() if not isinstance(value, dict)]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", f"[{prefix}{key}]", toml_text(value, f"{prefix}{key}.")]
    return "\n".join(lines)
