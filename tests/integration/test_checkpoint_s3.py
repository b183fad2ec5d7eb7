"""Checkpoints and datasets in S3: a moto S3 server on loopback, started by this module, reached through pyarrow.fs."""

import logging

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from core.errors import CheckpointError, ConfigError, DataError
from orchestrator.run_dir import RunDirectory
from storage.checkpoint_io import DCP_METADATA, CheckpointStore, save_checkpoint
from storage.fs import Location
from storage.loader import BatchLoader
from storage.readers import choose_reader
from storage.shards import MANIFEST, TokenDataset, check_files, has_dataset
from storage.verify import verify_dataset
from tests.checkpoint_support import CONFIG, trained
from tests.engine_support import free_port, job_spec
from workers import checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            env.setenv(key, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        server.start()
        host, port = server.get_host_and_port()
        root = Location.parse(f"s3://archipelago-test?endpoint_override={host}:{port}&scheme=http"
                              "&allow_bucket_creation=true&region=us-east-1")
        root.fs.create_dir("archipelago-test")
        try:
            yield root
        finally:
            server.stop()


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
