"""`archipelago export` of a run directory only reads it: the newest step whose checksums fail is named and left
where it is, and the step before it is what transformers loads."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from core.config import JobConfig
from core.errors import CheckpointError, ConfigError
from orchestrator import export
from orchestrator.accounting.report import RunReport
from orchestrator.cli import main
from orchestrator.export import export_run
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import load_checkpoint
from storage.prepare import prepare_dataset
from storage.tokenizers import load_tokenizer
from tests.engine_support import job_spec
from workers import checkpoint
from workers.models import make_workload
from workers.optim import build_optimizer

CONFIG = {"name": "sft", "model": {"kind": "llama", "n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 16},
          "train": {"global_batch_size": 2, "micro_batch_size": 2}, "cluster": {"num_workers": 1}}


def committed(run: RunDirectory, config: JobConfig, step: int) -> torch.nn.Module:
    """A model with its own weights (seeded by `step`), committed as that step of the run."""
    torch.manual_seed(step)
    model = make_workload(config.model).build()
    info = checkpoint.CheckpointInfo.for_spec(job_spec(config), step, 2 * step, 1)
    checkpoint.save(run.checkpoints.step(step), model, build_optimizer(model, config.train, torch.device("cpu")),
                    info).result()
    return model


def started(config: JobConfig, tokenizer: str = "bytes") -> RunDirectory:
    """The run directory of `config` with the report.json fit writes when it starts (export reads its config and
    `tokenizer`, the identity the dataset's manifest gave)."""
    run = RunDirectory(config.runs_dir, config.name)
    run.create(overwrite=False)
    report = {f.name: None for f in dataclasses.fields(RunReport)} | {"config": config.to_dict(),
                                                                      "tokenizer": tokenizer}
    (run.path / "report.json").write_text(json.dumps(report))
    return run


def test_export_skips_a_damaged_newest_step_and_moves_nothing(tmp_path):
    from transformers import AutoModelForCausalLM

    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs")})
    run = started(config)
    older, _ = committed(run, config, 4), committed(run, config, 8)
    damaged = next(run.checkpoints.step(8).local_path.glob("*.distcp"))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x7f")

    exported = export_run(run.path, tmp_path / "out")
    assert exported.step == 4 and len(exported.skipped) == 1 and exported.skipped[0].startswith("step 8: ")
    assert damaged.name in exported.skipped[0] and damaged.is_file()  # named, and left where it was
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(input_ids=tokens).logits
        torch.testing.assert_close(logits, older(tokens), rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="is not an empty directory"):
        export_run(run.path, tmp_path / "out")


def test_export_leaves_what_the_user_keeps_beside_out_and_nothing_of_its_own(tmp_path):
    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs")})
    run = started(config)
    committed(run, config, 4)
    notes = tmp_path / "exported" / "keep.partial" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")

    export_run(run.path, tmp_path / "exported" / "keep")
    assert notes.read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == ["keep", "keep.partial"]


def test_export_of_a_live_run_goes_on_to_the_step_committed_after_keep_last_deleted_the_one_being_read(
        tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs")})
    run = started(config)
    committed(run, config, 4)
    newer = []

    def live_run_moves_on(state, where, **kwargs):  # the run commits step 8 and keep_last = 1 deletes step 4
        if not newer:
            newer.append(committed(run, config, 8))
            run.checkpoints.prune(1)
        return load_checkpoint(state, where, **kwargs)

    monkeypatch.setattr(export, "load_checkpoint", live_run_moves_on)
    exported = export_run(run.path, tmp_path / "out")
    assert (exported.step, exported.skipped) == (8, [])
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(input_ids=tokens).logits
        torch.testing.assert_close(logits, newer[0](tokens), rtol=1e-4, atol=1e-5)


def test_export_of_a_run_that_keeps_deleting_the_step_being_read_says_to_export_again(tmp_path, monkeypatch):
    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs")})
    run = started(config)
    committed(run, config, 1)

    def live_run_moves_on(state, where, **kwargs):
        committed(run, config, run.checkpoints.committed()[-1][0] + 1)
        run.checkpoints.prune(1)
        return load_checkpoint(state, where, **kwargs)

    monkeypatch.setattr(export, "load_checkpoint", live_run_moves_on)
    with pytest.raises(CheckpointError, match="deleted the one being read, 3 times over — export again"):
        export_run(run.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def tokenizers_file(path: Path) -> Path:
    """A word-level tokenizers file whose end-of-document token is 5: neither the bytes' 256 nor the 2 of
    transformers' Llama defaults."""
    from tokenizers import Tokenizer, models

    words = ["<unk>", "the", "cat", "sat", "mat", "<|endoftext|>"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def token_ids(out: Path) -> list[tuple]:
    """(bos_token_id, eos_token_id) of config.json and of generation_config.json (None where absent)."""
    files = (json.loads((out / name).read_text()) for name in ("config.json", "generation_config.json"))
    return [(values.get("bos_token_id"), values.get("eos_token_id")) for values in files]


def test_export_of_byte_level_data_ends_generation_on_its_end_of_document_token_and_says_it_has_no_tokenizer(
        tmp_path, capsys):
    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs")})
    run = started(config)
    committed(run, config, 4)

    assert main(["export", str(run.path), "--hf", str(tmp_path / "out")]) == 0
    assert token_ids(tmp_path / "out") == [(None, 256), (None, 256)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                   "model.safetensors"]
    assert "byte-level (token i is byte i, 256 ends a document): there is no tokenizer file to copy" in \
        " ".join(capsys.readouterr().out.split())


def test_export_of_tokenizers_file_data_copies_the_file_and_ends_generation_on_its_end_of_document_token(tmp_path):
    from transformers import AutoTokenizer

    file = tokenizers_file(tmp_path / "tok.json")
    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs"), "data": {"tokenizer": f"hf:{file}"}})
    run = started(config, tokenizer=load_tokenizer(f"hf:{file}").name)
    committed(run, config, 4)

    exported = export_run(run.path, tmp_path / "out")
    assert token_ids(tmp_path / "out") == [(None, 5), (None, 5)]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == file.read_bytes()
    assert AutoTokenizer.from_pretrained(tmp_path / "out").eos_token_id == 5
    assert exported.tokenizer_note == ""


def test_export_of_a_run_on_a_prepared_dataset_copies_the_tokenizers_file_the_dataset_keeps(tmp_path, corpus_dir):
    """`prepare --tokenizer hf:tok.json --out data/bpe`, then a run with [data] path = "data/bpe" alone."""
    file = tokenizers_file(tmp_path / "tok.json")
    summary = prepare_dataset(str(corpus_dir), tmp_path / "bpe", tokenizer=f"hf:{file}", val_percent=25, workers=1)
    original = file.read_bytes()
    file.unlink()  # the dataset's own copy is what export finds
    data = {"path": str(summary.directory)}
    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs"), "data": data})
    run = started(config, tokenizer=summary.tokenizer)
    committed(run, config, 4)

    exported = export_run(run.path, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == original
    assert token_ids(tmp_path / "out") == [(None, 5), (None, 5)] and exported.tokenizer_note == ""
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


def test_export_says_when_the_data_tokenizers_file_is_not_found_and_writes_no_end_of_document_id(tmp_path):
    file = tokenizers_file(tmp_path / "tok.json")
    data = {"path": str(tmp_path / "gone")}  # [data] path alone names no tokenizers file, and holds none now
    config = JobConfig.from_dict({**CONFIG, "runs_dir": str(tmp_path / "runs"), "data": data})
    run = started(config, tokenizer=load_tokenizer(f"hf:{file}").name)
    committed(run, config, 4)

    exported = export_run(run.path, tmp_path / "out")
    assert token_ids(tmp_path / "out") == [(None, None), (None, None)]
    assert "(hf-json:" in exported.tokenizer_note and "has no tokenizer and no eos_token_id" in exported.tokenizer_note
