"""Goodput: what a plan's throughput is worth once its global batch's statistical efficiency counts.

    stats = Statistics(base_batch=32, noise_scale=300.0, samples_to_target=1e6)
    size = Throughput(workers=8, batch=128, step_seconds=0.4, dollars_per_hour=16.0)
    goodput_samples_per_second(size, stats), dollars_to_target(size, stats)
    best = best_size(sizes, Objective.GOODPUT, stats)     # the worker count and batch to run

Pollux (OSDI'21) chooses the batch and the GPUs together by goodput = throughput × E(B), E the
statistical efficiency of batch B (core/adaptive_batch.statistical_efficiency): a larger batch keeps
more GPUs busy, but past the gradient noise scale its samples are worth less. Dollars to a target
follow McCandlish et al. 2018's law for the samples a loss takes, samples(B) = samples(base) / E(B).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.adaptive_batch import statistical_efficiency
from core.plan import Objective

GOODPUT_OBJECTIVES = (Objective.GOODPUT, Objective.CHEAPEST_TO_TARGET)


@dataclass(frozen=True, slots=True)
class Statistics:
    """What the training statistics say about the batch: the planner's input besides the cost model."""

    base_batch: int
    """[train] global_batch_size: the batch efficiencies and samples_to_target are relative to."""
    noise_scale: float | None = None
    """B_noise in samples; None when neither measured nor configured (efficiency 1)."""
    samples_to_target: float = 0.0
    """Samples to the target loss at base_batch ([placement] tokens_to_target / seq_len); 0 = no target."""
    source: str = ""
    """Where noise_scale came from: "measured" (the run's), "configured" ([placement] noise_scale), or ""."""

    def efficiency(self, batch: int) -> float:
        return statistical_efficiency(batch, self.base_batch, self.noise_scale)

    def describe(self) -> str:
        """For the plan's notes: the noise scale the goodput objectives planned with, and where it came from."""
        if self.noise_scale is None:
            return ("no gradient noise scale: none measured and [placement] noise_scale left out, so every batch "
                    "is costed at statistical efficiency 1 (set noise_scale to what a run measured)")
        where = "the run's measured" if self.source == "measured" else "[placement] noise_scale,"
        return f"planned with {where} gradient noise scale {self.noise_scale:,.0f} samples"


@dataclass(frozen=True, slots=True)
class Throughput:
    """What the cost model predicts for one candidate size: its workers, global batch, step and price."""

    workers: int
    batch: int
    step_seconds: float
    dollars_per_hour: float

    @property
    def dollars_per_step(self) -> float:
        return self.dollars_per_hour * self.step_seconds / 3600


def goodput_samples_per_second(size: Throughput, stats: Statistics) -> float:
    """Samples a second, each weighted by what it is worth at the base batch."""
    return size.batch / size.step_seconds * stats.efficiency(size.batch) if size.step_seconds > 0 else 0.0


def samples_to_target(batch: int, stats: Statistics) -> float:
    """Samples trained at `batch` until the target: more than at the base batch above it, fewer below."""
    return stats.samples_to_target / stats.efficiency(batch)


def dollars_to_target(size: Throughput, stats: Statistics) -> float:
    return samples_to_target(size.batch, stats) / size.batch * size.dollars_per_step


def goodput_score(objective: Objective, size: Throughput, stats: Statistics) -> tuple[float, ...]:
    """How a goodput objective ranks `size` (lower first): by goodput, then dollars a sample; or by
    dollars to the target, then the step."""
    if objective == Objective.GOODPUT:
        return (-goodput_samples_per_second(size, stats), size.dollars_per_step / size.batch)
    if objective == Objective.CHEAPEST_TO_TARGET:
        return (dollars_to_target(size, stats), size.step_seconds)
    raise ValueError(f"{objective} is not a goodput objective")


def best_size(sizes: list[Throughput], objective: Objective, stats: Statistics) -> Throughput:
    """The worker count and global batch that serve the objective best among `sizes`."""
    return min(sizes, key=lambda size: goodput_score(objective, size, stats))


def batch_ladder(smallest: int, largest: int, base: int) -> tuple[int, ...]:
    """The global batches a goodput search weighs: doublings from `smallest` up to `largest`, both
    ends, and the base batch."""
    batches = {smallest, largest, base}
    batch = smallest
    while batch < largest:
        batches.add(batch)
        batch *= 2
    return tuple(sorted(batches))
