"""Ingest documents into a token dataset (shards + manifest), tokenizing in parallel.

    archipelago prepare --source stdlib --out data/stdlib-bytes
    archipelago prepare --source corpus/ --format jsonl --text-column text --tokenizer hf:tokenizer.json --out data/c
    archipelago prepare --source pile/ --format parquet --text-column text --out data/pile

Sources: a directory of text files (one document per file, chosen by a glob), JSON Lines files
(one document per line, its text in a named field), or a Parquet / Arrow dataset read through
pyarrow.dataset (one document per row, its text in a named column). Fine-tuning data: JSON Lines of
conversations (--format chat) or prompt/response pairs (--format instruction), stored with a loss
mask and packed into samples of --seq-len tokens (storage/chat.py).

The source is cut into units (a few files, a byte range of a JSONL file, a Parquet row group);
worker processes tokenize units in parallel and the parent packs their documents into shards
in unit order, so the dataset is byte-for-byte the same whatever the number of workers.

Documents are split into train and validation by a hash of a stable key (the file's relative
path; for JSONL and Parquet, the file and the line's byte offset or the row's position), so the
split is the same on every machine and does not move when files are added. The dataset is
written into a temporary directory and renamed into place: an interrupted prepare leaves
nothing half-made.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sysconfig
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from core.config import check_prepare_settings
from core.errors import ConfigError, DataError
from storage import chat
from storage.shards import ShardInfo, has_dataset, write_manifest, write_shard
from storage.tokenizers import DATASET_COPY, HFJsonTokenizer, Tokenizer, load_tokenizer

SourceFormat = Literal["text", "jsonl", "parquet", "arrow", "chat", "instruction"]
DEFAULT_PATTERNS = {"text": "*.py", "jsonl": "*.jsonl", "parquet": "*.parquet", "arrow": "*.arrow",
                    "chat": "*.jsonl", "instruction": "*.jsonl"}
FINE_TUNING_FORMATS = ("chat", "instruction")
"""JSON Lines of conversations: flagged tokens (a loss mask), packed into samples of seq_len (storage/chat.py)."""
TEXT_FILES_PER_UNIT = 64
JSONL_UNIT_BYTES = 32 * 2**20


@dataclass(frozen=True, slots=True)
class PrepareSummary:
    directory: Path
    documents: dict[str, int]
    tokens: dict[str, int]
    shards: int
    tokenizer: str
    workers: int
    truncated: int = 0
    """Conversations cut at seq_len (fine-tuning formats): what followed was not trained on."""

    @property
    def truncation_note(self) -> str:
        """"; N conversations cut at …" for the summary line, or nothing."""
        return (f"; {self.truncated:,} conversations cut at the sample length (what followed is not trained on)"
                if self.truncated else "")


@dataclass(frozen=True, slots=True)
class Unit:
    """One piece of work for a tokenizing process."""

    format: SourceFormat
    root: str
    files: tuple[str, ...]
    """Relative paths of the unit's files (text) or its one file (jsonl, parquet, arrow)."""
    start: int = 0
    """jsonl: first byte; parquet/arrow: row group or record batch index."""
    stop: int = 0
    """jsonl: end byte (exclusive; the unit owns every line that starts before it); parquet/arrow: the
    piece's first row within the file, so a row's split key does not depend on how the file is chunked."""


@dataclass(slots=True)
class UnitTokens:
    """A unit's documents by split: tokens back to back, and each document's length."""

    tokens: dict[str, list[np.ndarray]] = field(default_factory=lambda: {"train": [], "val": []})

    def add(self, split: str, tokens: np.ndarray) -> None:
        self.tokens[split].append(tokens)


