"""Checkpoint IO: torch.distributed.checkpoint (DCP) with raw, 4 KiB-aligned tensor bytes, on any storage.

    store = CheckpointStore("runs/cpu-tiny")                    # or "s3://bucket/runs/cpu-tiny?endpoint_override=..."
    pending = save_checkpoint(state, store.step(300), extra={"archipelago.json": info}, async_save=True)
    ...                                                         # training goes on while the files are written
    pending.result()                                            # the step is committed
    load_checkpoint(state, store.latest(), reader="auto")       # into GPU tensors with kvikio where it can

Layout of a committed step directory (`step_00000300/`):
- `archipelago.json` (and any other `extra` file), written first by the coordinator;
- `__<rank>_<k>.distcp`, each rank's data: every tensor's raw bytes on a 4 KiB boundary, so a
  loader reads them with one aligned read straight into the destination tensor (GPUDirect
  Storage needs the alignment); small objects (pickled) in between;
- `.metadata`, DCP's index, written last, by the coordinator, after every rank's data is durable
  (DCP gathers every rank's write results before `finish`) — through a temporary name and a
  rename on local disks, as one upload on object stores. A step counts as committed exactly
  when `.metadata` exists; a step without it is a save that crashed, ignored by `latest()` and
  removed by `remove_uncommitted()`.

DCP reshards at load time: the index says which chunk of which tensor is where, so a checkpoint
saved by N ranks loads on M. When a destination is exactly a contiguous byte range of a saved
chunk (always for replicated DDP state; for FSDP shards split along the first dimension), the
bytes are read straight into the destination — with kvikio into GPU memory. Other reshards read
the chunk to host memory and copy the overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pickle
import re
import uuid
import warnings
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from core.errors import ArchipelagoError, CheckpointError, DataError
from storage.fs import Location
from storage.loader import read_to_device
from storage.readers import Extent, RangeReader, ReaderKind, choose_reader, host_reader_for

DCP_METADATA = ".metadata"
ALIGN = 4096
STEP_PATTERN = re.compile(r"step_(\d{8,})$")
DAMAGED_FIX = "run again with --resume: it checks each committed step and resumes from the newest intact one"
CHECKSUMS = "checksums.json"
"""Every file of a step but `.metadata` with its size and crc32, written just before `.metadata`."""
_FILE_SUM = "archipelago-file-sum:"
"""Index prefix of the write results that carry a data file's checksum from its rank to the coordinator."""
DAMAGED_SUFFIX = ".damaged"
"""A committed step found damaged is moved to `step_XXXXXXXX.damaged` (then `.damaged-2`, …): kept, never loaded."""
# DCP warns on every single-process save and load (also from async saves' threads); here that is a
# deliberate mode, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ---- the store: committed steps of one run ----------------------------------------------------------------------

