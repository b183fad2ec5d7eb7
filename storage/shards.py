"""The token shard format and the dataset that reads it.

A dataset directory holds `manifest.parquet` and shard files `<split>-<index>.tokens`.
A shard file is a 4 KiB header (magic, then JSON: dtype, token count, tokenizer) followed by
the tokens as raw little-endian integers. The payload starts on a 4 KiB boundary because
GPUDirect Storage reads need aligned offsets.

The manifest has one row per shard: split, path (relative), dtype, num_tokens, doc_offsets
(start of every document within the shard), crc32 of the payload, tokenizer. Its schema
metadata carries the format version and the tokenizer's vocabulary size.

A sample is `seq_len + 1` consecutive tokens of a split's token stream (all shards of the split
in manifest order): sample i starts at token i * seq_len, so inputs and shifted targets come
from one read.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.errors import DataError

MAGIC = b"ARCHTOK1"
HEADER_BYTES = 4096
FORMAT_VERSION = 1
MANIFEST = "manifest.parquet"

MANIFEST_SCHEMA = pa.schema([
    ("split", pa.string()),
    ("path", pa.string()),
    ("dtype", pa.string()),
    ("num_tokens", pa.int64()),
    ("doc_offsets", pa.list_(pa.int64())),
    ("crc32", pa.int64()),
    ("tokenizer", pa.string()),
])


@dataclass(frozen=True, slots=True)
class ShardInfo:
    split: str
    path: str
    dtype: str
    num_tokens: int
    doc_offsets: list[int]
    crc32: int
    tokenizer: str


def write_shard(directory: Path, split: str, index: int, tokens: np.ndarray, doc_offsets: list[int],
                tokenizer: str) -> ShardInfo:
    name = f"{split}-{index:05d}.tokens"
    payload = np.ascontiguousarray(tokens).astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
    header = json.dumps({"dtype": str(tokens.dtype), "num_tokens": int(tokens.size), "tokenizer": tokenizer,
                         "format_version": FORMAT_VERSION}).encode()
    with open(directory / name, "wb") as f:
        f.write((MAGIC + header).ljust(HEADER_BYTES, b"\0"))
        f.write(payload)
    return ShardInfo(split, name, str(tokens.dtype), int(tokens.size), doc_offsets, zlib.crc32(payload), tokenizer)


def write_manifest(directory: Path, shards: list[ShardInfo], vocab_size: int) -> None:
    columns = {name: [getattr(s, name) for s in shards] for name in MANIFEST_SCHEMA.names}
    metadata = {b"format_version": str(FORMAT_VERSION).encode(), b"vocab_size": str(vocab_size).encode()}
    table = pa.table(columns, schema=MANIFEST_SCHEMA.with_metadata(metadata))
    pq.write_table(table, directory / MANIFEST)


def has_dataset(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


class TokenDataset:
    """One split of a prepared dataset, read through memory maps, cut into fixed-length samples."""

    def __init__(self, directory: str | Path, split: str, seq_len: int):
        self.directory = Path(directory)
        self.split = split
        self.seq_len = seq_len
        manifest = read_manifest(self.directory)
        self.vocab_size = manifest["vocab_size"]
        self.shards = [s for s in manifest["shards"] if s.split == split]
        if not self.shards:
            raise DataError(f"no {split!r} shards in the manifest", where=str(self.directory / MANIFEST),
                            fix="prepare the dataset again with `archipelago prepare`")
        self.tokenizer = self.shards[0].tokenizer
        self._starts = np.cumsum([0] + [s.num_tokens for s in self.shards])
        self._maps: list[np.ndarray | None] = [None] * len(self.shards)

    @property
    def num_tokens(self) -> int:
        return int(self._starts[-1])

    @property
    def num_samples(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def tokens(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the split's stream, crossing shard boundaries as needed."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while filled < count:
            local = start + filled - int(self._starts[shard])
            take = min(count - filled, self.shards[shard].num_tokens - local)
            out[filled:filled + take] = self._shard(shard)[local:local + take]
            filled += take
            shard += 1
        return out

    def batch(self, sample_ids: np.ndarray) -> np.ndarray:
        """A (len(sample_ids), seq_len + 1) int64 array: inputs are [:, :-1], targets [:, 1:]."""
        if len(sample_ids) and (sample_ids.min() < 0 or sample_ids.max() >= self.num_samples):
            raise DataError(f"sample id out of range [0, {self.num_samples})", where=f"{self.directory} ({self.split})")
        return np.stack([self.tokens(int(i) * self.seq_len, self.seq_len + 1) for i in sample_ids])

    def _shard(self, index: int) -> np.ndarray:
        if self._maps[index] is None:
            self._maps[index] = _open_shard(self.directory, self.shards[index])
        return self._maps[index]


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise DataError("no prepared dataset here (manifest.parquet is missing)", where=str(directory),
                        fix="run `archipelago prepare --out DIR`, or set [data] prepare_from so fit prepares it")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"manifest is not readable Parquet ({e})", where=str(path),
                        fix="prepare the dataset again with `archipelago prepare`") from None
    meta = table.schema.metadata or {}
    version = int(meta.get(b"format_version", b"0"))
    if version != FORMAT_VERSION:
        raise DataError(f"manifest format version {version}, this archipelago reads version {FORMAT_VERSION}",
                        where=str(path), fix="prepare the dataset again with this version of `archipelago prepare`")
    missing = set(MANIFEST_SCHEMA.names) - set(table.column_names)
    if missing:
        raise DataError(f"manifest lacks columns {sorted(missing)}", where=str(path),
                        fix="prepare the dataset again with `archipelago prepare`")
    shards = [ShardInfo(**{k: row[k] for k in MANIFEST_SCHEMA.names}) for row in table.to_pylist()]
    return {"vocab_size": int(meta[b"vocab_size"]), "shards": shards}


def _open_shard(directory: Path, shard: ShardInfo) -> np.ndarray:
    path = directory / shard.path
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError("shard listed in the manifest is missing", where=str(path),
                        fix="restore the file or prepare the dataset again") from None
    if not header.startswith(MAGIC):
        raise DataError("not an archipelago token shard (bad magic bytes)", where=f"{path}, offset 0",
                        fix="prepare the dataset again")
    dtype = np.dtype(shard.dtype).newbyteorder("<")
    expected = HEADER_BYTES + shard.num_tokens * dtype.itemsize
    if size != expected:
        raise DataError(f"shard is {size} bytes, the manifest says {expected}", where=f"{path}, offset {size}",
                        fix="the file is truncated or was replaced; prepare the dataset again")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(shard.num_tokens,))
