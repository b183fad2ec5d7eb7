"""Checkpoints and datasets in S3: conftest.py's moto S3 server on loopback, reached through pyarrow.fs;
it can answer chosen uploads with errors, as an object store failing mid-upload does."""


import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from core.errors import CheckpointError, ConfigError, DataError
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import DCP_METADATA, CheckpointStore, load_checkpoint, save_checkpoint
from storage.fs import Location
from storage.loader import BatchLoader
from storage.readers import choose_reader
from storage.shards import MANIFEST, TokenDataset, check_files, has_dataset
from storage.verify import verify_dataset
from tests.checkpoint_support import CONFIG, trained
from tests.engine_support import free_port, job_spec
from workers import checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture
def s3(s3_server):
    return s3_server[0]


@pytest.fixture
def faults(s3_server):
    """The server's fault injection, off again after the test."""
    yield s3_server[1]
    s3_server[1].fail("", 0)


def test_locations_print_and_parse_back(s3):
    child = s3 / "runs" / "x"
    again = Location.parse(str(child))
    assert again.path == "archipelago-test/runs/x" and "endpoint_override=" in str(again)
    assert isinstance(again.fs, pafs.S3FileSystem)


def test_run_checkpoints_in_s3_save_async_prune_and_restore(s3):
    runs = checkpoint.RunCheckpoints(s3 / "runs" / "job", job_spec(CONFIG), rank=0)
    model, optimizer = trained(0)
    committed = []
    for step in (1, 2, 3):
        committed += runs.save(model, optimizer, checkpoint.CheckpointInfo.for_spec(job_spec(CONFIG), step, 4 * step))
    committed += runs.wait()
    assert committed == [1, 2, 3] and [s for s, _ in runs.store.committed()] == [2, 3]
    # a save that died before its commit: data uploaded, no .metadata
    save_checkpoint({"x": torch.ones(3)}, runs.store.step(4)).result()
    (runs.store.step(4) / DCP_METADATA).remove()
    fresh, fresh_opt = trained(1)
    info, readers = runs.restore(fresh, fresh_opt)
    assert info.step == 3 and readers == {"remote"} and not runs.store.step(4).exists()
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_run_directory_with_checkpoints_in_s3(s3, tmp_path):
    storage = str(s3 / "elsewhere")
    run = RunDirectory(tmp_path / "runs", "job", checkpoint_storage=storage)
    assert run.storage_path == storage and run.checkpoints.root.path == "archipelago-test/elsewhere/job"
    run.create(overwrite=False)
    save_checkpoint({"x": torch.ones(2)}, run.checkpoints.step(7), extra={"archipelago.json": b"{}"}).result()
    assert [str(p) for p in run.committed_checkpoints()] == [str(run.checkpoints.step(7))]
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDirectory(tmp_path / "runs2", "job", checkpoint_storage=storage).create(overwrite=False)
    RunDirectory(tmp_path / "runs2", "job", checkpoint_storage=storage).create(overwrite=True)
    assert run.committed_checkpoints() == []


def test_a_dataset_in_s3_reads_the_same_bytes_as_on_disk(s3, dataset_dir):
    remote = s3 / "datasets" / "email"
    pafs.copy_files(str(dataset_dir), remote.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3.fs)
    local, there = TokenDataset(dataset_dir, "train", 40), TokenDataset(remote, "train", 40)
    check_files(remote, there.shards)
    assert verify_dataset(remote).ok
    ids = np.random.default_rng(4).choice(local.num_samples, size=50, replace=False)
    choice = choose_reader("auto", remote, torch.device("cpu"))
    assert choice.reader.kind == "remote"
    with BatchLoader(there, choice, torch.device("cpu")) as loader:
        got = loader.load([ids])
    assert np.array_equal(got[0].numpy(), local.batch(ids))



def test_unreachable_storage_is_a_typed_error_that_names_the_location():
    port = free_port()  # nothing listens there: the endpoint refuses every connection
    # Built by hand for one attempt per request, so the test does not wait through the SDK's retries.
    fs = pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                           endpoint_override=f"127.0.0.1:{port}",
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    root = Location(fs, "archipelago-test/elsewhere", "s3", f"endpoint_override=127.0.0.1:{port}&scheme=http")
    with pytest.raises(DataError, match="cannot reach storage") as info:
        has_dataset(root / "dataset")
    assert info.value.where == str(root / "dataset" / MANIFEST)
    assert info.value.fix == "check the endpoint, network and credentials"
    with pytest.raises(CheckpointError, match="cannot reach storage") as info:
        CheckpointStore(root / "job").latest()
    assert info.value.where == str(root / "job")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_upload_that_fails_twice_is_retried_and_commits(s3, faults, async_save):
    store = CheckpointStore(s3 / "flaky" / ("async" if async_save else "sync"))
    faults.fail("__0_0.distcp", 2)
    save_checkpoint({"w": torch.arange(5000.0)}, store.step(1), async_save=async_save).result()
    assert len(faults.refused) == 2 and faults.count == 0  # refused twice, then accepted
    target = {"w": torch.zeros(5000)}
    load_checkpoint(target, store.latest())
    assert store.latest() == store.step(1) and torch.equal(target["w"], torch.arange(5000.0))


@pytest.mark.parametrize("name, async_save", [("__0_0.distcp", False), (DCP_METADATA, True)],
                         ids=["data-sync", "metadata-async"])
def test_an_upload_that_keeps_failing_is_a_checkpoint_error_and_commits_nothing(s3, faults, name, async_save):
    """A data file or `.metadata` itself refused on every attempt: a CheckpointError naming the file
    once the client's retries are spent; the step has no `.metadata` (a failed upload is never
    visible) and the previous step is still the latest, whole."""
    store = CheckpointStore(s3 / "down" / ("async" if async_save else "sync") / name.strip("_."))
    save_checkpoint({"w": torch.ones(5000)}, store.step(1)).result()
    faults.fail(name, 1000)
    with pytest.raises(CheckpointError, match=r"the upload failed after the object store's retries") as info:
        save_checkpoint({"w": torch.full((5000,), 2.0)}, store.step(2), async_save=async_save).result()
    assert info.value.where == str(store.step(2) / name) and "--resume" in info.value.fix
    assert 1 < len(faults.refused) < 1000  # retried, then given up
    faults.fail("", 0)
    assert not (store.step(2) / DCP_METADATA).exists() and store.latest() == store.step(1)
    target = {"w": torch.zeros(5000)}
    load_checkpoint(target, store.latest())
    assert torch.equal(target["w"], torch.ones(5000))
