"""`archipelago export` of a run directory only reads it: the newest step whose checksums fail is named and left
where it is, and the step before it is what transformers loads."""

import dataclasses
import json

import pytest
import torch

from core.config import JobConfig
from core.errors import CheckpointError, ConfigError
from orchestrator import export
from orchestrator.accounting.report import RunReport
from orchestrator.export import export_run
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import load_checkpoint
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


def started(config: JobConfig) -> RunDirectory:
    """The run directory of `config` with the report.json fit writes when it starts (export reads its config)."""
    run = RunDirectory(config.runs_dir, config.name)
    run.create(overwrite=False)
    report = {f.name: None for f in dataclasses.fields(RunReport)} | {"config": config.to_dict()}
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
