"""prepare: text, JSONL, Parquet and Arrow sources, a BPE tokenizer, parallel workers, and `archipelago verify`."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from core.errors import DataError
from orchestrator.cli import main
from storage.prepare import prepare_dataset, split_of
from storage.shards import HEADER_BYTES, TokenDataset, read_manifest
from storage.tokenizers import DATASET_COPY, load_tokenizer
from storage.verify import verify_dataset

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 7 + 1) for i in range(120)]


def all_tokens(directory, split):
    data = TokenDataset(directory, split, seq_len=8)
    return data.tokens(0, data.num_tokens)


def decoded_documents(directory, split, tokenizer):
    tokens = all_tokens(directory, split)
    ends = np.flatnonzero(tokens == tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(tokens[a:b]) for a, b in zip(starts, ends)]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCS, trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_jsonl_source_splits_by_line_and_keeps_every_document(tmp_path, monkeypatch):
    import storage.prepare

    monkeypatch.setattr(storage.prepare, "JSONL_UNIT_BYTES", 1000)  # many units, lines cut at unit edges
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        for text in DOCS:
            f.write(json.dumps({"id": 1, "text": text}) + "\n")
    summary = prepare_dataset(str(src), tmp_path / "out", source_format="jsonl", val_percent=20, workers=1)
    assert summary.documents["train"] + summary.documents["val"] == len(DOCS)
    byte_tok = load_tokenizer("bytes")
    got = decoded_documents(tmp_path / "out", "train", byte_tok) + decoded_documents(tmp_path / "out", "val", byte_tok)
    assert sorted(got) == sorted(DOCS)


def test_parquet_and_arrow_sources_read_the_named_column(tmp_path):
    table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "part-0.parquet", row_group_size=25)
    (tmp_path / "ipc").mkdir()
    with ipc.new_file(tmp_path / "ipc" / "part-0.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=30):
            writer.write_batch(batch)
    a = prepare_dataset(str(tmp_path / "pq"), tmp_path / "a", source_format="parquet", text_column="body",
                        val_percent=20, workers=1)
    b = prepare_dataset(str(tmp_path / "ipc"), tmp_path / "b", source_format="arrow", text_column="body",
                        val_percent=20, workers=1)
    assert sum(a.tokens.values()) == sum(b.tokens.values()) and sum(a.documents.values()) == len(DOCS)
    byte_tok = load_tokenizer("bytes")
    for out in (tmp_path / "a", tmp_path / "b"):
        got = decoded_documents(out, "train", byte_tok) + decoded_documents(out, "val", byte_tok)
        assert sorted(got) == sorted(DOCS)
    with pytest.raises(DataError, match="no column 'text' \\(columns: id, body\\)"):
        prepare_dataset(str(tmp_path / "pq"), tmp_path / "c", source_format="parquet", workers=1)


def test_bad_jsonl_line_names_file_and_byte_offset(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.jsonl").write_text('{"text": "fine"}\n{not json}\n')
    with pytest.raises(DataError) as info:
        prepare_dataset(str(tmp_path / "src"), tmp_path / "out", source_format="jsonl", workers=1)
    assert f"{tmp_path / 'src' / 'x.jsonl'}, byte 17" in str(info.value)
    assert not (tmp_path / "out.partial").exists()


def test_bpe_tokenizer_from_a_tokenizers_file(tmp_path, bpe_file, corpus_dir):
    summary = prepare_dataset(str(corpus_dir), tmp_path / "bpe", tokenizer=f"hf:{bpe_file}", val_percent=25, workers=1)
    tokenizer = load_tokenizer(f"hf:{bpe_file}")
    assert summary.tokenizer == tokenizer.name and tokenizer.name.startswith("hf-json:")
    manifest = read_manifest(tmp_path / "bpe")
    assert manifest.vocab_size == tokenizer.vocab_size and {s.tokenizer for s in manifest.shards} == {tokenizer.name}
    assert (tmp_path / "bpe" / DATASET_COPY).read_bytes() == bpe_file.read_bytes()  # what made the tokens
    train_files = sorted(p for p in corpus_dir.rglob("*.py") if split_of(p.relative_to(corpus_dir).as_posix(), 25) == "train")
    first = decoded_documents(tmp_path / "bpe", "train", tokenizer)[0]
    assert first == train_files[0].read_text()
    bytes_tokens = sum(len(p.read_bytes()) + 1 for p in train_files)
    assert summary.tokens["train"] < bytes_tokens  # BPE merges bytes


def test_tokenizer_identity_is_the_file_content(tmp_path, bpe_file):
    copy = tmp_path / "elsewhere.json"
    shutil.copy(bpe_file, copy)
    assert load_tokenizer(f"hf:{copy}").name == load_tokenizer(f"hf:{bpe_file}").name
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(f"hf:{tmp_path / 'missing.json'}")


def test_parallel_workers_write_the_same_bytes_as_one(tmp_path, corpus_dir):
    seen = []
    one = prepare_dataset(str(corpus_dir), tmp_path / "one", val_percent=25, shard_tokens=50_000, workers=1)
    two = prepare_dataset(str(corpus_dir), tmp_path / "two", val_percent=25, shard_tokens=50_000, workers=2,
                          on_progress=lambda done, total, tokens: seen.append((done, total, tokens)))
    assert two.workers == 2 and one.shards == two.shards > 2
    for a, b in zip(sorted((tmp_path / "one").glob("*.tokens")), sorted((tmp_path / "two").glob("*.tokens"))):
        assert a.read_bytes() == b.read_bytes()
    assert seen[-1][0] == seen[-1][1] and seen[-1][2] == sum(two.tokens.values())


def damaged_copy(dataset_dir, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    shard = read_manifest(copy).shards[1]
    damage(copy / shard.path)
    return copy, copy / shard.path


def flip_byte(path, offset=HEADER_BYTES + 1000):
    raw = bytearray(path.read_bytes())
    raw[offset] = (raw[offset] + 1) % 200
    path.write_bytes(bytes(raw))


def test_verify_passes_a_good_dataset(dataset_dir):
    report = verify_dataset(dataset_dir)
    assert report.ok and report.shards == len(read_manifest(dataset_dir).shards) and report.tokens > 0


@pytest.mark.parametrize("damage,expected", [
    (flip_byte, "crc32 mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), "the manifest says"),
    (lambda p: p.unlink(), "missing"),
    (lambda p: flip_byte(p, 20), "header"),
    (lambda p: p.write_bytes(p.read_bytes()[:HEADER_BYTES + 10] + b"\xff\xff" + p.read_bytes()[HEADER_BYTES + 12:]),
     f"token id 65535 ≥ vocabulary size 257 at offset {HEADER_BYTES + 10}"),
])
def test_verify_names_the_bad_shard(dataset_dir, tmp_path, damage, expected):
    copy, bad = damaged_copy(dataset_dir, tmp_path, damage)
    report = verify_dataset(copy)
    assert [p.shard for p in report.problems] == [str(bad)]
    assert expected in report.problems[0].problem


def test_verify_command_exit_codes(dataset_dir, tmp_path, capsys):
    assert main(["verify", str(dataset_dir)]) == 0
    assert "shards good" in capsys.readouterr().out
    copy, bad = damaged_copy(dataset_dir, tmp_path, flip_byte)
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert "bad shard:" in out and bad.name in out and "crc32 mismatch" in out


def test_dtype_mismatch_between_header_and_manifest(dataset_dir, tmp_path):
    def retype(path):
        raw = path.read_bytes()
        path.write_bytes(raw.replace(b'"dtype": "uint16"', b'"dtype": "uint32"', 1))

    copy, bad = damaged_copy(dataset_dir, tmp_path, retype)
    data = TokenDataset(copy, "train", seq_len=16)
    index = next(i for i, s in enumerate(data.shards) if copy / s.path == bad)
    start = int(sum(s.num_tokens for s in data.shards[:index]))
    with pytest.raises(DataError) as info:
        data.tokens(start, 10)
    assert "dtype mismatch" in str(info.value) and f"{bad}, offset 8" in str(info.value)


@pytest.mark.parametrize("workers", [1, 0])
def test_an_arrow_source_without_record_batches_holds_no_rows(tmp_path, workers):
    (tmp_path / "ipc").mkdir()
    with ipc.new_file(tmp_path / "ipc" / "empty.arrow", pa.schema([("text", pa.string())])):
        pass  # a valid file with a schema and no record batch
    with pytest.raises(DataError, match="the source holds no rows") as info:
        prepare_dataset(str(tmp_path / "ipc"), tmp_path / "out", source_format="arrow", workers=workers)
    assert info.value.where == str(tmp_path / "ipc")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
