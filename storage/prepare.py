"""Turn a directory of text files into a token dataset (shards + manifest).

    archipelago prepare --source stdlib --out data/stdlib-bytes

Files are split into train and validation by a hash of their relative path, so the split is the
same on every machine and does not move when files are added. The dataset is written into a
temporary directory and renamed into place, so an interrupted prepare leaves nothing half-made.
"""

from __future__ import annotations

import shutil
import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.errors import DataError
from storage.shards import ShardInfo, has_dataset, write_manifest, write_shard
from storage.tokenizers import TOKENIZERS


@dataclass(frozen=True, slots=True)
class PrepareSummary:
    directory: Path
    files: dict[str, int]
    tokens: dict[str, int]
    shards: int


def resolve_source(source: str) -> Path:
    """"stdlib" is the running interpreter's standard library: real text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"]) if source == "stdlib" else Path(source)


def list_files(root: Path, pattern: str) -> list[Path]:
    if not root.is_dir():
        raise DataError("source directory does not exist", where=str(root),
                        fix='point --source (or [data] prepare_from) at a directory of text files, or use "stdlib"')
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.relative_to(root).parts)
    if not files:
        raise DataError(f"no files matching {pattern!r}", where=str(root),
                        fix="check the directory, or change the pattern (--pattern / [data] pattern)")
    return files


def split_of(relative_path: str, val_percent: float) -> str:
    bucket = zlib.crc32(relative_path.encode()) % 10_000
    return "val" if bucket < val_percent * 100 else "train"


class _ShardWriter:
    """Packs documents into shards of `shard_tokens` tokens (a document may span two shards)."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, tokenizer):
        self.directory, self.split, self.shard_tokens, self.tokenizer = directory, split, shard_tokens, tokenizer
        self.buffer = np.empty(shard_tokens, dtype=tokenizer.dtype)
        self.filled = 0
        self.doc_offsets: list[int] = []
        self.shards: list[ShardInfo] = []

    def add(self, tokens: np.ndarray) -> None:
        self.doc_offsets.append(self.filled)
        while tokens.size:
            take = min(tokens.size, self.shard_tokens - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if self.filled:
            self.shards.append(write_shard(self.directory, self.split, len(self.shards), self.buffer[:self.filled],
                                           self.doc_offsets, self.tokenizer.name))
        self.filled, self.doc_offsets = 0, []


def prepare_dataset(source: str, out: str | Path, *, pattern: str = "*.py", val_percent: float = 5.0,
                    shard_tokens: int = 16 * 2**20, tokenizer: str = "bytes", overwrite: bool = False,
                    on_file: Callable[[int, int], None] | None = None) -> PrepareSummary:
    out = Path(out)
    if has_dataset(out) and not overwrite:
        raise DataError("a prepared dataset is already here", where=str(out),
                        fix="use it as is, pass --overwrite to replace it, or choose another --out")
    if out.exists() and not has_dataset(out) and any(out.iterdir()):
        raise DataError("directory exists, is not empty and holds no prepared dataset", where=str(out),
                        fix="choose another --out; prepare never deletes files it did not write")
    root = resolve_source(source)
    files = list_files(root, pattern)
    tok = TOKENIZERS[tokenizer]
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writers = {split: _ShardWriter(staging, split, shard_tokens, tok) for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    for done, path in enumerate(files, 1):
        split = split_of(path.relative_to(root).as_posix(), val_percent)
        writers[split].add(tok.encode_document(path.read_bytes()))
        counts[split] += 1
        if on_file:
            on_file(done, len(files))
    for split, writer in writers.items():
        writer.flush()
        if not writer.shards:
            shutil.rmtree(staging)
            raise DataError(f"the {split} split would be empty ({len(files)} files, val_percent = {val_percent})",
                            where=str(root), fix="add more files or change val_percent")
    shards = writers["train"].shards + writers["val"].shards
    write_manifest(staging, shards, tok.vocab_size)
    if has_dataset(out):
        shutil.rmtree(out)
    elif out.exists():
        out.rmdir()
    staging.rename(out)
    return PrepareSummary(out, counts, {s: sum(x.num_tokens for x in w.shards) for s, w in writers.items()}, len(shards))