def resolve_source(source: str) -> Path:
    """"stdlib" is the running interpreter's standard library: real text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"]) if source == "stdlib" else Path(source)


def list_files(root: Path, pattern: str) -> list[Path]:
    if not root.is_dir():
        raise DataError("source directory does not exist", where=str(root),
                        fix='point --source (or [data] prepare_from) at a directory of files, or use "stdlib"')
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.relative_to(root).parts)
    if not files:
        raise DataError(f"no files matching {pattern!r}", where=str(root),
                        fix="check the directory, or change the pattern (--pattern / [data] pattern)")
    return files


def split_of(key: str, val_percent: float) -> str:
    bucket = zlib.crc32(key.encode()) % 10_000
    return "val" if bucket < val_percent * 100 else "train"


def plan_units(root: Path, files: list[Path], fmt: SourceFormat, workers: int) -> list[Unit]:
    """Units in dataset order; text files are grouped so each worker gets several units (the output does
    not depend on the grouping: documents are packed in file order either way)."""
    relative = [p.relative_to(root).as_posix() for p in files]
    if fmt == "text":
        per_unit = max(1, min(TEXT_FILES_PER_UNIT, -(-len(relative) // (4 * workers))))
        return [Unit(fmt, str(root), tuple(relative[i:i + per_unit])) for i in range(0, len(relative), per_unit)]
    if fmt == "jsonl" or fmt in FINE_TUNING_FORMATS:
        return [Unit(fmt, str(root), (rel,), start, min(start + JSONL_UNIT_BYTES, size))
                for rel, path in zip(relative, files)
                for size in [path.stat().st_size]
                for start in range(0, max(size, 1), JSONL_UNIT_BYTES)]
    return [Unit(fmt, str(root), (rel,), index, first_row) for rel, path in zip(relative, files)
            for index, first_row in enumerate(_arrow_pieces(path, fmt))]


def _arrow_pieces(path: Path, fmt: SourceFormat) -> list[int]:
    """The first row (within the file) of each row group or record batch."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        else:
            import pyarrow.ipc as ipc

            with ipc.open_file(path) as reader:
                rows = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
        return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int).tolist() if rows else []
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DataError(f"not a readable {fmt} file ({e})", where=str(path),
                        fix="check the file, or choose another --format (text, jsonl, parquet, arrow)") from None


class _Worker:
    """State of one tokenizing process (the tokenizer is loaded once per process)."""

    tokenizer: Tokenizer | None = None
    spec: tuple = ()


def _init_worker(tokenizer: str, text_column: str, val_percent: float) -> None:
    _Worker.tokenizer = load_tokenizer(tokenizer)
    _Worker.spec = (text_column, val_percent)


def tokenize_unit(unit: Unit) -> UnitTokens:
    text_column, val_percent = _Worker.spec
    out = UnitTokens()
    if unit.format in FINE_TUNING_FORMATS:
        for key, turns in _conversations(unit):
            out.add(split_of(key, val_percent), chat.encode(turns, _Worker.tokenizer))
        return out
    documents = list(_documents(unit, text_column))
    for (key, _), tokens in zip(documents, _Worker.tokenizer.encode_documents([d for _, d in documents])):
        out.add(split_of(key, val_percent), tokens)
    return out


def _conversations(unit: Unit) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(split key, turns) of every conversation of a chat or instruction unit."""
    root = Path(unit.root)
    for key, offset, line in _jsonl_lines(root, unit):
        yield key, chat.turns_of(line, unit.format, f"{root / unit.files[0]}, byte {offset}")


def _documents(unit: Unit, text_column: str) -> Iterator[tuple[str, bytes]]:
    """(split key, document bytes) for every document of a unit."""
    root = Path(unit.root)
    if unit.format == "text":
        for rel in unit.files:
            yield rel, (root / rel).read_bytes()
    elif unit.format == "jsonl":
        yield from _jsonl_documents(root, unit, text_column)
    else:
        yield from _arrow_documents(root, unit, text_column)


def _jsonl_lines(root: Path, unit: Unit) -> Iterator[tuple[str, int, bytes]]:
    """(split key, byte offset, line) of every non-empty line the unit owns."""
    rel = unit.files[0]
    with open(root / rel, "rb") as f:
        if unit.start:
            f.seek(unit.start - 1)
            f.readline()  # the line that started before this unit belongs to the previous one
        while (offset := f.tell()) < unit.stop:
            line = f.readline()
            if not line:
                break
            if line.strip():
                yield f"{rel}@{offset}", offset, line


def _jsonl_documents(root: Path, unit: Unit, text_column: str) -> Iterator[tuple[str, bytes]]:
    rel = unit.files[0]
    for key, offset, line in _jsonl_lines(root, unit):
        try:
            text = json.loads(line)[text_column]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"not a JSON line ({e.__class__.__name__}: {e})", where=f"{root / rel}, byte {offset}",
                            fix="fix or remove that line") from None
        except (KeyError, TypeError):
            raise DataError(f"the line has no {text_column!r} field", where=f"{root / rel}, byte {offset}",
                            fix="name the text field with --text-column / [data] text_column") from None
        if not isinstance(text, str):
            raise DataError(f"field {text_column!r} is {type(text).__name__}, not text",
                            where=f"{root / rel}, byte {offset}", fix="name a text field with --text-column")
        yield key, text.encode()


def _arrow_documents(root: Path, unit: Unit, text_column: str) -> Iterator[tuple[str, bytes]]:
    import pyarrow as pa

    rel = unit.files[0]
    if unit.format == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(root / rel)
        if text_column not in parquet.schema_arrow.names:
            raise _no_column(root / rel, text_column, parquet.schema_arrow.names)
        column = parquet.read_row_group(unit.start, columns=[text_column]).column(0)
    else:
        import pyarrow.ipc as ipc

        with ipc.open_file(root / rel) as reader:
            batch = reader.get_batch(unit.start)
        if text_column not in batch.schema.names:
            raise _no_column(root / rel, text_column, batch.schema.names)
        column = pa.chunked_array([batch.column(text_column)])
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"column {text_column!r} is {column.type}, not text", where=str(root / rel),
                        fix="name a string column with --text-column / [data] text_column")
    for row, text in enumerate(column.to_pylist()):
        if text is not None:
            yield f"{rel}#{unit.stop + row}", text.encode()


def _no_column(path: Path, column: str, names: list[str]) -> DataError:
    return DataError(f"no column {column!r} (columns: {', '.join(names)})", where=str(path),
                     fix="name the text column with --text-column / [data] text_column")


class _ShardWriter:
    """Packs documents into shards of `shard_tokens` tokens (a document may span two shards)."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, tokenizer: Tokenizer, dtype: str):
        self.directory, self.split, self.shard_tokens, self.tokenizer = directory, split, shard_tokens, tokenizer
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.filled = 0
        self.doc_offsets: list[int] = []
        self.shards: list[ShardInfo] = []
        self.documents = 0

    def add(self, tokens: np.ndarray) -> None:
        self.documents += 1
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


