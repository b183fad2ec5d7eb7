"""The token shard format, its manifest, and `TokenDataset`: one split cut into fixed-length samples.

A dataset directory (local or any pyarrow.fs URI) holds `manifest.parquet` and shard files
`<split>-<index>.tokens` (and, prepared with a tokenizers file, a copy of it: storage/tokenizers.DATASET_COPY).
A shard file is a 4 KiB header (magic, then JSON: dtype, token count, tokenizer, format version) followed by
the tokens as raw little-endian integers. The payload starts on a 4 KiB boundary because GPUDirect Storage
reads need aligned offsets.

The manifest has one row per shard: split, path (relative), dtype, num_tokens, doc_offsets
(start of every document within the shard), crc32 of the payload, tokenizer. Its schema
metadata carries the format version and the tokenizer's vocabulary size. Format version 1 is
the only one written so far; a manifest of another version is refused with a clear error.

A sample is `seq_len + 1` consecutive tokens of a split's token stream (all shards of the split
in manifest order): sample i starts at token i * seq_len, so inputs and shifted targets come
from one read. `TokenDataset.extents()` turns sample ids into byte ranges of shard files; a
reader (storage/readers.py) moves those ranges into host or GPU memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from core.errors import DataError
from storage.flags import TOKEN_MASK
from storage.fs import Location
from storage.readers import Extent, host_reader_for

MAGIC = b"ARCHTOK1"
HEADER_BYTES = 4096
FORMAT_VERSION = 1
MANIFEST = "manifest.parquet"
TOKEN_DTYPES = ("uint16", "uint32")
"""Token dtypes a shard may hold: uint16 up to 65,536 tokens of vocabulary, uint32 above."""

MANIFEST_SCHEMA = pa.schema([
    ("split", pa.string()),
    ("path", pa.string()),
    ("dtype", pa.string()),
    ("num_tokens", pa.int64()),
    ("doc_offsets", pa.list_(pa.int64())),
    ("crc32", pa.int64()),
    ("tokenizer", pa.string()),
])

PREPARE_AGAIN = "prepare the dataset again with `archipelago prepare`"
CHECK_CHUNK_BYTES = 16 * 2**20
"""Bytes read at a time when a shard's payload is checked."""


@dataclass(frozen=True, slots=True)
class ShardInfo:
    split: str
    path: str
    dtype: str
    num_tokens: int
    doc_offsets: list[int]
    crc32: int
    tokenizer: str

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.num_tokens * self.itemsize


@dataclass(frozen=True, slots=True)
class Manifest:
    vocab_size: int
    shards: list[ShardInfo]
    token_flags: bool = False
    """The shards hold flagged words (storage/flags.py): a loss mask and document starts (fine-tuning data)."""
    packed_seq_len: int = 0
    """> 0: documents were packed whole into samples of this many tokens; only a job of that seq_len
    reads whole documents from them."""

    def split(self, name: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == name]

    @property
    def train_fingerprint(self) -> str:
        """What the training samples are, in 16 hex digits: each train shard's name, length and checksum. The
        same dataset copied elsewhere keeps it; data prepared again from another source does not."""
        rows = sorted((s.path, s.num_tokens, s.crc32) for s in self.split("train"))
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def shard_header(dtype: str, num_tokens: int, tokenizer: str) -> bytes:
    header = json.dumps({"dtype": dtype, "num_tokens": num_tokens, "tokenizer": tokenizer,
                         "format_version": FORMAT_VERSION}).encode()
    return (MAGIC + header).ljust(HEADER_BYTES, b"\0")


def write_shard(directory: Path, split: str, index: int, tokens: np.ndarray, doc_offsets: list[int],
                tokenizer: str) -> ShardInfo:
    name = f"{split}-{index:05d}.tokens"
    dtype = str(tokens.dtype)
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype must be one of {TOKEN_DTYPES}, got {dtype}")
    payload = np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("<"))
    with open(directory / name, "wb") as f:
        f.write(shard_header(dtype, int(tokens.size), tokenizer))
        f.write(payload.data)
    return ShardInfo(split, name, dtype, int(tokens.size), doc_offsets, zlib.crc32(payload.data), tokenizer)


def write_manifest(directory: Path, shards: list[ShardInfo], vocab_size: int, *, token_flags: bool = False,
                   packed_seq_len: int = 0) -> None:
    columns = {name: [getattr(s, name) for s in shards] for name in MANIFEST_SCHEMA.names}
    metadata = {b"format_version": str(FORMAT_VERSION).encode(), b"vocab_size": str(vocab_size).encode(),
                b"token_flags": str(int(token_flags)).encode(), b"packed_seq_len": str(packed_seq_len).encode()}
    table = pa.table(columns, schema=MANIFEST_SCHEMA.with_metadata(metadata))
    pq.write_table(table, directory / MANIFEST)


