"""The training input pipeline: sample ids in, int64 token tensors on the worker's device out.

    loader = BatchLoader(dataset, choose_reader("auto", dataset.location, device), device)
    batches = loader.stream(sampler.steps(consumed, layout, rank))
    micro_batches = next(batches)          # list of (B_i, seq_len + 1) int64 tensors

`stream` keeps `depth` steps in flight: while step n trains, the reads for step n+1 (and on)
are already running, so workers do not wait on input. Each step's raw tokens land in one of
`depth` buffers ("slots"):

- kvikio: straight into a CUDA slot, then widened to int64 on the compute stream;
- posix/remote with a GPU: into a pinned host slot, copied to a CUDA slot on a side stream,
  and the compute stream waits on that copy's event before widening;
- on a CPU device: into a host slot, widened by numpy.

A slot is reused only after the compute stream has finished widening its previous contents
(a CUDA event recorded after the widening), so a read never overwrites bytes still in use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from storage.readers import Extent, RangeReader, ReaderChoice
from storage.shards import TokenDataset

TORCH_TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
STAGING_BYTES = 64 * 2**20
"""Size of each of the two pinned buffers a host reader's bytes pass through on their way to a GPU."""


@dataclass
class _Slot:
    host: torch.Tensor | None = None
    """Pinned (GPU device) or plain (CPU device) host bytes; None for kvikio."""
    cuda: torch.Tensor | None = None
    """Device bytes on a GPU; None on a CPU device."""
    copied: Any = None
    """CUDA event: the host→device copy of this slot's bytes is done."""
    released: Any = None
    """CUDA event: the compute stream no longer reads this slot."""
    sizes: list[int] = field(default_factory=list)
    """Samples per micro-batch of the step held here."""


class BatchLoader:
    def __init__(self, dataset: TokenDataset, reader: RangeReader | ReaderChoice, device: torch.device,
                 *, depth: int = 2):
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.dataset = dataset
        self.reader = reader.reader if isinstance(reader, ReaderChoice) else reader
        self.reader_choice = str(reader) if isinstance(reader, ReaderChoice) else self.reader.kind
        """What reads the input, and why that one ("kvikio (gds)", "posix (kvikio: no CUDA device ...)")."""
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        if self.reader.into_cuda and not self.on_cuda:
            raise ValueError(f"the {self.reader.kind} reader fills CUDA memory; the device is {self.device}")
        self.depth = depth
        self._slots = [_Slot() for _ in range(depth)]
        self._next_slot = 0
        self._pending: deque[tuple[_Slot, Future]] = deque()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archipelago-loader")
        self._copy_stream = torch.cuda.Stream(self.device) if self.on_cuda and not self.reader.into_cuda else None
        self._token_dtype = TORCH_TOKEN_DTYPES[str(dataset.dtype.newbyteorder("="))]

    def load(self, micro_batches: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Reads one step's micro-batches now (validation, tests)."""
        self.submit(micro_batches)
        return self.next()

    def stream(self, steps: Iterator[Sequence[np.ndarray]]) -> Iterator[list[torch.Tensor]]:
        """Yields each step's micro-batches while reading ahead up to `depth` steps."""
        for _ in range(self.depth):
            self.submit(next(steps))
        while True:
            batches = self.next()
            self.submit(next(steps))
            yield batches

    def submit(self, micro_batches: Sequence[np.ndarray]) -> None:
        if len(self._pending) == self.depth:
            raise RuntimeError(f"{self.depth} steps already in flight: call next() first")
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % self.depth
        ids = [np.asarray(m, dtype=np.int64) for m in micro_batches]
        self._pending.append((slot, self._io.submit(self._fill, slot, ids)))

    def next(self) -> list[torch.Tensor]:
        """The oldest submitted step as int64 tensors on the device (raises the read's DataError)."""
        slot, future = self._pending.popleft()
        future.result()
        per_sample = self.dataset.seq_len + 1
        if not self.on_cuda:
            tokens = slot.host[:sum(slot.sizes) * self.dataset.sample_bytes].numpy().view(self.dataset.dtype)
            flat = torch.from_numpy(tokens.astype(np.int64))
        else:
            stream = torch.cuda.current_stream(self.device)
            if slot.copied is not None:
                stream.wait_event(slot.copied)
            raw = slot.cuda[:sum(slot.sizes) * self.dataset.sample_bytes]
            flat = raw.view(self._token_dtype).to(torch.int64)
            slot.released = torch.cuda.Event()
            slot.released.record(stream)
        return [t.view(n, per_sample) for t, n in zip(flat.split([n * per_sample for n in slot.sizes]), slot.sizes)]

    def discard_ahead(self) -> None:
        """Drops the steps read ahead (waiting for reads in flight): the batch layout changed, and a new
        `stream` begins at the sample after the last step trained."""
        while self._pending:
            _, future = self._pending.popleft()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a read nobody will use; its error does not matter now
                pass

    def close(self) -> None:
        """Waits for reads in flight, then frees the IO thread and the reader's open files."""
        self.discard_ahead()
        self._io.shutdown(wait=True)
        self.reader.close()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self, slot: _Slot, ids: list[np.ndarray]) -> None:
        """Runs on the IO thread: waits until the slot is free, reads into it, starts the device copy."""
        if slot.released is not None:
            slot.released.synchronize()
        slot.sizes = [len(i) for i in ids]
        nbytes = sum(slot.sizes) * self.dataset.sample_bytes
        self._reserve(slot, nbytes)
        extents = self.dataset.extents(np.concatenate(ids)) if nbytes else []
        if self.reader.into_cuda:
            self.reader.read(extents, slot.cuda).wait()
            return
        self.reader.read(extents, slot.host.numpy()).wait()
        self.dataset.check_token_ids(extents, slot.host[:nbytes].numpy().view(self.dataset.dtype))
        if self.on_cuda:
            with torch.cuda.stream(self._copy_stream):
                slot.cuda[:nbytes].copy_(slot.host[:nbytes], non_blocking=True)
                slot.copied = torch.cuda.Event()
                slot.copied.record(self._copy_stream)

    def _reserve(self, slot: _Slot, nbytes: int) -> None:
        size = max(nbytes, 1)
        if self.on_cuda and (slot.cuda is None or slot.cuda.numel() < size):
            slot.cuda = torch.empty(size, dtype=torch.uint8, device=self.device)
        if not self.reader.into_cuda and (slot.host is None or slot.host.numel() < size):
            slot.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.on_cuda)