class CheckpointStore:
    """The checkpoints of one run: `<root>/step_XXXXXXXX/`, on local disk or any pyarrow.fs URI."""

    def __init__(self, root: str | Path | Location):
        self.root = Location.parse(root, error=CheckpointError)

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.root)!r})"

    def step(self, step: int) -> Location:
        return self.root / step_dir_name(step)

    def steps(self) -> list[tuple[int, Location]]:
        """Every step directory, committed or not, oldest first."""
        found = []
        for child in self.root.children():
            match = STEP_PATTERN.match(child.name)
            if match:
                found.append((int(match.group(1)), child))
        return sorted(found, key=lambda s: s[0])

    def committed(self) -> list[tuple[int, Location]]:
        return [(step, where) for step, where in self.steps() if is_committed(where)]

    def latest(self) -> Location | None:
        found = self.committed()
        return found[-1][1] if found else None

    def remove_uncommitted(self) -> list[Location]:
        """Deletes the step directories of saves that never committed (a crash mid-save); returns them."""
        removed = [where for _, where in self.steps() if not is_committed(where)]
        for where in removed:
            where.remove()
        return removed

    def newest_intact(self) -> tuple[Location | None, list[DamagedStep]]:
        """The newest committed step whose files are as they were written (`step_damage`), and the newer ones that
        are not: each moved aside to `step_XXXXXXXX.damaged` (kept for a look, never loaded), with what is wrong."""
        damaged = []
        for step, where in reversed(self.committed()):
            problem = step_damage(where)
            if problem is None:
                return where, damaged
            damaged.append(DamagedStep(step, problem, self._set_aside(where)))
        return None, damaged

    def _set_aside(self, where: Location) -> Location:
        names = (f"{where.name}{DAMAGED_SUFFIX}{'' if n == 1 else f'-{n}'}" for n in range(1, 1_000_000))
        target = next(where.parent / name for name in names if not (where.parent / name).exists())
        where.move_to(target)
        return target

    def prune(self, keep_last: int) -> list[Location]:
        """Deletes all but the newest `keep_last` committed steps; returns what it deleted."""
        old = [where for _, where in self.committed()[:-keep_last or None]] if keep_last > 0 else []
        for where in old:
            where.remove()
        return old


def is_committed(step_dir: str | Path | Location) -> bool:
    return (Location.parse(step_dir, error=CheckpointError) / DCP_METADATA).is_file()


@dataclass(frozen=True, slots=True)
class DamagedStep:
    step: int
    problem: str
    """What is wrong, naming the file."""
    moved_to: Location


def step_damage(step_dir: str | Path | Location) -> str | None:
    """What is wrong with a committed step, or None: `.metadata` unpickles, every file it names is in checksums.json,
    and every file there has the size and crc32 it was written with (each file read once). A step saved before
    checksums.json existed is held to its `.metadata` and the sizes of the files it names."""
    location = Location.parse(step_dir, error=CheckpointError)
    try:
        metadata = RawReader(location).read_metadata()
    except CheckpointError as e:
        return e.what
    if not (location / CHECKSUMS).is_file():
        return _short_file(location, metadata)
    try:
        sums = {name: FileSum(**fields) for name, fields in json.loads((location / CHECKSUMS).read_bytes()).items()}
    except (ValueError, TypeError, AttributeError) as e:
        return f"{CHECKSUMS} is unreadable ({e})"
    named = {e.relative_path for e in metadata.storage_data.values() if isinstance(e, RawExtent)}
    if named - set(sums):
        return f"{DCP_METADATA} names {', '.join(sorted(named - set(sums)))}, which {CHECKSUMS} does not list"
    for name, written in sorted(sums.items()):
        found = _file_sum(location / name)
        if found is None:
            return f"{name} is missing"
        if found != written:
            return (f"{name} has {found.bytes} bytes with crc32 {found.crc32:#010x}; it was written as "
                    f"{written.bytes} bytes with crc32 {written.crc32:#010x}")
    return None


def _short_file(location: Location, metadata: Metadata) -> str | None:
    """A data file `.metadata` names that is missing or ends before the last byte it should hold."""
    ends: dict[str, int] = {}
    for extent in metadata.storage_data.values():
        if isinstance(extent, RawExtent):
            ends[extent.relative_path] = max(ends.get(extent.relative_path, 0), extent.offset + extent.length)
    for name, end in sorted(ends.items()):
        found = (location / name).info()
        if found.type == pafs.FileType.NotFound:
            return f"{name} is missing"
        if found.size < end:
            return f"{name} has {found.size} bytes; its tensors end at byte {end}"
    return None


