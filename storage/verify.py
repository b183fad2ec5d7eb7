"""`archipelago verify DIR`: check a dataset's manifest and every shard, and name each bad shard.

For every shard: the file exists, its header agrees with the manifest (magic, dtype, token count,
tokenizer), its size is right, the crc32 of its payload matches, and no token id reaches the
vocabulary size. Shards are checked in parallel threads (reading and crc32 release the GIL);
datasets in object storage are read through pyarrow.fs.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError, DataError
from storage.fs import Location
from storage.shards import Manifest, ShardInfo, open_shard, payload_problem, read_manifest


@dataclass(frozen=True, slots=True)
class ShardProblem:
    shard: str
    """Where: the shard's location."""
    problem: str
    """What is wrong, with the byte offset where that can be known."""


@dataclass(slots=True)
class VerifyReport:
    directory: str
    shards: int = 0
    tokens: int = 0
    bytes: int = 0
    problems: list[ShardProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(directory: str | Path | Location, *, manifest: Manifest | None = None, threads: int = 8,
                   on_shard: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Checks everything; a manifest that cannot be read at all raises DataError.

    `manifest`: the directory's manifest when the caller has read it already (read here otherwise).
    """
    if threads < 1:
        raise ConfigError(f"must be 1 or more, got {threads}", where="--threads / [data] reader_threads",
                          fix="give the number of shards to check at once, e.g. 8")
    location = Location.parse(directory, error=DataError)
    manifest = manifest if manifest is not None else read_manifest(location)
    report = VerifyReport(str(location), shards=len(manifest.shards))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="archipelago-verify") as pool:
        futures = [pool.submit(verify_shard, location, shard, manifest.vocab_size, manifest.token_flags) for shard in manifest.shards]
        for done, (shard, future) in enumerate(zip(manifest.shards, futures), 1):
            problem = future.result()
            if problem:
                report.problems.append(problem)
            else:
                report.tokens += shard.num_tokens
                report.bytes += shard.file_bytes
            if on_shard:
                on_shard(done, len(futures))
    return report


def verify_shard(location: Location, shard: ShardInfo, vocab_size: int, flagged: bool = False) -> ShardProblem | None:
    path = location / shard.path
    try:
        with open_shard(location, shard) as f:
            problem = payload_problem(f, shard, vocab_size, flagged=flagged)
    except DataError as e:
        return ShardProblem(str(path), f"{e.what} ({e.where.removeprefix(str(path)).lstrip(', ') or 'file'})")
    return ShardProblem(str(path), problem) if problem else None
