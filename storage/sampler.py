"""Deterministic sampler: which samples every rank trains on at every step.

The global sample order is a function of (seed, epoch) alone: position g of the endless stream
is sample `permutation(seed, g // N)[g % N]` of a split with N samples. A training step consumes
the next `global_batch` positions; inside a step the positions are laid out micro-step by
micro-step, rank by rank, with each rank's own micro-batch size (heterogeneous workers may differ).

The only state is `consumed`, the number of positions used by committed steps: it goes into
every checkpoint, and after a restart (with any world size or micro-batches) training continues
at exactly the next position, so no sample is skipped or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """How one optimizer step's samples are split: micro_batch_sizes[r] per rank r, accum_steps times."""

    micro_batch_sizes: tuple[int, ...]
    accum_steps: int

    @property
    def global_batch(self) -> int:
        return sum(self.micro_batch_sizes) * self.accum_steps

    @classmethod
    def uniform(cls, world_size: int, micro_batch_size: int, accum_steps: int) -> BatchLayout:
        return cls((micro_batch_size,) * world_size, accum_steps)


class DeterministicSampler:
    def __init__(self, num_samples: int, seed: int):
        if num_samples <= 0:
            raise ValueError("num_samples must be positive")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._order

    def samples_at(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions [start, start + count), crossing epochs as needed."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(start + filled, self.num_samples)
            take = min(count - filled, self.num_samples - offset)
            out[filled:filled + take] = self.permutation(epoch)[offset:offset + take]
            filled += take
        return out

    def rank_micro_batches(self, consumed: int, layout: BatchLayout, rank: int) -> list[np.ndarray]:
        """The sample ids rank `rank` trains on, one array per micro-step, for the step starting at `consumed`."""
        per_micro_step = sum(layout.micro_batch_sizes)
        rank_offset = sum(layout.micro_batch_sizes[:rank])
        size = layout.micro_batch_sizes[rank]
        return [self.samples_at(consumed + a * per_micro_step + rank_offset, size) for a in range(layout.accum_steps)]

    def epoch_of(self, consumed: int) -> int:
        return consumed // self.num_samples
