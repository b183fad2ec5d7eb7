"""The adaptive global batch: it follows the gradient noise scale, and the learning rate follows it.

    policy = BatchPolicy.for_train(config.train)                 # [train] batch_size = "adaptive"
    state = AdaptiveBatch(batch=policy.base_batch)              # or AdaptiveBatch.from_dict(checkpoint's)
    state.measure(small_sq_norm=…, small_batch=…, big_sq_norm=…)  # once a step, with the step's batch
    new = policy.decide(state, batch_choices(policy, plan.replica_micro_batch_sizes()))  # at a log boundary
    lr = schedule.lr_at(policy.progress(consumed_samples)) * policy.lr_multiplier(state)

Why the noise scale: McCandlish et al. 2018 found that the batch beyond which more samples per step
stop buying fewer steps is about B_simple = tr(Σ)/|G|² (core/noise_scale.py), which grows as the
loss falls; Pollux (OSDI'21) trains at the batch the measured noise says is efficient. Below it a
larger batch takes almost proportionally fewer steps (the same samples, fewer, larger and so
cheaper steps); above it, the samples are wasted.

The same law prices a batch (`statistical_efficiency`, Pollux's E(B)): reaching a loss takes
(φ + B) / (φ + base) times the samples at batch B that it takes at `base`, φ the noise scale, so a
sample at B is worth E(B) = (φ + base) / (φ + B) samples at base. The planner's goodput objectives
rank plans by it (planning/goodput.py).

The learning rate is tuned for `base_batch` ([train] global_batch_size). At batch B it is scaled by
sqrt(B / base) (the variance-preserving rule for Adam, Malladi et al. 2022), or by AdaScale's gain
(Johnson et al. 2020) r = (1 + φ/base) / (1 + φ/B) = (B / base) · E(B): near 1 where the gradient is
clean (a larger batch does not help, so neither does a larger rate), near B/base where noise
dominates. The schedule is a function of samples trained, measured in steps of `base_batch`
(`progress`), so warmup and decay keep their shape in tokens whatever the batch does; a fixed-batch
run's progress is its step count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.config import TrainConfig
from core.noise_scale import NoiseScaleEstimator
from core.plan import split_batch

HYSTERESIS = 1.5
"""The noise scale must leave [batch / 1.5, batch × 1.5] before the batch changes: each change costs a
re-split (and on GPUs with compile, a recompile for the new micro-batch shape), and the smoothed
estimate still wanders by ±20 % on the tiny CPU model."""
MAX_CHANGE = 2.0
"""A change at most doubles or halves the batch: the learning rate follows the batch, and Adam's
moments, estimated at the old batch's noise, need a few steps to settle before the next jump."""
MIN_UPDATES = 20
"""Steps measured before the first decision: the moving average's bias correction makes early
estimates unbiased, not steady."""


def statistical_efficiency(batch: float, base_batch: float, noise_scale: float | None) -> float:
    """Progress of a sample trained at `batch`, in samples at `base_batch`: (φ + base) / (φ + batch).
    Without a noise scale, 1: nothing says a larger batch wastes samples."""
    if noise_scale is None:
        return 1.0
    return (noise_scale + base_batch) / (noise_scale + batch)


@dataclass(slots=True)
class AdaptiveBatch:
    """What a resumed run needs to go on with the batch and learning rate it had (saved in checkpoints)."""

    batch: int
    """The global batch of the next step."""
    estimator: NoiseScaleEstimator = field(default_factory=NoiseScaleEstimator)
    changes: int = 0
    """Batch changes so far."""

    def measure(self, *, small_sq_norm: float, small_batch: float, big_sq_norm: float) -> None:
        """One step's norms (core/noise_scale.py); the big batch is the step's global batch."""
        if small_batch < self.batch:  # one replica holding the whole batch has nothing to compare
            self.estimator.update(small_sq_norm=small_sq_norm, small_batch=small_batch, big_sq_norm=big_sq_norm,
                                  big_batch=self.batch)

    @property
    def noise_scale(self) -> float | None:
        return self.estimator.noise_scale

    def to_dict(self) -> dict:
        return {"batch": self.batch, "estimator": self.estimator.to_dict(), "changes": self.changes}

    @classmethod
    def from_dict(cls, data: dict) -> AdaptiveBatch:
        return cls(data["batch"], NoiseScaleEstimator.from_dict(data["estimator"]), data["changes"])


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    base_batch: int
    """[train] global_batch_size: the first batch, and the one [train] lr is tuned for."""
    min_batch: int
    max_batch: int
    lr_scaling: str
    """"sqrt" or "adascale"."""
    adaptive: bool = True
    """False: the batch stays `base_batch` (the policy only measures)."""

    @classmethod
    def for_train(cls, train: TrainConfig) -> BatchPolicy:
        if train.batch_size != "adaptive":
            b = train.global_batch_size
            return cls(b, b, b, train.lr_scaling, adaptive=False)
        return cls(train.global_batch_size, train.min_batch_size, train.max_batch_size, train.lr_scaling)

    def progress(self, consumed_samples: int) -> float:
        """Where the schedule stands: samples trained, in steps of the base batch."""
        return consumed_samples / self.base_batch

    def total_samples(self, steps: int) -> int:
        """Samples the run trains: [train] steps of the base batch, whatever the batch does."""
        return steps * self.base_batch

    def finished(self, step: int, consumed_samples: int, steps: int) -> bool:
        """An adaptive run trains [train] steps × global_batch_size samples; a fixed one [train] steps."""
        if not self.adaptive:
            return step >= steps
        return consumed_samples >= self.total_samples(steps)

    def lr_multiplier(self, state: AdaptiveBatch) -> float:
        scale = state.batch / self.base_batch
        if self.lr_scaling == "sqrt":
            return math.sqrt(scale)
        noise = state.noise_scale
        if noise is None:  # nothing measured yet: no evidence that a larger batch averages noise away
            return 1.0
        return scale * statistical_efficiency(state.batch, self.base_batch, noise)

    def decide(self, state: AdaptiveBatch, choices: list[int]) -> int | None:
        """The batch to change to, or None to keep it: once the noise scale has left the hysteresis
        band around the current batch, the choice nearest it (in ratio), at most MAX_CHANGE away."""
        noise = state.noise_scale
        if not self.adaptive or noise is None or state.estimator.updates < MIN_UPDATES:
            return None
        target = min(max(noise, self.min_batch), self.max_batch)
        if state.batch / HYSTERESIS <= target <= state.batch * HYSTERESIS:
            return None
        target = min(max(target, state.batch / MAX_CHANGE), state.batch * MAX_CHANGE)
        best = min(choices, key=lambda b: abs(math.log(b / target)))
        return best if best != state.batch else None


def batch_choices(policy: BatchPolicy, max_micro: tuple[int, ...]) -> list[int]:
    """The batches in [min, max] that split over replicas with these micro-batch limits without
    ragged accumulation: multiples of the replicas' full pass (sum(max_micro)), and below it,
    multiples of the replica count; min and max themselves when they split at all."""
    replicas, full = len(max_micro), sum(max_micro)
    lo, hi = policy.min_batch, policy.max_batch
    nice = {b for b in range(full, hi + 1, full) if b >= lo}
    nice |= {b for b in range(replicas, min(full, hi + 1), replicas) if b >= lo}
    nice |= {b for b in (lo, hi) if split_batch(b, max_micro) is not None}
    return sorted(nice)
