"""Elastic deterministic sampler: which samples every rank trains on at every step.

The global sample order is a function of (seed, epoch) alone: position g of the endless stream
is sample `permute(seed, g // N, g % N)` of a split with N samples, where `permute` is a keyed
bijection of [0, N) (below). A training step consumes the next `global_batch` positions; inside
a step each rank takes one contiguous block, cut into its own micro-batches — heterogeneous
workers may have different micro-batch sizes and different accumulation counts.

The only state is `consumed`, the number of positions used by committed steps: it goes into
every checkpoint, and after a restart (with any world size or micro-batches) training continues
at exactly the next position, so no sample is skipped or repeated and nothing is padded.

The permutation is a Feistel network on the smallest even power of two ≥ N, walked in cycles
until it lands inside [0, N) (format-preserving encryption's "cycle walking"): O(1) memory and
O(1) time per position, for any N — a billion-sample split needs no 8 GB index per worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from core.plan import BatchLayout

SAMPLER_NAME = "feistel-v1"
"""Recorded in checkpoints: a checkpoint made with another sampler would not resume at the same samples."""
_ROUNDS = 4
"""Luby–Rackoff: four rounds of a keyed pseudo-random function make a strong pseudo-random permutation."""
_MASK64 = 2**64 - 1
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit mix where every input bit moves every output bit."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


class DeterministicSampler:
    def __init__(self, num_samples: int, seed: int):
        if num_samples <= 0:
            raise ValueError("num_samples must be positive")
        self.num_samples = num_samples
        self.seed = seed
        half_bits = max(1, (int(num_samples - 1).bit_length() + 1) // 2)
        self._half = np.uint64(half_bits)
        self._mask = np.uint64((1 << half_bits) - 1)
        self._keys_epoch, self._keys = -1, np.empty(0, dtype=np.uint64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The whole order of one epoch (O(N) memory: for tests and small splits)."""
        return self.permute(epoch, np.arange(self.num_samples, dtype=np.int64))

    def permute(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        """Sample ids at `offsets` (each in [0, N)) of epoch `epoch`'s order."""
        keys = self._round_keys(epoch)
        out = self._feistel(np.asarray(offsets, dtype=np.uint64), keys)
        walking = out >= self.num_samples
        while walking.any():  # cycle walking: at most 4 domain elements per id on average
            out[walking] = self._feistel(out[walking], keys)
            walking = out >= self.num_samples
        return out.astype(np.int64)

    def _round_keys(self, epoch: int) -> np.ndarray:
        if self._keys_epoch != epoch:
            self._keys, self._keys_epoch = self._derive_keys(epoch), epoch
        return self._keys

    def _derive_keys(self, epoch: int) -> np.ndarray:
        seed = _mix(np.array([self.seed & _MASK64], dtype=np.uint64) + _GOLDEN)
        epoch_key = _mix(seed + np.array([epoch & _MASK64], dtype=np.uint64) * _GOLDEN + _GOLDEN)
        return _mix(epoch_key + np.arange(1, _ROUNDS + 1, dtype=np.uint64) * _GOLDEN)

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def samples_at(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions [start, start + count), crossing epochs as needed."""
        first, last = divmod(start, self.num_samples)[0], divmod(start + count - 1, self.num_samples)[0]
        if first == last:  # the common case: the whole range lies in one epoch
            return self.permute(first, np.arange(start, start + count, dtype=np.int64) - first * self.num_samples)
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self.permute(int(epoch), offsets[here])
        return out

    def rank_micro_batches(self, consumed: int, layout: BatchLayout, rank: int) -> list[np.ndarray]:
        """The sample ids rank `rank` trains on, one array per micro-batch, for the step starting at `consumed`."""
        size, accum = layout.micro_batch_sizes[rank], layout.accum_steps[rank]
        block = self.samples_at(consumed + layout.rank_offset(rank), size * accum)
        return [block[a * size:(a + 1) * size] for a in range(accum)]

    def steps(self, consumed: int, layout: BatchLayout, rank: int) -> Iterator[list[np.ndarray]]:
        """Rank `rank`'s micro-batches for every step from stream position `consumed` on, endlessly."""
        while True:
            yield self.rank_micro_batches(consumed, layout, rank)
            consumed += layout.global_batch

    def epoch_of(self, consumed: int) -> int:
        return consumed // self.num_samples