def has_dataset(directory: str | Path | Location) -> bool:
    return (Location.parse(directory, error=DataError) / MANIFEST).is_file()


def read_manifest(directory: str | Path | Location) -> Manifest:
    location = Location.parse(directory, error=DataError)
    path = location / MANIFEST
    if not path.is_file():
        raise DataError("no prepared dataset here (manifest.parquet is missing)", where=str(location),
                        fix="run `archipelago prepare --out DIR`, or set [data] prepare_from so fit prepares it")
    try:
        table = pq.read_table(path.path, filesystem=location.fs)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"manifest is not readable Parquet ({e})", where=str(path), fix=PREPARE_AGAIN) from None
    meta = table.schema.metadata or {}
    version = _meta_int(meta, b"format_version", path, default=0)
    if version != FORMAT_VERSION:
        raise DataError(f"manifest format version {version}, this archipelago reads version {FORMAT_VERSION}",
                        where=str(path), fix="prepare the dataset again with this version of `archipelago prepare`")
    missing = set(MANIFEST_SCHEMA.names) - set(table.column_names)
    if missing:
        raise DataError(f"manifest lacks columns {sorted(missing)}", where=str(path), fix=PREPARE_AGAIN)
    shards = [ShardInfo(**{k: row[k] for k in MANIFEST_SCHEMA.names}) for row in table.to_pylist()]
    for shard in shards:
        if shard.dtype not in TOKEN_DTYPES:
            raise DataError(f"shard dtype {shard.dtype!r} is not one of {TOKEN_DTYPES}",
                            where=f"{location / shard.path} (manifest row)", fix=PREPARE_AGAIN)
    return Manifest(_meta_int(meta, b"vocab_size", path), shards, token_flags=meta.get(b"token_flags", b"0") == b"1",
                    packed_seq_len=_meta_int(meta, b"packed_seq_len", path, default=0))


def _meta_int(meta: dict[bytes, bytes], key: bytes, path: Location, *, default: int | None = None) -> int:
    """A whole number from the manifest's Parquet metadata; `default` where an older prepare left it out."""
    text = meta.get(key)
    if text is None and default is not None:
        return default
    try:
        return int(text)
    except (TypeError, ValueError):
        found = "missing" if text is None else f"{text[:40].decode(errors='replace')!r}, not a whole number"
        raise DataError(f"manifest metadata {key.decode()} is {found}", where=str(path), fix=PREPARE_AGAIN) from None


