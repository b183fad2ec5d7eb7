"""Splitting the global batch over replicas of different speeds, so they finish together.

    groups = [ReplicaGroup(count=8, seconds_per_sample=0.010, overhead_s=0.002, max_micro_batch=32),
              ReplicaGroup(count=8, seconds_per_sample=0.027, overhead_s=0.002, max_micro_batch=16)]
    split = split_batch(groups, global_batch=512, grad_accum_steps=2)
    split.micro_batches[0]   # ((23, 8),) → all eight fast replicas take 23 samples per micro-step

Every replica runs `grad_accum_steps` micro-steps (one count for the whole job, as the sampler's
BatchLayout wants) of its own micro-batch; the micro-batches add up to global_batch / accum
exactly. A micro-step of m samples on replica group g takes overhead_s + m × seconds_per_sample;
the split minimises the slowest replica's time (the step waits for it): the smallest time t at
which every replica's largest micro-batch finishing within t adds up to enough samples, then
the surplus taken back, a sample at a time, from the replicas that finish last. No replica then
exceeds t, and none can do with less than t, so that is the integer optimum of the min–max
problem (each replica's time grows with its micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaGroup:
    """`count` interchangeable data-parallel replicas."""

    count: int
    seconds_per_sample: float
    overhead_s: float
    """Fixed time per micro-step (kernel launches, Python), whatever the micro-batch."""
    max_micro_batch: int
    """What fits the device's memory (and the job's micro_batch_size)."""

    def micro_step_seconds(self, micro_batch: int) -> float:
        return self.overhead_s + micro_batch * self.seconds_per_sample


@dataclass(frozen=True, slots=True)
class Split:
    grad_accum_steps: int
    micro_batches: tuple[tuple[tuple[int, int], ...], ...]
    """Per group: (micro-batch, how many of the group's replicas take it), largest first."""
    micro_step_seconds: float
    """The slowest replica's micro-step."""

    @property
    def compute_seconds(self) -> float:
        return self.grad_accum_steps * self.micro_step_seconds

    def per_replica(self, group: int) -> list[int]:
        """The micro-batch of each replica of `group`, in order."""
        return [size for size, count in self.micro_batches[group] for _ in range(count)]


def feasible_accum_steps(groups: list[ReplicaGroup], global_batch: int) -> list[int]:
    """Accumulation counts that divide the global batch into micro-batches every replica can take:
    at least one sample per replica per micro-step, and no more than its memory allows."""
    replicas = sum(g.count for g in groups)
    capacity = sum(g.count * g.max_micro_batch for g in groups)
    return [a for a in _divisors(global_batch) if replicas <= global_batch // a <= capacity]


def split_batch(groups: list[ReplicaGroup], global_batch: int, grad_accum_steps: int) -> Split:
    per_micro_step = global_batch // grad_accum_steps
    if global_batch % grad_accum_steps or not (
            sum(g.count for g in groups) <= per_micro_step <= sum(g.count * g.max_micro_batch for g in groups)):
        raise ValueError(f"accumulation {grad_accum_steps} is not feasible for {global_batch} samples over {groups}")
    t = _smallest_sufficient_time(groups, per_micro_step)
    # buckets[g]: {micro-batch: replicas of group g that take it}
    buckets = [{_largest_within(g, t): g.count} for g in groups]
    surplus = sum(g.count * m for g, m in zip(groups, (next(iter(b)) for b in buckets))) - per_micro_step
    # Give the surplus back one sample per replica at a time, from the replicas that finish last:
    # every replica stays within t, so the slowest time stays the optimum, and the rest even out.
    while surplus > 0:
        g, m = max(((g, m) for g, bucket in enumerate(buckets) for m in bucket if m > 1),
                   key=lambda gm: groups[gm[0]].micro_step_seconds(gm[1]))
        lowered = min(buckets[g][m], surplus)
        buckets[g][m] -= lowered
        buckets[g][m - 1] = buckets[g].get(m - 1, 0) + lowered
        buckets[g] = {size: n for size, n in buckets[g].items() if n > 0}
        surplus -= lowered
    micro_batches = tuple(tuple(sorted(bucket.items(), reverse=True)) for bucket in buckets)
    slowest = max(g.micro_step_seconds(m) for g, batches in zip(groups, micro_batches) for m, _ in batches)
    return Split(grad_accum_steps=grad_accum_steps, micro_batches=micro_batches, micro_step_seconds=slowest)


def _largest_within(group: ReplicaGroup, t: float) -> int:
    fits = math.floor((t - group.overhead_s) / group.seconds_per_sample * (1 + 1e-12) + 1e-9)
    return max(1, min(group.max_micro_batch, fits))


def _smallest_sufficient_time(groups: list[ReplicaGroup], samples: int) -> float:
    """The smallest micro-step time at which the replicas can take `samples` between them, found
    among the finishing times of their possible micro-batches by bisection on the time."""
    enough = lambda t: sum(g.count * _largest_within(g, t) for g in groups) >= samples  # noqa: E731
    low = max(g.micro_step_seconds(1) for g in groups)
    if enough(low):
        return low
    high = max(g.micro_step_seconds(g.max_micro_batch) for g in groups)
    # Finishing times of one group are seconds_per_sample apart; a thousandth of the smallest is
    # closer than any two that matter.
    tolerance = 1e-3 * min(g.seconds_per_sample for g in groups)
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    # Snap to the finishing time of a real micro-batch: the largest one that fits within `high`.
    return max(g.micro_step_seconds(_largest_within(g, high)) for g in groups)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