def _file_sum(where: Location) -> FileSum | None:
    try:
        stream = where.fs.open_input_stream(where.path)
    except FileNotFoundError:
        return None
    crc, size = 0, 0
    with stream:
        while chunk := stream.read(16 * 2**20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return FileSum(size, crc)


# ---- writing ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FileSum:
    """A file of a step as it was written: its size and the crc32 of all its bytes (checksums.json)."""

    bytes: int
    crc32: int


@dataclass(frozen=True, slots=True)
class RawExtent:
    """Where one saved item's bytes are: DCP's storage_data for this writer (pickled into `.metadata`)."""

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None
    """torch dtype name for tensors ("bfloat16"); None for pickled objects."""
    shape: tuple[int, ...] | None = None


class RawWriter(StorageWriter):
    """A DCP StorageWriter that writes tensors as raw aligned bytes through `Location` (local or pyarrow.fs)."""

    def __init__(self, location: Location, *, extra: dict[str, bytes] | None = None, threads: int = 4):
        super().__init__()
        self.location = location
        self.extra = extra or {}
        self.threads = threads
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator only, after every rank planned and before any writes: a clean
        # directory, then the extra files, so `.metadata` (written last) implies all of them.
        try:
            self.location.remove()
            self.location.mkdir()
        except OSError as e:
            raise _write_error(e, self.location) from None
        for name, data in self.extra.items():
            with _output(self.location / name) as out:
                out.write(data)
        return [dataclasses.replace(plan, storage_data=f"__{rank}_") for rank, plan in enumerate(plans)]

    def _extra_sums(self) -> dict[str, FileSum]:
        return {name: FileSum(len(data), zlib.crc32(data)) for name, data in self.extra.items()}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        buckets = _balance(plan.items, self.threads)
        names = [f"{plan.storage_data}{k}.distcp" for k in range(len(buckets))]
        with ThreadPoolExecutor(max_workers=max(1, len(buckets)), thread_name_prefix="archipelago-ckpt-w") as pool:
            parts = list(pool.map(lambda nb: self._write_file(nb[0], nb[1], planner), zip(names, buckets)))
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([result for part in parts for result in part])
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Writes one data file; the results are its items' extents and, last, the file's checksum (FileSum), which
        reaches the coordinator's `finish` the way every rank's results do."""
        target = self.location / name
        results, offset, crc = [], 0, 0
        with _output(target) as out:
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    payload, dtype, shape = data.getbuffer(), None, None
                else:
                    tensor = data.detach()
                    tensor = tensor.cpu() if tensor.device.type != "cpu" else tensor
                    tensor = tensor.contiguous()
                    pad = b"\0" * (-offset % ALIGN)
                    out.write(pad)
                    crc = zlib.crc32(pad, crc)
                    offset += len(pad)
                    payload = tensor.reshape(-1).view(torch.uint8).numpy().data
                    dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
                out.write(payload)
                crc = zlib.crc32(payload, crc)
                extent = RawExtent(name, offset, payload.nbytes, dtype, shape)
                results.append(WriteResult(index=item.index, size_in_bytes=payload.nbytes, storage_data=extent))
                offset += payload.nbytes
        return results + [WriteResult(index=MetadataIndex(f"{_FILE_SUM}{name}"), size_in_bytes=offset,
                                      storage_data=FileSum(offset, crc))]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        found = [r for part in results for r in part]
        sums = {r.index.fqn.removeprefix(_FILE_SUM): r.storage_data for r in found if isinstance(r.storage_data, FileSum)}
        metadata.storage_data = {r.index: r.storage_data for r in found if not isinstance(r.storage_data, FileSum)}
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.location), save_id=self.save_id)
        with _output(self.location / CHECKSUMS) as out:  # before .metadata: a committed step has its checksums
            out.write(json.dumps({name: dataclasses.asdict(s) for name, s in {**self._extra_sums(), **sums}.items()},
                                 indent=1, sort_keys=True).encode())
        with _output(self.location / DCP_METADATA) as out:
            pickle.dump(metadata, out)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.location), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class _output:
    """A file written whole or not at all: local files go through a temporary name, fsync and rename;
    object-store uploads become visible only when closed. A full disk, or an upload that failed
    through the object store's retries, is a CheckpointError: the step is not committed (its
    `.metadata` is never written), and no temporary file is left behind on the full disk."""

    def __init__(self, target: Location):
        self.target = target
        self.temporary = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp" if target.is_local else target

    def __enter__(self):
        try:
            if self.target.is_local:
                self.file = open(self.temporary.path, "wb")
            else:
                self.file = self.target.fs.open_output_stream(self.target.path)  # starts the upload
        except OSError as e:
            raise _write_error(e, self.target) from None
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.target.is_local:
                self._close_local(complete=exc_type is None)
            else:
                self.file.close()  # the upload completes (and becomes visible) here
        except OSError as e:
            raise _write_error(e, self.target) from None
        if isinstance(exc, OSError):
            raise _write_error(exc, self.target) from None

    def _close_local(self, complete: bool) -> None:
        """fsync, close and rename into place when complete; otherwise, or when any of that fails (a
        full disk fails the flush at close too), close and remove the temporary file."""
        try:
            if complete:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if complete:
                os.replace(self.temporary.path, self.target.path)
                _fsync_dir(self.target.parent.path)
        except OSError:
            complete = False
            raise
        finally:
            if not complete:
                with contextlib.suppress(OSError):
                    self.file.close()
                Path(self.temporary.path).unlink(missing_ok=True)


def _write_error(e: OSError, target: Location) -> Exception:
    """What a failed checkpoint write says: a full disk, a place it may not write, or a failed upload as a
    CheckpointError (a retry on other workers would fail the same way); an error a retry may not meet (EIO) as is."""
    kept = "the step was not committed and the last committed one is intact"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"cannot write a checkpoint there ({e.strerror}); {kept}", where=str(target),
                               fix="make [checkpoint] storage writable for the workers (its permissions, a read-only "
                                   "mount) or point it elsewhere, then run again with --resume")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(f"no space left to write a checkpoint ({e.strerror}); {kept}", where=str(target),
                               fix="free space there, lower [checkpoint] keep_last or move [checkpoint] storage to "
                                   "a larger disk, then run again with --resume")
    if not target.is_local:
        return CheckpointError(f"the upload failed after the object store's retries ({e}); {kept}",
                               where=str(target), fix="check the object store (endpoint, credentials, quota), "
                                                      "then run again with --resume")
    return e


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _balance(items: Sequence[WriteItem], buckets: int) -> list[list[WriteItem]]:
    """Largest first into the emptiest bucket, so each writing thread gets about the same bytes."""
    sizes = [(_item_bytes(i), n) for n, i in enumerate(items)]
    out: list[list[WriteItem]] = [[] for _ in range(max(1, min(buckets, len(items))))]
    totals = [0] * len(out)
    for size, n in sorted(sizes, reverse=True):
        k = totals.index(min(totals))
        out[k].append(items[n])
        totals[k] += size
    return [sorted(b, key=lambda i: (i.type != WriteItemType.BYTE_IO, str(i.index.fqn))) for b in out if b]


def _item_bytes(item: WriteItem) -> int:
    size = item.tensor_storage_size()
    return size if size is not None else (item.bytes_io_data.nbytes if item.bytes_io_data else 0)


# ---- reading ----------------------------------------------------------------------------------------------------

class RawReader(StorageReader):
    """Reads what RawWriter wrote: straight into destination tensors where the layout allows."""

    def __init__(self, location: Location, *, reader: ReaderKind = "auto", threads: int = 8):
        super().__init__()
        self.location = location
        self.reader_kind = reader
        self.threads = threads
        self.storage_data: dict[MetadataIndex, RawExtent] = {}
        self._cuda: RangeReader | None = None
        self.used: set[str] = set()
        """Kinds of reader this load used ("kvikio", "posix", "remote"), for the run's log."""

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = self.location / DCP_METADATA
        try:
            metadata = pickle.loads(where.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"no {DCP_METADATA}: the save of this step never committed", where=str(self.location),
                                  fix="load an earlier committed step (CheckpointStore.latest() picks one)") from None
        except Exception as e:  # noqa: BLE001 - unpickling damaged bytes raises almost any exception
            metadata = e
        if not isinstance(metadata, Metadata):
            problem = f"{type(metadata).__name__}: {metadata}" if isinstance(metadata, Exception) else \
                f"it holds a {type(metadata).__name__}"
            raise CheckpointError(f"{DCP_METADATA} is unreadable ({problem[:200]})", where=str(where),
                                  fix=DAMAGED_FIX)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        foreign = next((v for v in self.storage_data.values() if not isinstance(v, RawExtent)), None)
        if foreign is not None:
            raise CheckpointError(f"written by another DCP writer ({type(foreign).__name__}), not archipelago's",
                                  where=str(self.location), fix="start a new run, or load it with torch's own reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        host = host_reader_for(self.location, self.threads)
        try:
            for item in (i for i in plan.items if i.type == LoadItemType.BYTE_IO):
                extent = self.storage_data[item.storage_index]
                planner.load_bytes(item, io.BytesIO(self._read_host(host, extent, 0, extent.length).numpy().tobytes()))
            tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
            self._read_tensors(tensors, planner, host)
        except DataError as e:
            # The readers speak of datasets ("verify the dataset"); here a data file of a committed step is
            # truncated or gone, and the step before it is the one to resume from.
            raise CheckpointError(f"the checkpoint step is damaged ({e.what})", where=e.where, fix=DAMAGED_FIX) from None
        finally:
            host.close()
            if self._cuda is not None:
                self._cuda.close()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_tensors(self, items: list[ReadItem], planner: LoadPlanner, host: RangeReader) -> None:
        targets = [planner.resolve_tensor(i).detach() for i in items]
        cuda_direct, host_direct, staged, copied = [], [], [], []
        for item, target in zip(items, targets):
            extent = self.storage_data[item.storage_index]
            span = _direct_span(item, extent, target)
            if span is None:
                copied.append((item, extent, target))
            elif target.device.type == "cpu":
                host_direct.append((extent, span, target))
            else:
                (cuda_direct if self._cuda_reader(target.device).into_cuda else staged).append((extent, span, target))
        read_to_device(host, [(self._extent(e, s), _bytes_of(t)) for e, s, t in host_direct + staged])
        if cuda_direct:
            reader = self._cuda_reader(cuda_direct[0][2].device)
            read_to_device(reader, [(self._extent(e, s), _bytes_of(t)) for e, s, t in cuda_direct])
            self.used.add(reader.kind)
        if host_direct or staged or copied:
            self.used.add(host.kind)
        for item, extent, target in copied:
            chunk = self._read_host(host, extent, 0, extent.length)
            saved = chunk.view(_torch_dtype(extent.dtype)).reshape(extent.shape)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                saved = saved.narrow(dim, start, length)
            target.copy_(saved)
        for item, target in zip(items, targets):
            planner.commit_tensor(item, target)

    def _cuda_reader(self, device: torch.device) -> RangeReader:
        if self._cuda is None:
            self._cuda = choose_reader(self.reader_kind, self.location, device, threads=self.threads,
                                       setting="[checkpoint] reader", error=CheckpointError).reader
        return self._cuda

    def _extent(self, extent: RawExtent, span: tuple[int, int]) -> Extent:
        return Extent((self.location / extent.relative_path).path, extent.offset + span[0], span[1], 0)

    def _read_host(self, host: RangeReader, extent: RawExtent, start: int, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        host.read([self._extent(extent, (start, nbytes))], out.numpy()).wait()
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _direct_span(item: ReadItem, extent: RawExtent, target: torch.Tensor) -> tuple[int, int] | None:
    """(byte offset in the chunk, byte count) when `target` is exactly a contiguous range of the saved chunk."""
    if extent.dtype is None or _torch_dtype(extent.dtype) != target.dtype or not target.is_contiguous():
        return None
    shape, offsets, lengths = extent.shape, list(item.storage_offsets), list(item.lengths)
    if len(shape) == 0:
        return (0, extent.length)
    if any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:])):
        return None  # a slice inside the inner dimensions is not one byte range
    row = target.element_size()
    for size in shape[1:]:
        row *= size
    return (offsets[0] * row, lengths[0] * row)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# ---- save and load ------------------------------------------------------------------------------------------------

