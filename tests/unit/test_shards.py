import zlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from core.errors import DataError
from storage.prepare import prepare_dataset, split_of
from storage.shards import HEADER_BYTES, MANIFEST, TokenDataset, read_manifest
from storage.tokenizers import ByteTokenizer


def make_corpus(root, files):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_tokens_round_trip_to_the_source_text(corpus_dir, dataset_dir):
    manifest = read_manifest(dataset_dir)
    assert manifest.vocab_size == 257
    train = TokenDataset(dataset_dir, "train", seq_len=64)
    expected = [p for p in sorted(corpus_dir.rglob("*.py")) if split_of(p.relative_to(corpus_dir).as_posix(), 25.0) == "train"]
    first = expected[0].read_bytes()
    tokens = train.tokens(0, len(first) + 1)
    assert bytes(tokens[:-1].astype(np.uint8)) == first
    assert tokens[-1] == ByteTokenizer().eos_id
    assert train.num_tokens == sum(len(p.read_bytes()) + 1 for p in expected)


def test_shards_are_aligned_and_checksummed(dataset_dir):
    for shard in read_manifest(dataset_dir).shards:
        raw = (dataset_dir / shard.path).read_bytes()
        assert raw[:8] == b"ARCHTOK1"
        assert len(raw) == HEADER_BYTES + 2 * shard.num_tokens  # uint16 payload from the 4 KiB boundary
        assert zlib.crc32(raw[HEADER_BYTES:]) == shard.crc32
        assert shard.doc_offsets == sorted(shard.doc_offsets)


def test_samples_cross_shard_boundaries(dataset_dir):
    train = TokenDataset(dataset_dir, "train", seq_len=100)
    assert len(train.shards) > 1
    boundary = train.shards[0].num_tokens
    sample = boundary // 100  # the sample that straddles the first boundary
    batch = train.batch(np.array([sample]))
    assert batch.shape == (1, 101)
    assert np.array_equal(batch[0], train.tokens(sample * 100, 101))


def test_split_is_a_stable_function_of_the_path():
    assert split_of("a/b.py", 5.0) == split_of("a/b.py", 5.0)
    shares = [split_of(f"f{i}.py", 10.0) for i in range(5000)]
    assert 0.08 < shares.count("val") / 5000 < 0.12


def test_empty_corpus_directory_is_a_data_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as info:
        prepare_dataset(str(tmp_path / "empty"), tmp_path / "out")
    assert "no files matching '*.py'" in str(info.value) and str(tmp_path / "empty") in str(info.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_missing_source_directory(tmp_path):
    with pytest.raises(DataError, match="source directory does not exist"):
        prepare_dataset(str(tmp_path / "nowhere"), tmp_path / "out")


def test_never_deletes_a_directory_it_did_not_write(tmp_path):
    src = make_corpus(tmp_path / "src", {f"{i}.py": "x = 1\n" * 50 for i in range(40)})
    keep = make_corpus(tmp_path / "precious", {"notes.txt": "mine"})
    with pytest.raises(DataError, match="holds no prepared dataset"):
        prepare_dataset(str(src), keep, overwrite=True, val_percent=30)
    assert (keep / "notes.txt").read_text() == "mine"


def test_existing_dataset_needs_overwrite(tmp_path):
    src = make_corpus(tmp_path / "src", {f"{i}.py": "y = 2\n" * 50 for i in range(40)})
    prepare_dataset(str(src), tmp_path / "out", val_percent=30)
    with pytest.raises(DataError, match="already here"):
        prepare_dataset(str(src), tmp_path / "out", val_percent=30)
    assert prepare_dataset(str(src), tmp_path / "out", val_percent=30, overwrite=True, workers=1).shards == 2


def test_truncated_shard_names_file_and_offset(dataset_dir, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    shard = read_manifest(copy).shards[0]
    path = copy / shard.path
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError) as info:
        TokenDataset(copy, "train", 32).tokens(0, 10)
    assert str(path) in str(info.value) and "truncated" in str(info.value)


def test_missing_manifest(tmp_path):
    with pytest.raises(DataError) as info:
        TokenDataset(tmp_path, "train", 32)
    assert "manifest.parquet is missing" in str(info.value) and "archipelago prepare" in str(info.value)


def test_manifest_is_plain_parquet(dataset_dir):
    table = pq.read_table(dataset_dir / MANIFEST)
    assert set(table.column("split").to_pylist()) == {"train", "val"}
    assert table.schema.metadata[b"format_version"] == b"1"


def test_uint32_tokens_round_trip(tmp_path):
    from storage.shards import write_manifest, write_shard

    tokens = np.random.default_rng(0).integers(0, 100_000, size=5000, dtype=np.uint32)
    shards = [write_shard(tmp_path, "train", 0, tokens, [0], "big-vocab"),
              write_shard(tmp_path, "val", 0, tokens[:500], [0], "big-vocab")]
    write_manifest(tmp_path, shards, 100_000)
    data = TokenDataset(tmp_path, "train", seq_len=99)
    assert data.dtype.itemsize == 4 and np.array_equal(data.batch(np.array([7]))[0], tokens[693:793])


def test_the_train_fingerprint_follows_the_samples_not_the_place(dataset_dir, corpus_dir, tmp_path):
    import shutil

    shutil.copytree(dataset_dir, tmp_path / "copy")
    fingerprint = read_manifest(dataset_dir).train_fingerprint
    assert len(fingerprint) == 16 and read_manifest(tmp_path / "copy").train_fingerprint == fingerprint
    corpus = shutil.copytree(corpus_dir, tmp_path / "corpus")  # the session's corpus stays as the dataset has it
    changed = next(p for p in sorted(corpus.rglob("*.py")) if split_of(p.relative_to(corpus).as_posix(), 25.0) == "train")
    changed.write_text(changed.read_text() + "\n# one more line\n")
    prepare_dataset(str(corpus), tmp_path / "again", val_percent=25.0, shard_tokens=64 * 1024, workers=1)
    assert read_manifest(tmp_path / "again").train_fingerprint != fingerprint


def test_a_manifest_of_another_version_is_refused(dataset_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    table = pq.read_table(copy / MANIFEST)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"format_version": b"2"}), copy / MANIFEST)
    with pytest.raises(DataError, match="manifest format version 2, this archipelago reads version 1"):
        TokenDataset(copy, "train", 32)


