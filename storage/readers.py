"""Readers: move byte ranges of files into memory, behind one interface.

    reader = choose_reader("auto", dataset.location, device).reader
    reader.read(extents, buffer).wait()

Three kinds:
- `kvikio`: `CuFile.pread` straight into a CUDA buffer (GPUDirect Storage where the driver has it,
  kvikio's own threaded POSIX path otherwise). Needs kvikio, a GPU and libcuda.
- `posix`: `os.preadv` from a thread pool into host memory (pinned, when a GPU copy follows).
- `remote`: byte-range reads through pyarrow.fs (S3, GCS, HDFS, ...) from a thread pool.

`choose_reader` picks one and says why, so every run can report what it read with; a config can
force a kind, and an impossible choice is an error that names the reason and the setting to change.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from core.errors import ArchipelagoError, DataError
from storage.fs import Location

ReaderKind = Literal["auto", "kvikio", "posix", "remote"]
TASK_BYTES = 4 * 2**20
"""Large extents are cut into pieces of this size so several threads read one file at once."""
MIN_TASK_BYTES = 256 * 2**10
"""Small extents (single samples) are grouped into tasks of at least this many bytes."""


class Extent(NamedTuple):
    """One contiguous byte range of a file, and where it lands in the destination buffer."""

    path: str
    file_offset: int
    nbytes: int
    buffer_offset: int


class PendingRead:
    """Reads in flight; `wait()` returns once every byte landed, or raises the first error."""

    def __init__(self, waits: Sequence[Callable[[], None]]):
        self._waits = list(waits)

    def wait(self) -> None:
        errors = []
        for wait in self._waits:  # wait for all, even after an error, so no read outlives its buffer
            try:
                wait()
            except Exception as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        self._waits = []
        if errors:
            raise errors[0]


class RangeReader(ABC):
    kind: str
    into_cuda: bool
    """True when `read` fills CUDA memory (kvikio); host readers fill numpy uint8 arrays."""

    @abstractmethod
    def read(self, extents: Sequence[Extent], buffer: Any) -> PendingRead:
        """Starts reading every extent into `buffer[buffer_offset : buffer_offset + nbytes]`."""

    def close(self) -> None:
        """Closes open files; the reader can still be used (files are opened again on demand)."""


def short_read(path: str, offset: int, wanted: int, got: int) -> DataError:
    return DataError(f"short read: wanted {wanted} bytes, the file ended after {got}",
                     where=f"{path}, offset {offset}",
                     fix="the file is truncated or was replaced while in use; run `archipelago verify` on the dataset")


def plan_tasks(extents: Sequence[Extent], threads: int) -> list[list[Extent]]:
    """Cuts large extents into TASK_BYTES pieces and packs small ones, so `threads` threads share the work."""
    pieces = []
    for e in extents:
        for start in range(0, e.nbytes, TASK_BYTES):
            n = min(TASK_BYTES, e.nbytes - start)
            pieces.append(Extent(e.path, e.file_offset + start, n, e.buffer_offset + start))
    total = sum(p.nbytes for p in pieces)
    target = max(MIN_TASK_BYTES, -(-total // max(1, threads)))
    tasks: list[list[Extent]] = []
    filled = target
    for piece in pieces:
        if filled >= target:
            tasks.append([])
            filled = 0
        tasks[-1].append(piece)
        filled += piece.nbytes
    return tasks


class _ThreadedHostReader(RangeReader):
    into_cuda = False

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"archipelago-{self.kind}")
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()

    def read(self, extents: Sequence[Extent], buffer: np.ndarray) -> PendingRead:
        view = memoryview(buffer).cast("B")
        futures = [self._pool.submit(self._read_task, task, view) for task in plan_tasks(extents, self.threads)]
        return PendingRead([f.result for f in futures])

    def _file(self, path: str) -> Any:
        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                try:
                    handle = self._files[path] = self._open(path)
                except FileNotFoundError:
                    raise DataError("file is missing", where=path,
                                    fix="restore the file, or prepare the dataset again") from None
            return handle

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for handle in files.values():
            self._close(handle)

    @abstractmethod
    def _open(self, path: str) -> Any: ...

    @abstractmethod
    def _close(self, handle: Any) -> None: ...

    @abstractmethod
    def _read_task(self, task: list[Extent], view: memoryview) -> None: ...


class PosixReader(_ThreadedHostReader):
    """`os.preadv` from a thread pool (the GIL is released during each read)."""

    kind = "posix"

    def _open(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def _close(self, fd: int) -> None:
        os.close(fd)

    def _read_task(self, task: list[Extent], view: memoryview) -> None:
        for path, offset, nbytes, dest in task:
            fd = self._file(path)
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [view[dest + done:dest + nbytes]], offset + done)
                if got == 0:
                    raise short_read(path, offset, nbytes, done)
                done += got


class RemoteReader(_ThreadedHostReader):
    """Byte-range reads through a pyarrow.fs filesystem (one ranged GET per piece on object stores)."""

    kind = "remote"

    def __init__(self, location: Location, threads: int):
        self.location = location
        super().__init__(threads)

    def _open(self, path: str) -> Any:
        return self.location.fs.open_input_file(path)

    def _close(self, handle: Any) -> None:
        handle.close()

    def _read_task(self, task: list[Extent], view: memoryview) -> None:
        for path, offset, nbytes, dest in task:
            data = self._file(path).read_at(nbytes, offset)
            if len(data) != nbytes:
                raise short_read(path, offset, nbytes, len(data))
            view[dest:dest + nbytes] = data


class KvikioReader(RangeReader):
    """`kvikio.CuFile.pread` into CUDA memory; kvikio splits and parallelises each read itself."""

    kind = "kvikio"
    into_cuda = True

    def __init__(self, threads: int):
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        if threads and kvikio.defaults.get("num_threads") != threads:
            kvikio.defaults.set("num_threads", threads)
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()

    def read(self, extents: Sequence[Extent], buffer: Any) -> PendingRead:
        flat = buffer.detach().view(-1)
        waits = []
        for path, offset, nbytes, dest in extents:
            future = self._file(path).pread(flat[dest:dest + nbytes], nbytes, offset)
            waits.append(functools.partial(_wait_kvikio, future, path, offset, nbytes))
        return PendingRead(waits)

    def _file(self, path: str) -> Any:
        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                if not os.path.exists(path):
                    raise DataError("file is missing", where=path,
                                    fix="restore the file, or prepare the dataset again")
                handle = self._files[path] = self._kvikio.CuFile(path, "r")
            return handle

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for handle in files.values():
            handle.close()

    @staticmethod
    def mode() -> str:
        """"gds" when reads go through GPUDirect Storage, "compat" when through kvikio's POSIX threads."""
        import kvikio.defaults

        return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"