def read_to_device(reader: RangeReader, reads: Sequence[tuple[Extent, torch.Tensor]]) -> None:
    """Reads each extent into its destination (a contiguous uint8 tensor on any device) and returns when all landed.

    Readers that fill CUDA memory (kvikio) read straight into the destinations. A host reader with
    CUDA destinations reads into one of two pinned buffers while the other is copied to the GPU on a
    side stream; with CPU destinations it reads into them directly. Each extent's buffer_offset is
    ignored: an extent fills its destination from byte 0.
    """
    cuda = [(e, d) for e, d in reads if d.device.type == "cuda"]
    if cuda:
        # These reads bypass CUDA streams: kernels still writing the destinations must finish first.
        torch.cuda.synchronize(cuda[0][1].device)
    if reader.into_cuda:
        pending = [reader.read([e._replace(buffer_offset=0)], d) for e, d in cuda]
    else:
        pending = [reader.read([e._replace(buffer_offset=0)], d.numpy()) for e, d in reads if d.device.type == "cpu"]
        if cuda:
            _staged_copy(reader, cuda)
    for p in pending:
        p.wait()


def _staged_copy(reader: RangeReader, reads: list[tuple[Extent, torch.Tensor]]) -> None:
    size = min(STAGING_BYTES, max(e.nbytes for e, _ in reads))
    device = reads[0][1].device
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    copied: list[torch.cuda.Event | None] = [None, None]
    stream = torch.cuda.Stream(device)
    turn = 0
    for extent, dest in reads:
        for start in range(0, extent.nbytes, size):
            n = min(size, extent.nbytes - start)
            if copied[turn] is not None:
                copied[turn].synchronize()  # the copy out of this buffer is done: it may be refilled
            piece = Extent(extent.path, extent.file_offset + start, n, 0)
            reader.read([piece], buffers[turn].numpy()).wait()
            with torch.cuda.stream(stream):
                dest[start:start + n].copy_(buffers[turn][:n], non_blocking=True)
                copied[turn] = torch.cuda.Event()
                copied[turn].record(stream)
            turn = 1 - turn
    stream.synchronize()
