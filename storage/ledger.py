"""The sample ledger: the global sample ids of every committed step, kept inside each checkpoint.

    ledger = SampleLedger.from_bytes(data) if data else SampleLedger()   # what the restored checkpoint holds
    ledger.record(step, ids)                  # the step's ids, every replica's block in stream order
    extra = {LEDGER_FILE: ledger.to_bytes()}  # saved with the checkpoint of `step`
    ledger.check_exactly_once(num_samples)    # every sample once per epoch, no step missing or twice

Why inside the checkpoint: a step counts only once the checkpoint that contains it is committed
(`.metadata` is written last, after the ledger), and a restart resumes from that checkpoint and
continues its ledger. So the ledger of the final checkpoint lists exactly the steps that
survived every failure, resize and preemption, with the samples each one really trained on —
steps trained and then lost to a failure are not in it, and their samples must appear again in
the redone steps. It grows by 8 bytes per sample trained: meant for tests and audits (`[elastic]
sample_ledger`), not for billion-sample runs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np

LEDGER_FILE = "ledger.npz"
"""The ledger's name inside a checkpoint directory (written before `.metadata`)."""


class LedgerError(ValueError):
    """The ledger shows a step missing or twice, or a sample lost or repeated."""


@dataclass
class SampleLedger:
    steps: list[int] = field(default_factory=list)
    """Committed optimizer steps, 1, 2, … in order."""
    ids: list[np.ndarray] = field(default_factory=list)
    """ids[i]: the global sample ids of steps[i], in stream order (replica 0's block first)."""

    def record(self, step: int, ids: np.ndarray) -> None:
        expected = self.steps[-1] + 1 if self.steps else 1
        if step != expected:
            raise LedgerError(f"step {step} recorded after step {expected - 1}: the ledger would have a gap or a "
                              "step twice")
        self.steps.append(step)
        self.ids.append(np.asarray(ids, dtype=np.int64))

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        sizes = np.array([len(i) for i in self.ids], dtype=np.int64)
        flat = np.concatenate(self.ids) if self.ids else np.empty(0, dtype=np.int64)
        np.savez(buffer, steps=np.array(self.steps, dtype=np.int64), sizes=sizes, ids=flat)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> SampleLedger:
        with np.load(io.BytesIO(data)) as arrays:
            steps, sizes, flat = arrays["steps"], arrays["sizes"], arrays["ids"]
        return cls([int(s) for s in steps], list(np.split(flat, np.cumsum(sizes)[:-1])) if len(sizes) else [])

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    def stream(self) -> np.ndarray:
        """Every committed sample id in training order."""
        return np.concatenate(self.ids) if self.ids else np.empty(0, dtype=np.int64)

    def check_exactly_once(self, num_samples: int) -> None:
        """Raises LedgerError unless the steps run 1 … last without a gap and each full epoch of the
        committed stream holds every sample id of [0, num_samples) exactly once (a partial last epoch:
        no id twice)."""
        if self.steps != list(range(1, len(self.steps) + 1)):
            raise LedgerError(f"committed steps are not 1 … {len(self.steps)} in order")
        stream = self.stream()
        for start in range(0, len(stream), num_samples):
            epoch = stream[start:start + num_samples]
            counts = np.bincount(epoch, minlength=num_samples)
            if counts.max(initial=0) > 1:
                twice = np.flatnonzero(counts > 1)
                raise LedgerError(f"epoch {start // num_samples}: {len(twice)} samples trained more than once "
                                  f"(first: id {twice[0]})")
            if len(epoch) == num_samples and counts.min() == 0:
                missing = np.flatnonzero(counts == 0)
                raise LedgerError(f"epoch {start // num_samples}: {len(missing)} samples never trained "
                                  f"(first: id {missing[0]})")
