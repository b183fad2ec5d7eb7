"""How a selection of the k largest magnitudes is carried out: k, capacity and the threshold sample.

Selection never sorts the bucket. A threshold is estimated from a fixed sample of
`sample_size` elements (the quantile that leaves `sample_need` sampled magnitudes at or above
it), then one pass keeps every element whose magnitude reaches the threshold. Both backends
(Triton and the torch twin) read this plan, so they draw the same sample and reach the same
threshold bit for bit.

Tolerance on k. The count kept is the count of elements at or above a sampled quantile, so its
relative error is a sampling error of about 1/sqrt(sample_need): sample_need is near
SAMPLE_HITS (2048, so about 2.2 %) unless the sample is capped at MAX_SAMPLE_SIZE (k_ratio
below about 0.002). A bucket of at most `sample_size` elements is sampled whole, which leaves
only the interpolation inside one 0.4 %-wide histogram bin (for a Gaussian tail at k = 1 %
that bin holds about 3 % of k, and the count misses by a fraction of it). The message holds
`capacity` = k + 10 % entries, 4.5 standard deviations at SAMPLE_HITS; elements selected past
capacity are not sent and stay in the error-feedback residual, so nothing is lost, only delayed.
Exact ties at the threshold are all kept (data made of a few repeated values can overshoot k,
up to capacity).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

SAMPLE_HITS = 2048
"""Sampled magnitudes expected at or above the threshold; the count's relative error is ~1/sqrt of it."""

MIN_SAMPLE_SIZE = 8192
MAX_SAMPLE_SIZE = 1 << 20
"""Bounds on the sample, so tiny k does not sample the whole of a large bucket."""

CAPACITY_SLACK_PERCENT = 10
"""Room past k in every message, so a threshold that lands a little low still fits."""

MAX_NUMEL = 2**31 - 2**16
"""Indices travel as int32, and block offsets must stay below 2**31 too."""

_GOLDEN_FRACTION = 0.6180339887498949


@dataclass(frozen=True, slots=True)
class SelectionPlan:
    numel: int
    """Elements in the bucket."""
    k: int
    """How many elements the threshold aims to keep."""
    capacity: int
    """Entries a message holds: k plus CAPACITY_SLACK_PERCENT, at most numel."""
    sample_size: int
    """Elements sampled to estimate the threshold."""
    sample_stride: int
    """Sample j is element (j * sample_stride) % numel: a Weyl sequence, spread evenly over the
    bucket (every layer in it is sampled in proportion) and, being coprime to numel, a
    permutation when the whole bucket is sampled."""
    sample_need: int
    """Sampled magnitudes the threshold should leave at or above it: k scaled to the sample."""

    @property
    def workspace_int32s(self) -> int:
        return WORKSPACE_SAMPLES + self.sample_size

    @classmethod
    def for_k(cls, numel: int, k: int) -> SelectionPlan:
        if not 1 <= numel <= MAX_NUMEL:
            raise ValueError(f"a bucket must hold 1 to {MAX_NUMEL} elements to select from, got {numel}; "
                             "split larger buckets (DDP's bucket_cap_mb)")
        if not 1 <= k <= numel:
            raise ValueError(f"k must be between 1 and the bucket's {numel} elements, got {k}")
        capacity = min(numel, k + -(-k * CAPACITY_SLACK_PERCENT // 100))
        wanted = -(-SAMPLE_HITS * numel // k)
        sample_size = min(numel, max(MIN_SAMPLE_SIZE, min(MAX_SAMPLE_SIZE, wanted)))
        sample_need = max(1, (k * sample_size + numel // 2) // numel)
        return cls(numel, k, capacity, sample_size, _weyl_stride(numel), sample_need)

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def for_ratio(cls, numel: int, k_ratio: float) -> SelectionPlan:
        """Cached: a comm hook asks for the same few buckets every step."""
        check_k_ratio(k_ratio)
        return cls.for_k(numel, max(1, min(numel, round(k_ratio * numel))))


def check_k_ratio(k_ratio: float) -> None:
    if not (isinstance(k_ratio, (int, float)) and 0.0 < k_ratio <= 1.0):
        raise ValueError(f"k_ratio must be a fraction in (0, 1], got {k_ratio!r}; 0.01 keeps 1 % of the bucket")


def _weyl_stride(numel: int) -> int:
    stride = max(1, int(numel * _GOLDEN_FRACTION))
    while math.gcd(stride, numel) != 1:
        stride += 1
    return stride % numel


KEY_SHIFT = 15
"""A magnitude's histogram key is its fp32 bits >> 15: 8 exponent bits, then 8 mantissa bits,
so key bins are 0.4 % wide and ordered like the magnitudes."""

EXPONENT_SHIFT = 23
NONFINITE_EXPONENT = 255
"""inf and NaN have an all-ones exponent; they are counted in no bin."""

BINS = 256
WORKSPACE_SAMPLES = 3 * BINS
"""Threshold workspace, int32: counts per exponent, counts per key bin inside the exponent that
holds the threshold, the largest magnitude bits per such key bin (so a bin of tied values puts
the threshold on the tie), then the sampled magnitude bits from offset WORKSPACE_SAMPLES on."""