def _wait_kvikio(future: Any, path: str, offset: int, nbytes: int) -> None:
    got = future.get()
    if got != nbytes:
        raise short_read(path, offset, nbytes, got)


@functools.cache
def kvikio_unavailable() -> str | None:
    """None when kvikio can read into this process's GPU; otherwise the reason it cannot.

    Probed with a real 4 KiB read: `import kvikio` succeeds on machines without libcuda, but
    every read needs it.
    """
    try:
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"kvikio is not installed ({e.name or e}); install the gpu extra: pip install 'archipelago[gpu]'"
    except OSError as e:
        return f"kvikio cannot load its library ({e})"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device in this process"
    try:
        with tempfile.NamedTemporaryFile(prefix="archipelago-kvikio-probe-") as f:
            f.write(bytes(range(256)) * 16)
            f.flush()
            probe = KvikioReader(threads=0)
            buffer = torch.zeros(4096, dtype=torch.uint8, device="cuda")
            probe.read([Extent(f.name, 0, 4096, 0)], buffer).wait()
            probe.close()
            if buffer[:256].tolist() != list(range(256)):
                return "kvikio read returned wrong bytes"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use kvikio here
        return f"kvikio cannot read here ({type(e).__name__}: {e})"
    return None


@dataclass(frozen=True, slots=True)
class ReaderChoice:
    reader: RangeReader
    reason: str
    """Why this kind was chosen, for the run's log: "kvikio (gds)", "posix (kvikio: no CUDA device ...)"."""

    def __str__(self) -> str:
        return self.reason


def choose_reader(kind: ReaderKind, location: Location, device: Any, *, threads: int = 8, small_reads: bool = False,
                  setting: str = "[data] reader", error: type[ArchipelagoError] = DataError) -> ReaderChoice:
    """The reader for `location` read into `device` (a torch.device); `kind` "auto" decides by itself.

    `setting` is the config field `kind` came from and `error` the error type of an impossible
    choice: `[data] reader` and DataError for datasets, `[checkpoint] reader` and CheckpointError
    for checkpoints.

    `small_reads` (training samples, a few KiB each): without GPUDirect Storage, kvikio reads through
    a bounce buffer and copies each read to the GPU on its own, so many small reads are faster
    through the POSIX reader, which lands a whole step in pinned memory and copies it once (measured
    on an H200: 2.2 vs 1.0 ms for 64 samples of 2049 tokens; benchmarks/RESULTS.md). Bulk reads
    (checkpoints, whole shards) stay on kvikio, which is faster there in either mode.
    """
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    if kind == "remote" or (kind == "auto" and not location.is_local):
        return ReaderChoice(RemoteReader(location, threads), f"remote (pyarrow.fs {location.fs.type_name})")
    if not location.is_local:
        raise error(f"the {kind} reader needs files on a local or mounted filesystem", where=str(location),
                    fix=f'set {setting} = "remote" or "auto" for files in object storage')
    if kind == "posix":
        return ReaderChoice(PosixReader(threads), "posix (forced by config)")
    why_not = "the workers have no GPU" if not on_cuda else kvikio_unavailable()
    if why_not is None and (kind == "kvikio" or not small_reads or KvikioReader.mode() == "gds"):
        return ReaderChoice(KvikioReader(threads), f"kvikio ({KvikioReader.mode()})")
    if why_not is None:
        return ReaderChoice(PosixReader(threads), "posix (kvikio runs without GPUDirect Storage here, and then "
                                                  "sample-sized reads are faster through pinned memory)")
    if kind == "kvikio":
        raise error(f"the kvikio reader cannot run: {why_not}", where=setting,
                    fix=f'set {setting} = "auto" to fall back to the POSIX reader')
    return ReaderChoice(PosixReader(threads), f"posix (kvikio: {why_not})")


def host_reader_for(location: Location, threads: int = 4) -> RangeReader:
    """A reader into host memory: POSIX for local files, pyarrow.fs for anything else."""
    return PosixReader(threads) if location.is_local else RemoteReader(location, threads)
