"""Safetensors files read through archipelago's range readers: with kvikio straight into GPU memory
where it can, as checkpoints are read, instead of through the safetensors library's host copies.

    headers = read_header("model/model-00001-of-00002.safetensors")   # {name: StoredTensor}, header only
    with TensorReads("model", device, reader="auto") as reads:
        rows = reads.rows(headers["model.embed_tokens.weight"], 0, 1024)  # rows [0, 1024) on `device`
        reads.copy_into(stored, target, offsets, lengths)                  # a slice straight into a tensor

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}} plus an optional "__metadata__"), then the tensors' bytes, each row-major and
contiguous: rows [a, b) of a tensor are one byte range, which is what a rank reading its FSDP2 shard
(dim 0) of a parameter needs. The header is checked against the file's size before any read, so a
truncated download is one error naming the file, not a short read deep inside a load.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from core.errors import ConfigError, DataError
from storage.fs import Location
from storage.readers import Extent, RangeReader, ReaderKind, choose_reader

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100 * 2**20
"""The safetensors format's own limit on the JSON header."""
WHERE = "[model] hf_dir"
REFETCH = "download the checkpoint again (the file is truncated or not a safetensors file)"


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    path: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's first element in the file."""

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (the whole tensor for a scalar)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def extent(self, first: int, last: int) -> Extent:
        """The byte range of rows [first, last), landing at the start of a buffer."""
        return Extent(self.path, self.offset + first * self.row_bytes, (last - first) * self.row_bytes, 0)


def read_header(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, from its header alone; ConfigError for a damaged file."""
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise _damaged(path, f"its header length ({length} bytes) does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _damaged(path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    data_start = 8 + length
    return {name: _stored(path, name, entry, data_start, size)
            for name, entry in header.items() if name != "__metadata__"}


def _stored(path: str, name: str, entry: Any, data_start: int, size: int) -> StoredTensor:
    try:
        dtype, (begin, end) = DTYPES[entry["dtype"]], entry["data_offsets"]
        shape = tuple(int(n) for n in entry["shape"])
    except (KeyError, TypeError, ValueError):
        raise _damaged(path, f"tensor {name!r} has a header entry archipelago cannot read ({str(entry)[:120]}; "
                             f"dtypes it reads: {', '.join(DTYPES)})") from None
    if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or data_start + end > size:
        raise _damaged(path, f"tensor {name!r} ({entry['dtype']} {list(shape)}) claims bytes [{begin}, {end}) of "
                             f"a data section of {size - data_start}")
    return StoredTensor(path, name, dtype, shape, data_start + begin)


def _damaged(path: str, what: str) -> ConfigError:
    return ConfigError(f"{path} is not a readable safetensors file: {what}", where=WHERE, fix=REFETCH)


class TensorReads:
    """Reads rows of the tensors stored in `directory`'s files into `device` memory, one reader for all.

    On a CUDA device the reader is kvikio where it can run (`reader = "auto"`), reading into GPU
    memory with no host copy; otherwise the POSIX reader into host memory, copied over once. Close it
    (or use it as a context manager) to close the files it opened."""

    def __init__(self, directory: str | Path, device: torch.device | str, *, reader: ReaderKind = "auto",
                 threads: int = 8):
        self.device = torch.device(device)
        self.reader: RangeReader = choose_reader(reader, Location.parse(directory, error=ConfigError), self.device,
                                                 threads=threads, setting="[checkpoint] reader",
                                                 error=ConfigError).reader

    @property
    def kind(self) -> str:
        """"kvikio" or "posix": what the reads went through, for the run's log."""
        return self.reader.kind

    def rows(self, stored: StoredTensor, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of `stored`, in its own dtype, on this reader's device."""
        out = self._buffer((last - first) * stored.row_bytes)
        self._read(stored.extent(first, last), out)
        shaped = out.view(stored.dtype).reshape((last - first, *stored.shape[1:]) if stored.shape else ())
        return shaped.to(self.device, non_blocking=True)

    def copy_into(self, stored: StoredTensor, target: torch.Tensor, offsets: Sequence[int],
                  lengths: Sequence[int]) -> None:
        """`target` = the slice of `stored` that starts at `offsets` and is `lengths` long in each dim:
        read straight into `target`'s bytes when it is a whole-rows slice of the same dtype on the
        reader's side, else through a buffer of the rows it spans."""
        if not stored.shape:
            target.copy_(self.rows(stored, 0, 1))
            return
        first, last = offsets[0], offsets[0] + lengths[0]
        if self._direct(stored, target, offsets, lengths):
            self._read(stored.extent(first, last), target.view(-1).view(torch.uint8))
            return
        rows = self.rows(stored, first, last)
        for dim in range(1, len(stored.shape)):
            rows = rows.narrow(dim, offsets[dim], lengths[dim])
        target.copy_(rows)

    def _direct(self, stored: StoredTensor, target: torch.Tensor, offsets: Sequence[int],
                lengths: Sequence[int]) -> bool:
        whole_rows = all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], stored.shape[1:], strict=True))
        lands = target.device.type == ("cuda" if self.reader.into_cuda else "cpu")
        return whole_rows and lands and target.dtype == stored.dtype and target.is_contiguous()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.reader.into_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _read(self, extent: Extent, into: torch.Tensor) -> None:
        try:
            self.reader.read([extent], into if self.reader.into_cuda else into.numpy()).wait()
        except DataError as e:  # the readers speak of datasets; this is a model directory's file
            raise ConfigError(f"reading {extent.path} failed ({e.what})", where=WHERE, fix=REFETCH) from None

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> TensorReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsStorageReader(HuggingFaceStorageReader):
    """torch.distributed.checkpoint's Hugging Face reader (DCP plans which slice of which file each
    rank's shards need), with the slices read through `reads` instead of the safetensors library:
    straight into the destination shards, into GPU memory with kvikio where it runs."""

    def __init__(self, directory: str | Path, reads: TensorReads):
        super().__init__(str(directory))
        self.reads = reads
        self._headers: dict[str, dict[str, StoredTensor]] = {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            if path not in self._headers:
                self._headers[path] = read_header(path)
            target = planner.resolve_tensor(item).detach()
            stored = self._headers[path][item.storage_index.fqn]
            self.reads.copy_into(stored, target, item.storage_offsets, item.lengths)
            planner.commit_tensor(item, target)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future
