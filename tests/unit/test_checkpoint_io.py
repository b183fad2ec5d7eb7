"""Checkpoint IO in one process: raw aligned DCP files, atomic commit, retention, async save, bad input."""

import dataclasses
import json
import os
import pickle
import zlib

import pytest
import torch

from core.adaptive_batch import AdaptiveBatch
from core.config import JobConfig
from core.errors import CheckpointError
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import (
    ALIGN,
    DCP_METADATA,
    CheckpointStore,
    RawExtent,
    is_committed,
    load_checkpoint,
    save_checkpoint,
)
from tests.checkpoint_support import CONFIG, trained
from tests.engine_support import job_spec
from workers import checkpoint
from workers.models import make_workload

IDENTITY = make_workload(CONFIG.model).identity()


def info(step: int) -> checkpoint.CheckpointInfo:
    return checkpoint.CheckpointInfo.for_spec(job_spec(CONFIG), step, step * 4, world_size=1)


def test_round_trip_restores_weights_and_optimizer_exactly(tmp_path):
    model, optimizer = trained(0)
    checkpoint.save(tmp_path / "step_00000001", model, optimizer, info(1))
    fresh, fresh_opt = trained(1)
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight) if hasattr(model, "lm_head") else True
    loaded, readers = checkpoint.load(tmp_path / "step_00000001", fresh, fresh_opt)
    assert loaded == info(1) and readers == {"posix"}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_tensors_are_raw_bytes_on_4k_boundaries(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16),
             "scalar": torch.tensor(7), "meta": {"note": "hello"}}
    save_checkpoint(state, tmp_path / "ck").result()
    metadata = pickle.loads((tmp_path / "ck" / DCP_METADATA).read_bytes())
    extents = [e for e in metadata.storage_data.values() if e.dtype is not None]
    assert len(extents) == 3 and all(isinstance(e, RawExtent) and e.offset % ALIGN == 0 for e in extents)
    w = next(e for e in extents if e.shape == (1000,))
    raw = (tmp_path / "ck" / w.relative_path).read_bytes()[w.offset:w.offset + w.length]
    assert raw == state["w"].numpy().tobytes()
    target = {"w": torch.zeros(1000), "b": torch.zeros(3, dtype=torch.bfloat16), "scalar": torch.tensor(0),
              "meta": {"note": ""}}
    load_checkpoint(target, tmp_path / "ck")
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["scalar"].item() == 7 and target["meta"] == {"note": "hello"}


