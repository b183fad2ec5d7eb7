"""Readers into GPU memory: kvikio, POSIX (pinned + copy) and pyarrow.fs agree byte for byte; checkpoints load
straight into CUDA tensors.

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_reader_gpu.py -p no:cacheprovider
"""

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from core.config import JobConfig
from core.plan import BatchLayout
from storage.fs import Location
from storage.loader import BatchLoader
from storage.readers import KvikioReader, PosixReader, RemoteReader, choose_reader, kvikio_unavailable
from storage.sampler import DeterministicSampler
from storage.shards import TokenDataset
from tests.checkpoint_support import trained
from tests.engine_support import job_spec
from workers import checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)


def needs_kvikio():
    reason = kvikio_unavailable()
    if reason is not None:
        pytest.skip(f"kvikio cannot run here: {reason}")


def readers(dataset_dir):
    remote = Location(pafs.SubTreeFileSystem(str(dataset_dir), pafs.LocalFileSystem()), "", "subtree")
    out = [("posix", TokenDataset(dataset_dir, "train", 64), PosixReader(4)),
           ("remote", TokenDataset(remote, "train", 64), RemoteReader(remote, 4))]
    if kvikio_unavailable() is None:
        out.append(("kvikio", TokenDataset(dataset_dir, "train", 64), KvikioReader(4)))
    return out


def test_auto_picks_kvikio_on_a_gpu_when_it_can_read(dataset_dir):
    needs_kvikio()
    location = Location.parse(dataset_dir)
    bulk = choose_reader("auto", location, CUDA)
    assert bulk.reader.kind == "kvikio" and bulk.reason == f"kvikio ({KvikioReader.mode()})"
    samples = choose_reader("auto", location, CUDA, small_reads=True)
    assert samples.reader.kind == ("kvikio" if KvikioReader.mode() == "gds" else "posix"), samples.reason
    assert choose_reader("kvikio", location, CUDA, small_reads=True).reader.kind == "kvikio"


def test_every_reader_lands_the_same_bytes_on_the_gpu(dataset_dir):
    cpu = TokenDataset(dataset_dir, "train", 64)
    ids = np.random.default_rng(0).choice(cpu.num_samples, size=96, replace=False)
    expected = torch.from_numpy(cpu.batch(ids))
    kinds = []
    for kind, dataset, reader in readers(dataset_dir):
        with BatchLoader(dataset, reader, CUDA, depth=2) as loader:
            got = loader.load([ids[:32], ids[32:]])
        assert all(b.device.type == "cuda" and b.dtype == torch.int64 for b in got)
        assert torch.equal(torch.cat(got).cpu(), expected), kind
        kinds.append(kind)
    assert "kvikio" in kinds or kvikio_unavailable() is not None


def test_double_buffered_stream_never_hands_out_stale_bytes(dataset_dir):
    cpu = TokenDataset(dataset_dir, "train", 64)
    sampler = DeterministicSampler(cpu.num_samples, seed=9)
    layout = BatchLayout((16, 8), (2, 3))
    for kind, dataset, reader in readers(dataset_dir):
        with BatchLoader(dataset, reader, CUDA, depth=2) as loader:
            stream = loader.stream(sampler.steps(0, layout, rank=1))
            for step in range(12):
                got = next(stream)
                # keep the GPU busy so reads for the next steps overlap with compute on this one
                torch.cuda._sleep(2_000_000)
                expected = sampler.rank_micro_batches(step * layout.global_batch, layout, 1)
                for batch, ids in zip(got, expected):
                    assert torch.equal(batch.cpu(), torch.from_numpy(cpu.batch(ids))), (kind, step)


def test_checkpoint_loads_straight_into_gpu_tensors(tmp_path):
    config = JobConfig.from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "seq_len": 64},
                                  "cluster": {"num_workers": 1, "use_gpu": True}})
    model, optimizer = trained(0, config, CUDA, batch_size=4)
    info = checkpoint.CheckpointInfo.for_spec(job_spec(config), 1, 4, world_size=1)
    checkpoint.save(tmp_path / "step_00000001", model, optimizer, info)
    expected_kinds = [("auto", "kvikio" if kvikio_unavailable() is None else "posix"), ("posix", "posix")]
    for kind, used_kind in expected_kinds:
        fresh, fresh_opt = trained(1, config, CUDA, batch_size=4)
        loaded, used = checkpoint.load(tmp_path / "step_00000001", fresh, fresh_opt, reader=kind)
        assert loaded == info and used_kind in used, (kind, used)
        for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert b.device.type == "cuda" and torch.equal(a, b), (kind, name)
        for a, b in zip(optimizer.state.values(), fresh_opt.state.values()):
            assert all(torch.equal(a[k], b[k]) for k in a), kind