class PendingSave:
    """A save in flight (or done); `result()` blocks until the step is committed and re-raises a failure."""

    def __init__(self, location: Location, future: Future | None):
        self.location = location
        self._future = future

    def result(self) -> Location:
        if self._future is not None:
            with _user_errors():
                self._future.result()
            self._future = None
        return self.location


def save_checkpoint(state: dict[str, Any], location: str | Path | Location, *, extra: dict[str, bytes] | None = None,
                    async_save: bool = False, process_group: Any = None, threads: int = 4) -> PendingSave:
    """Saves `state` (a DCP state dict) to `location`; collective when torch.distributed is initialised.

    With `async_save`, the state is copied to host memory now and written by a background thread;
    the caller may change its tensors as soon as this returns. `process_group` must then be one
    whose collectives cannot interleave with training's (a separate gloo group: `checkpoint_group()`).
    """
    location = Location.parse(location, error=CheckpointError)
    writer = RawWriter(location, extra=extra, threads=threads)
    no_dist = not _distributed()
    with _user_errors():
        if not async_save:
            dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
            return PendingSave(location, None)
        response = dcp.async_save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    # torch ≥ 2.9 may answer with an AsyncSaveResponse (staging and upload futures) instead of a Future.
    return PendingSave(location, getattr(response, "upload_completion", response))