def check_shard(location: Location, shard: ShardInfo, header: bytes, size: int) -> None:
    """Raises DataError unless the file's header and size agree with the manifest row."""
    if not header.startswith(MAGIC):
        raise DataError("not an archipelago token shard (bad magic bytes)", where=f"{location}, offset 0",
                        fix=PREPARE_AGAIN)
    try:
        fields = json.loads(header[len(MAGIC):].rstrip(b"\0"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        fields = None
    if not isinstance(fields, dict):
        raise DataError("shard header is not a JSON object", where=f"{location}, offset {len(MAGIC)}",
                        fix=PREPARE_AGAIN)
    if fields.get("dtype") != shard.dtype:
        raise DataError(f"dtype mismatch: the shard header says {fields.get('dtype')!r}, the manifest {shard.dtype!r}",
                        where=f"{location}, offset {len(MAGIC)}",
                        fix="the shard or the manifest was replaced; prepare the dataset again")
    if fields.get("num_tokens") != shard.num_tokens or fields.get("tokenizer") != shard.tokenizer:
        raise DataError("shard header disagrees with the manifest (token count or tokenizer)",
                        where=f"{location}, offset {len(MAGIC)}",
                        fix="the shard or the manifest was replaced; prepare the dataset again")
    if size != shard.file_bytes:
        raise DataError(f"shard is {size} bytes, the manifest says {shard.file_bytes}",
                        where=f"{location}, offset {min(size, shard.file_bytes)}",
                        fix="the file is truncated or was replaced; prepare the dataset again")


@contextlib.contextmanager
def open_shard(location: Location, shard: ShardInfo) -> Iterator[pa.NativeFile]:
    """The shard's file, open for reading, once its header and size agree with the manifest row
    (DataError otherwise, also for a missing file)."""
    path = location / shard.path
    try:
        f = location.fs.open_input_file(path.path)
    except FileNotFoundError:
        raise DataError("shard listed in the manifest is missing", where=str(path),
                        fix="restore the file or prepare the dataset again") from None
    with f:
        size = f.size()
        check_shard(path, shard, f.read_at(min(HEADER_BYTES, size), 0), size)
        yield f


def token_ids(words: np.ndarray, flagged: bool) -> np.ndarray:
    """The token ids of a shard's words: a fine-tuning dataset's (flagged) without the loss-mask and document-start
    bits (storage/flags.py), which would otherwise read as ids far past any vocabulary."""
    return words & TOKEN_MASK if flagged else words


def payload_problem(f: pa.NativeFile, shard: ShardInfo, vocab_size: int, *, flagged: bool = False) -> str | None:
    """What is wrong with an open shard's tokens, read once in chunks: a token id at or above the vocabulary
    size (and its byte offset), or a crc32 of the payload that is not the manifest's; None when both hold.
    `flagged`: the manifest's token_flags (the ids are the words' low bits)."""
    crc = 0
    dtype = np.dtype(shard.dtype).newbyteorder("<")
    for start in range(HEADER_BYTES, shard.file_bytes, CHECK_CHUNK_BYTES):
        chunk = f.read_at(min(CHECK_CHUNK_BYTES, shard.file_bytes - start), start)
        crc = zlib.crc32(chunk, crc)
        tokens = token_ids(np.frombuffer(chunk, dtype=dtype), flagged)
        if tokens.size and int(tokens.max()) >= vocab_size:
            first = int(np.argmax(tokens >= vocab_size))
            return f"token id {int(tokens[first])} ≥ vocabulary size {vocab_size} at offset {start + first * dtype.itemsize}"
    if crc != shard.crc32:
        return (f"crc32 mismatch: payload (offsets {HEADER_BYTES}–{shard.file_bytes}) has {crc:#010x}, "
                f"the manifest says {shard.crc32:#010x}")
    return None


def sampled_for_checksum(shard: ShardInfo, percent: float) -> bool:
    """Whether a worker checks this shard's payload when it first reads from it: `percent` of the shards, chosen
    by a hash of the name, so that every worker (and every run) checks the same ones."""
    return zlib.crc32(shard.path.encode()) % 10_000 < percent * 100


def check_files(location: Location, shards: list[ShardInfo]) -> None:
    """Every shard exists with the size the manifest gives: one directory listing, no reads."""
    sizes = {info.base_name: info.size for info in location.listing() if info.type == pafs.FileType.File}
    for shard in shards:
        size = sizes.get(shard.path)
        if size is None:
            raise DataError("shard listed in the manifest is missing", where=str(location / shard.path),
                            fix="restore the file or prepare the dataset again")
        if size != shard.file_bytes:
            raise DataError(f"shard is {size} bytes, the manifest says {shard.file_bytes}",
                            where=f"{location / shard.path}, offset {min(size, shard.file_bytes)}",
                            fix="the file is truncated or was replaced; prepare the dataset again")


class TokenDataset:
    """One split of a prepared dataset, cut into fixed-length samples of `seq_len + 1` tokens.

    `extents(ids)` plans the byte ranges of a batch; `batch(ids)` reads one into host memory
    (the training loop reads through `storage.loader.BatchLoader`, which can read into the GPU).
    """

    def __init__(self, directory: str | Path | Location, split: str, seq_len: int, *, manifest: Manifest | None = None,
                 checksum_percent: float = 0.0):
        """`manifest`: the directory's manifest when the caller has read it already (read here otherwise).
        `checksum_percent`: the share of shards whose payload (crc32, token ids) is checked the first time a batch
        reads from them ([data] shard_checksums_percent); every shard's header and size are checked then anyway."""
        self.location = Location.parse(directory, error=DataError)
        self.split = split
        self.seq_len = seq_len
        self.manifest = manifest = manifest if manifest is not None else read_manifest(self.location)
        """The whole dataset's manifest (every split), for the other split's dataset or `verify_dataset`."""
        self.vocab_size = manifest.vocab_size
        self.shards = manifest.split(split)
        if not self.shards:
            raise DataError(f"no {split!r} shards in the manifest", where=str(self.location / MANIFEST),
                            fix=PREPARE_AGAIN)
        dtypes = {s.dtype for s in self.shards}
        if len(dtypes) > 1:
            raise DataError(f"dtype mismatch: the {split!r} shards mix {sorted(dtypes)}",
                            where=str(self.location / MANIFEST), fix=PREPARE_AGAIN)
        tokenizers = {s.tokenizer for s in self.shards}
        if len(tokenizers) > 1:
            raise DataError(f"the {split!r} shards were made by different tokenizers {sorted(tokenizers)}",
                            where=str(self.location / MANIFEST), fix=PREPARE_AGAIN)
        self.tokenizer = self.shards[0].tokenizer
        self.dtype = np.dtype(self.shards[0].dtype).newbyteorder("<")
        self._starts = np.cumsum([0] + [s.num_tokens for s in self.shards])
        self._paths = [(self.location / s.path).path for s in self.shards]
        self._checked = [False] * len(self.shards)
        self._checksummed = [sampled_for_checksum(s, checksum_percent) for s in self.shards]
        self._lock = threading.Lock()
        self._host_reader = None

    @property
    def num_tokens(self) -> int:
        return int(self._starts[-1])

    @property
    def num_samples(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    @property
    def sample_bytes(self) -> int:
        return (self.seq_len + 1) * self.dtype.itemsize

    def extents(self, sample_ids: np.ndarray) -> list[Extent]:
        """Byte ranges of the samples, laid out back to back: sample k lands at k * sample_bytes."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            bad = int(ids[(ids < 0) | (ids >= self.num_samples)][0])
            raise DataError(f"sample id {bad} out of range [0, {self.num_samples})",
                            where=f"{self.location} ({self.split})", fix="this is a bug in the sampler; report it")
        return self.token_extents(ids * self.seq_len, self.seq_len + 1)

    def token_extents(self, starts: np.ndarray, count: int) -> list[Extent]:
        """Byte ranges of tokens [s, s + count) for every s in `starts`, back to back in the buffer."""
        first = np.searchsorted(self._starts, starts, side="right") - 1
        last = np.searchsorted(self._starts, starts + count - 1, side="right") - 1
        itemsize = self.dtype.itemsize
        out: list[Extent] = []
        for k, (start, a, b) in enumerate(zip(starts.tolist(), first.tolist(), last.tolist())):
            dest = k * count * itemsize
            for shard in range(a, b + 1):
                self._check(shard)
                lo = max(start, int(self._starts[shard])) - int(self._starts[shard])
                hi = min(start + count, int(self._starts[shard + 1])) - int(self._starts[shard])
                nbytes = (hi - lo) * itemsize
                out.append(Extent(self._paths[shard], HEADER_BYTES + lo * itemsize, nbytes, dest))
                dest += nbytes
        return out

    def tokens(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the split's stream as int64, crossing shards as needed."""
        if start < 0 or start + count > self.num_tokens:
            raise DataError(f"tokens [{start}, {start + count}) out of range [0, {self.num_tokens})",
                            where=f"{self.location} ({self.split})")
        return self._read_host(self.token_extents(np.array([start]), count), count * self.dtype.itemsize).reshape(-1)

    def batch(self, sample_ids: np.ndarray) -> np.ndarray:
        """A (len(sample_ids), seq_len + 1) int64 array: inputs are [:, :-1], targets [:, 1:]."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        extents = self.extents(ids)
        flat = self._read_host(extents, ids.size * self.sample_bytes)
        self.check_token_ids(extents, flat)
        return flat.reshape(ids.size, self.seq_len + 1)

    def check_token_ids(self, extents: list[Extent], tokens: np.ndarray) -> None:
        """Every token id read into `tokens` (laid out as `extents` say) is below the vocabulary size: a larger one
        would index past the model's embedding. DataError naming the shard and offset of the first one otherwise."""
        tokens = token_ids(tokens, self.manifest.token_flags)
        if not tokens.size or int(tokens.max()) < self.vocab_size:
            return
        position = int(np.argmax(tokens >= self.vocab_size))
        byte = position * self.dtype.itemsize
        extent = next(e for e in extents if e.buffer_offset <= byte < e.buffer_offset + e.nbytes)
        raise DataError(f"token id {int(tokens[position])} ≥ vocabulary size {self.vocab_size}: the shard is damaged",
                        where=f"{extent.path}, offset {extent.file_offset + byte - extent.buffer_offset}",
                        fix=f"run `archipelago verify {self.location}` for every bad shard, then {PREPARE_AGAIN}")

    def _read_host(self, extents: list[Extent], nbytes: int) -> np.ndarray:
        with self._lock:
            if self._host_reader is None:
                self._host_reader = host_reader_for(self.location)
        buffer = np.empty(nbytes, dtype=np.uint8)
        self._host_reader.read(extents, buffer).wait()
        return buffer.view(self.dtype).astype(np.int64)

    def _check(self, shard: int) -> None:
        """The first read from a shard checks its header and size, and for the sampled shards its payload."""
        if self._checked[shard]:
            return
        with self._lock:
            if self._checked[shard]:
                return
            info = self.shards[shard]
            with open_shard(self.location, info) as f:
                problem = payload_problem(f, info, self.vocab_size, flagged=self.manifest.token_flags) if self._checksummed[shard] else None
            if problem:
                raise DataError(problem, where=str(self.location / info.path),
                                fix=f"run `archipelago verify {self.location}` for every bad shard, then {PREPARE_AGAIN}")
            self._checked[shard] = True
