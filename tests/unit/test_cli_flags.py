"""Every flag of every command, given bad input: exit 2, one line that names the flag (or the file), no
traceback, no hang, and nothing deleted or overwritten. `test_every_flag_has_a_bad_input_case` holds the
list to the parser: a flag added without a case here fails it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import pytest

from core.config import JobConfig
from orchestrator.accounting.report import RunReport
from orchestrator.cli import _parser, main
from storage.prepare import prepare_dataset

REFUSED = "127.0.0.1:1"
"""A loopback port nothing listens on: a connection is refused at once."""

# (argv, a fragment of the one line). {job}, {data}, {out}, {file}, {dir} are filled in by the fixture.
CASES = [
    ([], "the following arguments are required: COMMAND"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["--debug"], "the following arguments are required: COMMAND"),
    (["fit"], "the following arguments are required: config"),
    (["fit", "{dir}/missing.toml"], "missing.toml: config file not found"),
    (["fit", "{job}", "--address", REFUSED], "cannot connect (Connection refused)"),
    (["fit", "{job}", "--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    (["fit", "{job}", "--connect-timeout", "0"], "--connect-timeout: must be a number of seconds above 0, got 0"),
    (["fit", "{job}", "--connect-timeout", "soon"], "argument --connect-timeout: invalid seconds value: 'soon'"),
    (["prepare", "--out", "{out}"], "the following arguments are required: --source"),
    (["prepare", "--source", "{dir}"], "the following arguments are required: --out"),
    (["prepare", "--source", "{dir}/missing", "--out", "{dir}/new"], "source directory does not exist"),
    (["prepare", "--source", "{dir}", "--out", "{file}"], "is a file, not a dataset directory"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--format", "csv"], "argument --format: invalid choice"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--pattern", "*.nothing"], "no files matching '*.nothing'"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--text-column", ""], "--text-column / [data] text_column: is empty"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--tokenizer", "words"], "unknown tokenizer 'words'"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--tokenizer", "hf:{dir}/missing.json"], "tokenizer file not found"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--val-percent", "100"], "--val-percent / [data] val_percent: must be in (0, 100), got 100"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--val-percent", "nan"], "must be in (0, 100), got nan"),
    (["prepare", "--source", "{dir}", "--out", "{out}", "--shard-tokens", "0", "--overwrite"], "--shard-tokens / [data] shard_tokens: must be 1 or more, got 0"),
    (["prepare", "--source", "{dir}", "--out", "{out}", "--shard-tokens", "-5", "--overwrite"], "must be 1 or more, got -5"),
    (["prepare", "--source", "{dir}", "--out", "{out}", "--workers", "-1", "--overwrite"], "--workers / [data] prepare_workers: must be 0 or more, got -1"),
    (["prepare", "--source", "{dir}", "--out", "{out}"], "a prepared dataset is already here"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--seq-len", "-1"], "--seq-len / [model] seq_len: must be 0 or more, got -1"),
    (["prepare", "--source", "{dir}", "--out", "{dir}/new", "--format", "chat"], "--format chat packs conversations into samples and needs their length"),
    (["export", "{dir}/missing"], "the following arguments are required: --hf"),
    (["export", "{dir}/missing", "--hf", "{dir}/out"], "missing/report.json: cannot read it"),
    (["export", "{run}", "--hf", "{file}"], "note.txt exists and is not an empty directory"),
    (["export", "{run}", "--hf", "{dir}/out", "--quantized"], "the run trained without quantization-aware training"),
    (["verify", "{dir}/missing"], "no prepared dataset here"),
    (["verify", "{data}", "--threads", "0"], "--threads / [data] reader_threads: must be 1 or more, got 0"),
    (["report", "{dir}/missing"], "missing/report.json: cannot read it"),
    (["report", "{dir}", "{dir}", "{dir}"], "3 run directories given"),
    (["report", "{dir}/missing", "--out", "{file}"], "--out: {file} is a file"),
    (["prices", "--config", "{dir}/missing.toml"], "missing.toml: config file not found"),
    (["calibrate"], "the following arguments are required: RUN_DIR"),
    (["calibrate", "{dir}/missing"], "missing/report.json: cannot read it"),
    (["calibrate", "{dir}/missing", "--dry-run"], "missing/report.json: cannot read it"),
    (["calibrate", "{dir}/missing", "--sweep", "{file}"], "{file}: cannot read a sweep from it"),
    (["calibrate", "{dir}/missing", "--out", "{dir}"], "--out: {dir} is a directory"),
    (["topology", "--address", REFUSED], "cannot connect (Connection refused)"),
    (["topology", "--local", "--generate", "8xH100-SXM:1"], "argument --generate: not allowed with argument --local"),
    (["topology", "--from", "{dir}/missing.json"], "missing.json: cannot read it"),
    (["topology", "--generate", ""], "--generate: names no machines"),
    (["topology", "--generate", "8xH100-SXM:0"], "node count '0' in '8xH100-SXM:0' is not a positive whole number"),
    (["topology", "--generate", "8xH100-SXM:1", "--json", "{dir}"], "--json: {dir} is a directory"),
    (["topology", "--generate", "8xH100-SXM:1", "--png", "{file}/map.png"], "--png: {file} is a file, so nothing can be written under it"),
    (["topology", "--generate", "8xH100-SXM:1", "--timeout", "-1"], "--timeout: must be a number of seconds above 0"),
    (["topology", "--generate", "8xH100-SXM:1", "--connect-timeout", "inf"], "--connect-timeout: must be a number of seconds above 0, got inf"),
    (["node-resources", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["plan"], "the following arguments are required: --config"),
    (["plan", "--config", "{dir}/missing.toml", "--generate", "8xH100-SXM:1"], "missing.toml: config file not found"),
    (["plan", "--config", "{job}", "--topology", "{dir}/missing.json"], "missing.json: cannot read it"),
    (["plan", "--config", "{job}", "--generate", ""], "--generate: names no machines"),
    (["plan", "--config", "{job}", "--generate", "16xH100:1"], "unknown machine '16xH100'"),
    (["plan", "--config", "{job}", "--address", REFUSED], "cannot connect (Connection refused)"),
    (["plan", "--config", "{job}", "--generate", "8xH100-SXM:1", "--json", "{dir}"], "--json: {dir} is a directory"),
    (["plan", "--config", "{job}", "--generate", "8xH100-SXM:1", "--png", "{file}/plan.png"], "--png: {file} is a file"),
    (["plan", "--config", "{job}", "--generate", "8xH100-SXM:1", "--timeout", "0"], "--timeout: must be a number of seconds above 0"),
    (["plan", "--config", "{job}", "--generate", "8xH100-SXM:1", "--connect-timeout", "-3"], "--connect-timeout: must be a number of seconds above 0"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory, corpus_dir, dataset_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flags")
    out = root / "prepared"
    prepare_dataset(str(corpus_dir), out, shard_tokens=64 * 1024, workers=1)
    (root / "note.txt").write_text("keep me")
    job = root / "job.toml"
    job.write_text(f'name = "flags"\nruns_dir = "{root / "runs"}"\n[data]\npath = "{dataset_dir}"\n')
    run = root / "trained"  # what export reads first: report.json's config (a Llama trained without QAT)
    run.mkdir()
    report = {f.name: None for f in dataclasses.fields(RunReport)}
    report["config"] = JobConfig.from_dict({"model": {"kind": "llama"}}).to_dict()
    (run / "report.json").write_text(json.dumps(report))
    return {"job": str(job), "data": str(dataset_dir), "out": str(out), "file": str(root / "note.txt"),
            "dir": str(root), "run": str(run)}


def snapshot(root: str) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time: what a refused command must leave as it was."""
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(argv) or "(none)" for argv, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(capsys, places, argv, message):
    before = snapshot(places["dir"])
    started = time.monotonic()
    code = main([arg.format(**places) for arg in argv])
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert code == 2, text
    assert text.startswith("error: ") and "\n" not in text, text
    assert message.format(**places) in text and "Traceback" not in text
    assert time.monotonic() - started < 20  # refused and malformed input answers at once
    assert snapshot(places["dir"]) == before


def test_every_flag_has_a_bad_input_case():
    covered = {(argv[0], arg) for argv, _ in CASES if argv for arg in argv if arg.startswith("--")}
    subcommands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {(name, option) for name, parser in subcommands.choices.items() for action in parser._actions
             for option in action.option_strings if option not in ("-h", "--help", "--debug")}
    assert flags - covered == set()