def load_checkpoint(state: dict[str, Any], location: str | Path | Location, *, reader: ReaderKind = "auto",
                    process_group: Any = None, threads: int = 8) -> set[str]:
    """Loads a committed step into `state`'s tensors in place; returns the reader kinds used."""
    location = Location.parse(location, error=CheckpointError)
    if not is_committed(location):
        raise CheckpointError(f"not a committed checkpoint (no {DCP_METADATA})", where=str(location),
                              fix="load an earlier committed step; CheckpointStore.latest() picks the newest")
    storage_reader = RawReader(location, reader=reader, threads=threads)
    with _user_errors(loading=location):
        dcp.load(state, storage_reader=storage_reader, process_group=process_group, no_dist=not _distributed())
    return storage_reader.used


def checkpoint_group() -> Any:
    """A gloo group for checkpoint collectives (None without torch.distributed): async saves run their
    collectives on a background thread, which must not share a communicator with training."""
    return dist.new_group(backend="gloo") if _distributed() else None


_ANOTHER_MODEL = ("Size mismatch between saved", "Missing key in checkpoint state_dict")
"""How DCP's load planner words a checkpoint whose tensors are not the model's (torch 2.11–2.13)."""


@contextlib.contextmanager
def _user_errors(*, loading: Location | None = None) -> Iterator[None]:
    """DCP wraps every rank's exception in a CheckpointException; an ArchipelagoError inside comes out as is,
    and so, as a CheckpointError, does a step `loading` whose tensors do not fit the model: no retry of
    the load (Ray's restart after a failure) could change either."""
    try:
        yield
    except CheckpointException as e:
        errors = [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
        for error in errors:
            if isinstance(error, ArchipelagoError):
                raise error from None
        for error in errors:
            if loading is not None and str(error).startswith(_ANOTHER_MODEL):
                raise CheckpointError(f"the checkpoint's tensors do not fit this model or its optimizer: {error}",
                                      where=str(loading),
                                      fix="resume with the model that wrote it (its [model] table or factory), or "
                                          "start a new run: --overwrite, or another name") from None
        raise


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()