def test_a_step_without_metadata_is_not_committed_and_is_cleaned_up(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        save_checkpoint({"x": torch.full((10,), float(step))}, store.step(step),
                        extra={checkpoint.INFO_FILE: b"{}"}).result()
    (store.step(2) / DCP_METADATA).remove()  # as if the save of step 2 crashed before committing
    assert [s for s, _ in store.committed()] == [1] and store.latest() == store.step(1)
    assert store.remove_uncommitted() == [store.step(2)] and not store.step(2).exists()
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        load_checkpoint({"x": torch.zeros(10)}, store.step(2))


def test_extra_files_are_written_before_the_commit_and_a_save_replaces_a_stale_step(tmp_path):
    target = tmp_path / "step_00000005"
    target.mkdir()
    (target / "__7_0.distcp").write_bytes(b"left by a crashed save with more ranks")
    save_checkpoint({"x": torch.ones(4)}, target, extra={"archipelago.json": b'{"step": 5}'}).result()
    assert sorted(p.name for p in target.iterdir()) == [".metadata", "__0_0.distcp", "archipelago.json", "checksums.json"]
    assert json.loads((target / "archipelago.json").read_text()) == {"step": 5}


def test_retention_keeps_the_newest_k(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in range(1, 6):
        save_checkpoint({"x": torch.ones(2)}, store.step(step)).result()
    deleted = store.prune(keep_last=2)
    assert [d.name for d in deleted] == ["step_00000001", "step_00000002", "step_00000003"]
    assert [s for s, _ in store.committed()] == [4, 5]


def test_async_save_snapshots_the_state_before_returning(tmp_path):
    state = {"x": torch.arange(100_000, dtype=torch.float32)}
    pending = save_checkpoint(state, tmp_path / "ck", async_save=True)
    state["x"].mul_(-1)  # training goes on and changes the tensors while the save is in flight
    assert pending.result() == pending.location and is_committed(tmp_path / "ck")
    target = {"x": torch.zeros(100_000)}
    load_checkpoint(target, tmp_path / "ck")
    assert torch.equal(target["x"], torch.arange(100_000, dtype=torch.float32))


def test_run_checkpoints_saves_async_and_applies_retention(tmp_path):
    config = JobConfig.from_dict({**CONFIG.to_dict(), "checkpoint": {"keep_last": 2, "async_save": True}})
    model, optimizer = trained(0)
    runs = checkpoint.RunCheckpoints(tmp_path, job_spec(config), rank=0)
    committed = []
    for step in (1, 2, 3):
        committed += runs.save(model, optimizer, checkpoint.CheckpointInfo.for_spec(job_spec(config), step, step))
    assert committed == [1, 2]  # step 3 is still in flight until waited for
    assert runs.wait() == [3] and [s for s, _ in runs.store.committed()] == [2, 3]
    fresh, fresh_opt = trained(1)
    restored_info, _ = runs.restore(fresh, fresh_opt)
    assert restored_info.step == 3


def test_incompatible_checkpoints_are_refused_with_the_reason(tmp_path):
    model, optimizer = trained(0)
    checkpoint.save(tmp_path / "ck", model, optimizer, info(1))
    saved = checkpoint.read_info(tmp_path / "ck")
    job = {"identity": IDENTITY, "seed": CONFIG.train.seed, "tokenizer": "bytes",
           "global_batch_size": CONFIG.train.global_batch_size, "directory": tmp_path / "ck"}
    with pytest.raises(CheckpointError, match="trained on 'bytes' tokens, the dataset has 'hf-json:abc'"):
        checkpoint.check_compatible(saved, **{**job, "tokenizer": "hf-json:abc"})
    with pytest.raises(CheckpointError, match=f"seed = {CONFIG.train.seed}, the config has {CONFIG.train.seed + 1}"):
        checkpoint.check_compatible(saved, **{**job, "seed": CONFIG.train.seed + 1})
    with pytest.raises(CheckpointError, match="global_batch_size = 4 samples, the config has 8"):
        checkpoint.check_compatible(saved, **{**job, "global_batch_size": 8})
    checkpoint.check_compatible(saved, **job)  # the same job resumes
    fields = json.loads((tmp_path / "ck" / "archipelago.json").read_text())
    legacy = dataclasses.replace(saved, sampler="numpy-permutation")
    assert fields["lr_schedule"]["decays"][0]["end_step"] == CONFIG.train.steps  # recorded for the resume
    with pytest.raises(CheckpointError, match="sampler 'numpy-permutation'.*start a new run"):
        checkpoint.check_compatible(legacy, **job)
    with pytest.raises(CheckpointError, match="trained on other samples .dataset fingerprint 00aa, the dataset's is 11bb"):
        checkpoint.check_compatible(dataclasses.replace(saved, dataset="00aa"), **{**job, "dataset": "11bb"})
    checkpoint.check_compatible(dataclasses.replace(saved, dataset=""), **{**job, "dataset": "11bb"})  # saved before fingerprints
    checkpoint.check_compatible(dataclasses.replace(saved, dataset="00aa"), **job)  # a caller that does not know the data's
    llama = make_workload(dataclasses.replace(CONFIG.model, kind="llama")).identity()
    with pytest.raises(CheckpointError, match="checkpoint is from another model.*kind: checkpoint None, config 'llama'"):
        checkpoint.check_compatible(saved, **{**job, "identity": llama})


def test_gpt_checkpoints_record_the_model_keys_and_the_order_of_the_stacked_rows(tmp_path):
    """Checkpoints from before the stacked projections ran head by head hold the same shapes with other
    meanings: they are refused, naming the difference, not loaded into the wrong rows."""
    assert set(IDENTITY) == {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "dropout", "bias", "stacked_rows"}
    old = {key: value for key, value in IDENTITY.items() if key != "stacked_rows"}
    info = checkpoint.CheckpointInfo(step=1, consumed_samples=4, model=old, tokenizer="bytes",
                                     seed=CONFIG.train.seed, global_batch_size=4)
    with pytest.raises(CheckpointError, match="stacked_rows: checkpoint None, config 'by head'"):
        checkpoint.check_compatible(info, identity=IDENTITY, seed=CONFIG.train.seed, tokenizer="bytes",
                                    global_batch_size=4, directory=tmp_path)


def test_llama_checkpoints_record_qkv_biases_only_when_the_model_has_them(tmp_path):
    """Llama checkpoints from before [model] qkv_bias, all without biases, still resume; one with them is
    refused by a model without, naming the key (not a missing tensor deep in DCP)."""
    plain = dataclasses.replace(CONFIG.model, kind="llama")
    identity = make_workload(plain).identity()
    biased = make_workload(dataclasses.replace(plain, qkv_bias=True)).identity()
    assert "qkv_bias" not in identity and biased == {**identity, "qkv_bias": True}
    info = checkpoint.CheckpointInfo(step=1, consumed_samples=4, model=biased, tokenizer="bytes",
                                     seed=CONFIG.train.seed, global_batch_size=4)
    with pytest.raises(CheckpointError, match="qkv_bias: checkpoint True, config None"):
        checkpoint.check_compatible(info, identity=identity, seed=CONFIG.train.seed, tokenizer="bytes",
                                    global_batch_size=4, directory=tmp_path)


def test_a_checkpoint_of_another_writer_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match="another DCP writer"):
        load_checkpoint({"x": torch.zeros(3)}, tmp_path / "plain")


def test_run_directory_lists_only_committed_steps(tmp_path):
    run = RunDirectory(tmp_path, "job")
    run.create(overwrite=False)
    save_checkpoint({"x": torch.ones(2)}, run.checkpoints.step(4), extra={"archipelago.json": b"{}"}).result()
    (run.path / "step_00000008").mkdir()  # a save that never committed
    assert run.committed_checkpoints() == [run.path / "step_00000004"]
    assert run.checkpoint_to_resume() == (run.path / "step_00000004", [])
    assert run.storage_path == str(tmp_path.resolve())


def test_a_new_run_refuses_old_steps_in_checkpoint_storage_on_another_disk(tmp_path):
    from core.errors import ConfigError

    storage = str(tmp_path / "other-disk")
    old = RunDirectory(tmp_path / "runs", "job", checkpoint_storage=storage)
    old.create(overwrite=False)
    save_checkpoint({"x": torch.ones(2)}, old.checkpoints.step(3), extra={"archipelago.json": b"{}"}).result()
    again = RunDirectory(tmp_path / "runs2", "job", checkpoint_storage=storage)
    with pytest.raises(ConfigError, match="already holds a run"):
        again.create(overwrite=False)
    again.create(overwrite=True)
    assert again.committed_checkpoints() == [] and again.path.is_dir()


@pytest.mark.parametrize("damage", [lambda p: p.write_bytes(p.read_bytes()[:ALIGN + 100]), lambda p: p.unlink()],
                         ids=["truncated", "missing"])
def test_a_damaged_data_file_is_a_checkpoint_error_that_says_how_to_resume(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    save_checkpoint({"w": torch.arange(10_000, dtype=torch.float32)}, store.step(2)).result()
    (data_file,) = store.step(2).local_path.glob("*.distcp")
    damage(data_file)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint({"w": torch.zeros(10_000)}, store.step(2))
    text = str(info.value)
    assert str(data_file) in text and "damaged" in text and "dataset" not in text
    assert "run again with --resume: it checks each committed step and resumes from the newest intact one" in text


def test_load_takes_the_info_its_caller_already_read(tmp_path):
    model, optimizer = trained(0)
    checkpoint.save(tmp_path / "ck", model, optimizer, info(2))
    read = checkpoint.read_info(tmp_path / "ck")
    (tmp_path / "ck" / checkpoint.INFO_FILE).unlink()  # a second read would fail now
    fresh, fresh_opt = trained(1)
    loaded, _ = checkpoint.load(tmp_path / "ck", fresh, fresh_opt, info=read)
    assert loaded is read and torch.equal(fresh.tok_emb.weight, model.tok_emb.weight)


def test_rewinding_metrics_keeps_the_committed_steps_and_leaves_no_temporary_file(tmp_path):
    run = RunDirectory(tmp_path, "job")
    run.create(overwrite=False)
    run.append_metrics([{"event": "start", "step": 0}] + [{"step": s, "loss": 1.0 / s} for s in (2, 4, 6, 8)])
    run.rewind_metrics(4)
    assert [json.loads(line)["step"] for line in run.metrics_path.read_text().splitlines()] == [0, 2, 4]
    assert sorted(p.name for p in run.path.iterdir()) == ["metrics.jsonl"]


def saved_steps(run: RunDirectory, *steps: int) -> None:
    model, optimizer = trained(0)
    for step in steps:
        checkpoint.save(run.checkpoints.step(step), model, optimizer, info(step)).result()


@pytest.mark.parametrize("damage, problem", [
    (lambda step: next(step.glob("*.distcp")).write_bytes(b"\0" * next(step.glob("*.distcp")).stat().st_size),
     "has {size} bytes with crc32"),  # the same size, other bytes: only the checksum tells
    (lambda step: (step / ".metadata").write_bytes(b"\x80\x04garbage" * 10), ".metadata is unreadable"),
    (lambda step: (step / "archipelago.json").write_text("{}"), "archipelago.json has 2 bytes"),
    (lambda step: next(step.glob("*.distcp")).unlink(), "is missing"),
    # Steps saved before checksums.json: held to the sizes .metadata gives their files.
    (lambda step: ((step / "checksums.json").unlink(), os.truncate(next(step.glob("*.distcp")), 4096)),
     "has 4096 bytes; its tensors end at byte"),
    (lambda step: ((step / "checksums.json").unlink(), next(step.glob("*.distcp")).unlink()), "is missing"),
], ids=["bytes-changed", "metadata-garbage", "info-replaced", "file-missing", "legacy-truncated", "legacy-missing"])
def test_resume_falls_back_past_a_damaged_newest_step_and_keeps_it(tmp_path, damage, problem):
    run = RunDirectory(tmp_path, "job")
    run.create(overwrite=False)
    saved_steps(run, 4, 8)
    newest = run.path / "step_00000008"
    size = next(newest.glob("*.distcp")).stat().st_size
    damage(newest)
    latest, damaged = run.checkpoint_to_resume()
    assert latest == run.path / "step_00000004"
    (step,) = damaged
    assert step.step == 8 and problem.format(size=size) in step.problem
    assert step.moved_to.local_path == run.path / "step_00000008.damaged" and step.moved_to.local_path.is_dir()
    assert run.committed_checkpoints() == [run.path / "step_00000004"]  # the workers load step 4
    model, optimizer = trained(1)
    assert checkpoint.load(latest, model, optimizer)[0].step == 4


def test_a_run_whose_every_step_is_damaged_says_so(tmp_path):
    run = RunDirectory(tmp_path, "job")
    run.create(overwrite=False)
    saved_steps(run, 4)
    (run.path / "step_00000004" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="every committed checkpoint is damaged; the newest, step 4: "
                                              ".metadata is unreadable"):
        run.checkpoint_to_resume()
    assert (run.path / "step_00000004.damaged").is_dir()


def test_every_file_of_a_committed_step_has_its_checksum(tmp_path):
    run = RunDirectory(tmp_path, "job")
    run.create(overwrite=False)
    saved_steps(run, 2)
    step = run.path / "step_00000002"
    sums = json.loads((step / "checksums.json").read_text())
    assert set(sums) == {p.name for p in step.iterdir()} - {".metadata", "checksums.json"}
    for name, written in sums.items():
        data = (step / name).read_bytes()
        assert written == {"bytes": len(data), "crc32": zlib.crc32(data)}


def test_a_checkpoint_of_another_shape_is_a_checkpoint_error_naming_the_tensor(tmp_path):
    """A factory's model changed in code (the [model] table, which the driver compares, did not): the load
    fails on the worker, where a CheckpointError stops the run instead of Ray retrying it."""
    model, optimizer = trained(0)
    checkpoint.save(tmp_path / "ck", model, optimizer, info(1))
    wider = dataclasses.replace(CONFIG, model=dataclasses.replace(CONFIG.model, n_embd=48))
    other, other_optimizer = trained(0, wider)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(tmp_path / "ck", other, other_optimizer)
    assert refused.value.where == str(tmp_path / "ck")
    assert "do not fit this model or its optimizer: Size mismatch between saved torch.Size([257, 32])" in refused.value.what
    assert "--overwrite" in refused.value.fix
    deeper = dataclasses.replace(CONFIG, model=dataclasses.replace(CONFIG.model, n_layer=2))
    with pytest.raises(CheckpointError, match="do not fit this model or its optimizer: Missing key in checkpoint state_dict"):
        checkpoint.load(tmp_path / "ck", *trained(0, deeper))


@pytest.mark.parametrize("state", [{"batch": 4}, {"batch": 4, "estimator": {"no_such_field": 1}, "changes": 0}])
def test_an_adaptive_batch_state_the_resume_cannot_read_is_a_checkpoint_error_when_read(tmp_path, state):
    model, optimizer = trained(0)
    adaptive = checkpoint.CheckpointInfo.for_spec(job_spec(CONFIG), 1, 4, world_size=1,
                                                  adaptive_batch=AdaptiveBatch(4).to_dict())
    checkpoint.save(tmp_path / "ck", model, optimizer, adaptive)
    assert checkpoint.read_info(tmp_path / "ck").adaptive_batch == AdaptiveBatch(4).to_dict()
    path = tmp_path / "ck" / checkpoint.INFO_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "adaptive_batch": state}))
    with pytest.raises(CheckpointError, match="archipelago.json is unreadable") as refused:
        checkpoint.read_info(tmp_path / "ck")
    assert refused.value.where == str(tmp_path / "ck")