def ordered_map(executor: Executor, fn: Callable, items: list, window: int) -> Iterator:
    """executor.map with at most `window` results waiting, so a slow unit cannot pile up memory."""
    pending: deque = deque()
    it = iter(items)
    for item in it:
        pending.append(executor.submit(fn, item))
        if len(pending) >= window:
            break
    while pending:
        yield pending.popleft().result()
        nxt = next(it, None)
        if nxt is not None:
            pending.append(executor.submit(fn, nxt))


class _InProcess(Executor):
    """The one-worker case: no processes to start."""

    def submit(self, fn, /, *args, **kwargs):
        from concurrent.futures import Future

        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(e)
        return future


def _executor(workers: int, initargs: tuple) -> Executor:
    if workers == 1:
        _init_worker(*initargs)
        return _InProcess()
    # spawn: the parent may hold threads (Ray, torch) that a fork would copy in a locked state
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=initargs)


def prepare_dataset(source: str, out: str | Path, *, pattern: str | None = None, source_format: SourceFormat = "text",
                    text_column: str = "text", val_percent: float = 5.0, shard_tokens: int = 16 * 2**20,
                    tokenizer: str = "bytes", workers: int = 0, overwrite: bool = False, seq_len: int = 0,
                    on_progress: Callable[[int, int, int], None] | None = None) -> PrepareSummary:
    """Writes the dataset at `out`; `on_progress(units_done, units_total, tokens_so_far)` follows along.

    `workers` = 0 uses every core; 1 tokenizes in this process. `seq_len`: the samples the chat and
    instruction formats pack conversations into (the job's [model] seq_len).
    """
    check_prepare_settings(shard_tokens=shard_tokens, workers=workers, val_percent=val_percent,
                           text_column=text_column, as_flags=True)
    if seq_len < 0:
        raise ConfigError(f"must be 0 or more, got {seq_len}", where="--seq-len / [model] seq_len",
                          fix="give the job's [model] seq_len (chat and instruction data only)")
    if source_format in FINE_TUNING_FORMATS and seq_len == 0:
        raise ConfigError(f"--format {source_format} packs conversations into samples and needs their length",
                          where="--seq-len / [model] seq_len", fix="pass --seq-len, the [model] seq_len of the job")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError("is a file, not a dataset directory", where=str(out), fix="choose another --out")
    if has_dataset(out) and not overwrite:
        raise DataError("a prepared dataset is already here", where=str(out),
                        fix="use it as is, pass --overwrite to replace it, or choose another --out")
    if out.exists() and not has_dataset(out) and any(out.iterdir()):
        raise DataError("directory exists, is not empty and holds no prepared dataset", where=str(out),
                        fix="choose another --out; prepare never deletes files it did not write")
    if source_format not in DEFAULT_PATTERNS:
        raise DataError(f"unknown source format {source_format!r}", where="--format / [data] source_format",
                        fix=f"use one of {', '.join(DEFAULT_PATTERNS)}")
    fine_tuning = source_format in FINE_TUNING_FORMATS
    tok = load_tokenizer(tokenizer)  # a bad tokenizer fails here, before any process starts
    root = resolve_source(source)
    files = list_files(root, pattern or DEFAULT_PATTERNS[source_format])
    units = plan_units(root, files, source_format, workers or os.cpu_count() or 1)
    if not units:  # Parquet or Arrow files without a single row group or record batch
        raise DataError(f"the source holds no rows ({len(files)} {source_format} file(s), none with a row group "
                        "or record batch)", where=str(root),
                        fix="point --source (or [data] prepare_from) at files with rows")
    workers = min(workers or os.cpu_count() or 1, len(units))
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        packing = seq_len if fine_tuning else 0
        writers, sinks = _write_shards(staging, units, tok, workers, (tokenizer, text_column, val_percent),
                                       shard_tokens, packing, on_progress)
        documents = {split: sink.documents for split, sink in sinks.items()}
        for split in writers:
            if not documents[split]:
                raise DataError(f"the {split} split would be empty ({sum(documents.values())} "
                                f"documents, val_percent = {val_percent})", where=str(root),
                                fix="add more documents or change val_percent")
            if fine_tuning:
                _check_trained_tokens(split, sinks[split], source_format, root)
        shards = writers["train"].shards + writers["val"].shards
        if isinstance(tok, HFJsonTokenizer):
            shutil.copy(tok.path, staging / DATASET_COPY)
        write_manifest(staging, shards, tok.vocab_size, token_flags=fine_tuning, packed_seq_len=packing)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if has_dataset(out):
        shutil.rmtree(out)
    elif out.exists():
        out.rmdir()
    staging.rename(out)
    return PrepareSummary(out, documents,
                          {s: sum(x.num_tokens for x in w.shards) for s, w in writers.items()}, len(shards),
                          tok.name, workers, truncated=sum(sink.truncated for sink in sinks.values() if isinstance(sink, chat.Packer)))


