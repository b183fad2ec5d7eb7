"""Readers and the loader on CPU: POSIX and pyarrow.fs reads agree byte for byte; the choice is automatic and said."""

import shutil

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from core.errors import CheckpointError, DataError
from core.plan import BatchLayout
from storage.fs import Location
from storage.loader import BatchLoader
from storage.readers import (
    MIN_TASK_BYTES,
    TASK_BYTES,
    Extent,
    PosixReader,
    RemoteReader,
    choose_reader,
    kvikio_unavailable,
    plan_tasks,
)
from storage.sampler import DeterministicSampler
from storage.shards import TokenDataset

CPU = torch.device("cpu")


@pytest.fixture()
def big_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=3 * TASK_BYTES + 12345, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    return path, data


def extents_for(path, data, rng):
    """Random ranges, some large (split across threads), some tiny, in a shuffled buffer layout."""
    sizes = [TASK_BYTES + 77, 1, 4096, 333, 2 * TASK_BYTES // 3]
    out, dest = [], 0
    for n in sizes:
        offset = int(rng.integers(0, data.size - n))
        out.append(Extent(str(path), offset, n, dest))
        dest += n
    return out, dest


@pytest.mark.parametrize("make", [lambda loc: PosixReader(4), lambda loc: RemoteReader(loc, 4)],
                         ids=["posix", "remote"])
def test_reads_land_byte_for_byte(big_file, make):
    path, data = big_file
    extents, total = extents_for(path, data, np.random.default_rng(1))
    reader = make(Location.parse(path.parent))
    buffer = np.zeros(total, dtype=np.uint8)
    reader.read(extents, buffer).wait()
    expected = np.concatenate([data[e.file_offset:e.file_offset + e.nbytes] for e in extents])
    assert np.array_equal(buffer, expected)
    reader.close()


def test_tasks_split_large_extents_and_pack_small_ones():
    extents = [Extent("f", 0, 3 * TASK_BYTES, 0)] + [Extent("g", i * 10, 10, 3 * TASK_BYTES + i * 10) for i in range(100)]
    tasks = plan_tasks(extents, threads=8)
    pieces = [p for t in tasks for p in t]
    assert sum(p.nbytes for p in pieces) == 3 * TASK_BYTES + 1000
    assert max(p.nbytes for p in pieces) == TASK_BYTES and len(tasks) <= 8
    assert len(plan_tasks([Extent("g", i, 10, i) for i in range(64)], threads=8)) == 1  # 640 B < MIN_TASK_BYTES
    assert MIN_TASK_BYTES > 640


def test_a_short_read_names_the_file_and_offset(big_file):
    path, data = big_file
    for reader in (PosixReader(2), RemoteReader(Location.parse(path.parent), 2)):
        with pytest.raises(DataError) as info:
            reader.read([Extent(str(path), data.size - 10, 100, 0)], np.zeros(100, np.uint8)).wait()
        assert f"{path}, offset {data.size - 10}" in str(info.value) and "short read" in str(info.value)


def test_the_choice_is_automatic_and_reported(dataset_dir):
    local = Location.parse(dataset_dir)
    choice = choose_reader("auto", local, CPU)
    assert choice.reader.kind == "posix" and choice.reason == "posix (kvikio: the workers have no GPU)"
    remote = Location(pafs.SubTreeFileSystem(str(dataset_dir), pafs.LocalFileSystem()), "", "subtree")
    assert choose_reader("auto", remote, CPU).reader.kind == "remote"
    with pytest.raises(DataError, match="kvikio reader cannot run: the workers have no GPU"):
        choose_reader("kvikio", local, CPU)
    with pytest.raises(DataError, match='set \\[data\\] reader = "remote"'):
        choose_reader("posix", remote, CPU)


def test_a_checkpoint_reader_choice_names_the_checkpoint_setting(dataset_dir):
    local = Location.parse(dataset_dir)
    remote = Location(pafs.SubTreeFileSystem(str(dataset_dir), pafs.LocalFileSystem()), "", "subtree")
    where = {"setting": "[checkpoint] reader", "error": CheckpointError}
    with pytest.raises(CheckpointError, match='set \\[checkpoint\\] reader = "remote"'):
        choose_reader("posix", remote, CPU, **where)
    with pytest.raises(CheckpointError, match='\\[checkpoint\\] reader: the kvikio reader cannot run'):
        choose_reader("kvikio", local, CPU, **where)


def test_kvikio_is_not_used_where_it_cannot_read():
    # On this CPU machine kvikio is absent, or importable without libcuda: either way a reason, never a crash.
    reason = kvikio_unavailable()
    if torch.cuda.is_available() and reason is None:
        pytest.skip("kvikio works here")
    assert isinstance(reason, str) and reason


def test_dataset_reads_agree_across_readers(dataset_dir):
    data = TokenDataset(dataset_dir, "train", seq_len=50)
    remote_fs = pafs.SubTreeFileSystem(str(dataset_dir), pafs.LocalFileSystem())
    remote = TokenDataset(Location(remote_fs, "", "subtree"), "train", seq_len=50)
    ids = np.random.default_rng(3).choice(data.num_samples, size=40, replace=False)
    expected = data.batch(ids)
    assert np.array_equal(remote.batch(ids), expected)
    for dataset, reader in ((data, PosixReader(3)), (remote, RemoteReader(remote.location, 3))):
        with BatchLoader(dataset, reader, CPU, depth=2) as loader:
            got = loader.load([ids[:16], ids[16:]])
        assert [b.shape for b in got] == [(16, 51), (24, 51)] and got[0].dtype == torch.int64
        assert np.array_equal(torch.cat(got).numpy(), expected)


def test_stream_prefetches_steps_in_sampler_order(dataset_dir):
    data = TokenDataset(dataset_dir, "train", seq_len=32)
    sampler = DeterministicSampler(data.num_samples, seed=5)
    layout = BatchLayout((3, 2), (2, 1))
    with BatchLoader(data, PosixReader(2), CPU, depth=3) as loader:
        stream = loader.stream(sampler.steps(40, layout, rank=0))
        for step in range(5):
            expected = sampler.rank_micro_batches(40 + step * layout.global_batch, layout, 0)
            got = next(stream)
            assert [len(b) for b in got] == [3, 3]
            for batch, ids in zip(got, expected):
                assert np.array_equal(batch.numpy(), data.batch(ids))


def test_a_shard_damaged_while_training_is_a_data_error_from_next(dataset_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    data = TokenDataset(copy, "train", seq_len=32)
    last = data.shards[-1]
    with open(copy / last.path, "r+b") as f:
        f.truncate(4096 + 100)
    ids = np.array([data.num_samples - 1])
    with BatchLoader(data, PosixReader(1), CPU) as loader:
        with pytest.raises(DataError) as info:
            loader.load([ids])
    assert str(copy / last.path) in str(info.value) and "the manifest says" in str(info.value)


def test_samples_can_span_several_small_shards(tmp_path):
    from storage.prepare import prepare_dataset

    (tmp_path / "src").mkdir()
    for i in range(8):
        (tmp_path / "src" / f"{i}.py").write_text(f"value_{i} = {i}\n" * 40)
    prepare_dataset(str(tmp_path / "src"), tmp_path / "tiny-shards", val_percent=25.0, shard_tokens=40, workers=1)
    data = TokenDataset(tmp_path / "tiny-shards", "train", seq_len=100)
    extents = data.extents(np.array([3]))
    assert len(extents) >= 3  # 101 tokens over shards of 40
    assert np.array_equal(data.batch(np.array([3]))[0], data.tokens(300, 101))