@pytest.mark.parametrize("key, value, problem", [
    (b"vocab_size", None, "manifest metadata vocab_size is missing"),
    (b"vocab_size", b"lots", "manifest metadata vocab_size is 'lots', not a whole number"),
    (b"format_version", b"one", "manifest metadata format_version is 'one', not a whole number"),
])
def test_a_manifest_whose_metadata_is_missing_or_garbled_is_a_data_error(dataset_dir, tmp_path, key, value, problem):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    table = pq.read_table(copy / MANIFEST)
    meta = {k: v for k, v in table.schema.metadata.items() if k != key} | ({key: value} if value is not None else {})
    pq.write_table(table.replace_schema_metadata(meta), copy / MANIFEST)
    with pytest.raises(DataError) as refused:
        read_manifest(copy)
    assert refused.value.what == problem and refused.value.where.endswith(MANIFEST)
    assert "prepare" in refused.value.fix


def test_check_files_catches_missing_and_resized_shards_with_one_listing(dataset_dir, tmp_path):
    import shutil

    from storage.fs import Location
    from storage.shards import check_files

    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    shards = read_manifest(copy).shards
    check_files(Location.parse(copy), shards)
    (copy / shards[0].path).unlink()
    with pytest.raises(DataError, match="missing"):
        check_files(Location.parse(copy), shards)
    with open(copy / shards[1].path, "ab") as f:
        f.write(b"extra")
    with pytest.raises(DataError, match=f"{shards[1].path}, offset {shards[1].file_bytes}"):
        check_files(Location.parse(copy), shards[1:])


def test_datasets_and_verify_take_a_manifest_read_once(dataset_dir, tmp_path):
    import shutil

    from storage.verify import verify_dataset

    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    manifest = read_manifest(copy)
    (copy / MANIFEST).unlink()  # anything that read the manifest again would fail now
    train = TokenDataset(copy, "train", 32, manifest=manifest)
    val = TokenDataset(copy, "val", 32, manifest=train.manifest)
    assert train.manifest is val.manifest is manifest and val.num_samples > 0
    assert train.batch(np.array([0, 5])).shape == (2, 33)
    assert verify_dataset(copy, manifest=manifest).ok


def damaged_copy(dataset_dir, tmp_path, damage):
    """A copy of the dataset whose first train shard went through `damage(bytes) -> bytes` (the same size)."""
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    path = copy / read_manifest(copy).split("train")[0].path
    path.write_bytes(damage(path.read_bytes()))
    return copy, path


def test_a_shard_header_of_garbage_is_a_data_error_in_training_and_a_bad_shard_in_verify(dataset_dir, tmp_path,
                                                                                        capsys):
    from orchestrator.cli import main

    copy, path = damaged_copy(dataset_dir, tmp_path, lambda b: b[:8] + b"\xff\xfe" * 100 + b[208:])
    with pytest.raises(DataError) as info:
        TokenDataset(copy, "train", 32).batch(np.arange(4))
    assert str(info.value).startswith(f"{path}, offset 8: shard header is not a JSON object")
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"bad shard: {path}: shard header is not a JSON object" in out.replace("\n", "") and "Traceback" not in out


def test_a_shard_whose_bytes_changed_is_named_at_its_first_read(dataset_dir, tmp_path):
    every_a = lambda b: b[:HEADER_BYTES] + b"a\0" * ((len(b) - HEADER_BYTES) // 2)  # noqa: E731 - token 97 throughout
    copy, path = damaged_copy(dataset_dir, tmp_path, every_a)
    TokenDataset(copy, "train", 32, checksum_percent=0).batch(np.arange(4))  # in the vocabulary: unseen unchecked
    with pytest.raises(DataError) as info:
        TokenDataset(copy, "train", 32, checksum_percent=100).batch(np.arange(4))
    assert str(info.value).startswith(f"{path}: crc32 mismatch") and f"archipelago verify {copy}" in str(info.value)


def test_a_token_outside_the_vocabulary_is_named_by_shard_and_offset_whatever_the_checksum_share(dataset_dir,
                                                                                                 tmp_path):
    import torch

    from storage.loader import BatchLoader
    from storage.readers import choose_reader

    bad_at = HEADER_BYTES + 2 * 40  # the 41st token of the shard: inside sample 1 (tokens 32–64)
    copy, path = damaged_copy(dataset_dir, tmp_path, lambda b: b[:bad_at] + b"\xff\xff" + b[bad_at + 2:])
    data = TokenDataset(copy, "train", 32, checksum_percent=0)
    with BatchLoader(data, choose_reader("posix", data.location, torch.device("cpu")), torch.device("cpu")) as loader:
        assert loader.load([np.array([0])])[0].shape == (1, 33)  # sample 0 is whole
        with pytest.raises(DataError) as info:
            loader.load([np.array([0, 1])])
    assert str(info.value).startswith(f"{path}, offset {bad_at}: token id 65535 ≥ vocabulary size 257")