def _check_trained_tokens(split: str, packer: chat.Packer, source_format: str, root: Path) -> None:
    """A split whose conversations kept no token the loss counts would train on nothing (a loss of 0)
    or validate to 0 / 0."""
    if packer.trained_tokens:
        return
    cut = f", {packer.truncated} of them cut at --seq-len {packer.seq_len}" if packer.truncated else ""
    turn = "an assistant turn" if source_format == "chat" else "a response"
    purpose = "train on" if split == "train" else "validate on"
    raise DataError(f"the {split} split has no token to {purpose}: none of its {packer.documents} conversations "
                    f"kept {turn}{cut}", where=str(root),
                    fix=f"give the conversations {turn}" + (", or a larger --seq-len (the job's [model] seq_len)"
                                                            if packer.truncated else ""))


def _write_shards(staging: Path, units: list[Unit], tok: Tokenizer, workers: int, initargs: tuple,
                  shard_tokens: int, packing: int, on_progress: Callable[[int, int, int], None] | None
                  ) -> tuple[dict[str, _ShardWriter], dict[str, _ShardWriter | chat.Packer]]:
    """The shard writers of both splits and what each split's documents went into (its writer, or with
    packing > 0 the chat.Packer that packs flagged documents into samples of that many tokens)."""
    dtype = "uint32" if packing else tok.dtype
    writers = {split: _ShardWriter(staging, split, shard_tokens, tok, dtype) for split in ("train", "val")}
    sinks = {split: chat.Packer(w, packing, tok.eos_id) if packing else w for split, w in writers.items()}
    tokens = 0
    executor = _executor(workers, initargs)
    try:
        for done, result in enumerate(ordered_map(executor, tokenize_unit, units, window=4 * workers), 1):
            for split, documents in result.tokens.items():
                for document in documents:
                    sinks[split].add(document)
                    tokens += document.size
            if on_progress:
                on_progress(done, len(units), tokens)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
    for sink in sinks.values():
        sink.flush()
    return writers, sinks
