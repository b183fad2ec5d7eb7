"""How a selection of the k largest magnitudes is carried out: k, capacity and the threshold sample.

Selection never sorts the bucket. A threshold is estimated from a fixed sample of
`sample_size` elements (the value that leaves `sample_need` sampled magnitudes at or above
it), then one pass keeps every element whose magnitude reaches the threshold. Both backends
(Triton and the torch twin) read this plan, so they draw the same sample and reach the same
threshold bit for bit.

The sample is `sample_chunks` runs of SAMPLE_CHUNK contiguous elements spread evenly over the
bucket: each run is one or two DRAM sectors, so the sample costs a few MB of reads however large
the bucket, where single scattered elements each cost a sector of their own, and every layer in
the bucket is sampled in proportion to its size.

Tolerance on k. The count kept is the count of elements at or above a sampled quantile, so its
relative error is a sampling error of about 1/sqrt(sample_need): sample_need is near
SAMPLE_HITS (2048, so about 2.2 %) unless the sample is capped at MAX_SAMPLE_SIZE (k_ratio
below about 0.002). Runs of 16 neighbours are not 16 independent draws where neighbours'
magnitudes go together (a row of a weight gradient), which can widen that error somewhat. The
threshold is the lower edge of the 2**-12-of-a-binade bin that holds the sample_need-th largest
sampled magnitude, so it keeps at most that bin's worth more than sample_need: for a Gaussian
tail at k = 1 % a bin holds about 0.2 % of k. A bucket of at most `sample_size` elements is
sampled whole, which leaves only that bin. The message holds `capacity` = k + 10 % entries, 4.5
standard deviations at SAMPLE_HITS; elements selected past capacity are not sent and stay in
the error-feedback residual, so nothing is lost, only delayed. Exact ties at the threshold are
all kept (data made of a few repeated values can overshoot k, up to capacity).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

SAMPLE_HITS = 2048
"""Sampled magnitudes expected at or above the threshold; the count's relative error is ~1/sqrt of it."""

MIN_SAMPLE_SIZE = 8192
MAX_SAMPLE_SIZE = 1 << 20
"""Bounds on the sample, so tiny k does not sample the whole of a large bucket."""

SAMPLE_CHUNK = 16
"""Contiguous elements per sampled run: 64 bytes of fp32, two DRAM sectors."""

CAPACITY_SLACK_PERCENT = 10
"""Room past k in every message, so a threshold that lands a little low still fits."""

MAX_NUMEL = 2**31 - 2**16
"""Indices travel as int32, and block offsets must stay below 2**31 too."""


@dataclass(frozen=True, slots=True)
class SelectionPlan:
    numel: int
    """Elements in the bucket."""
    k: int
    """How many elements the threshold aims to keep."""
    capacity: int
    """Entries a message holds: k plus CAPACITY_SLACK_PERCENT, at most numel."""
    sample_size: int
    """Elements sampled to estimate the threshold: sample_chunks runs of SAMPLE_CHUNK, or the
    whole bucket."""
    sample_chunks: int
    """Runs sampled. Run c starts at element (c * chunk_slots // sample_chunks) * SAMPLE_CHUNK."""
    chunk_slots: int
    """Places a run can start, SAMPLE_CHUNK apart: the whole runs that fit in the bucket, or all
    of them (the last one partial) when the bucket is sampled whole."""
    sample_need: int
    """Sampled magnitudes the threshold should leave at or above it: k scaled to the sample."""

    @property
    def workspace_int32s(self) -> int:
        return WORKSPACE_GROUP_WORDS + 2 * -(-self.numel // GROUP_ELEMENTS)

    @classmethod
    def for_k(cls, numel: int, k: int) -> SelectionPlan:
        if not 1 <= numel <= MAX_NUMEL:
            raise ValueError(f"a bucket must hold 1 to {MAX_NUMEL} elements to select from, got {numel}; "
                             "split larger buckets (DDP's bucket_cap_mb)")
        if not 1 <= k <= numel:
            raise ValueError(f"k must be between 1 and the bucket's {numel} elements, got {k}")
        capacity = min(numel, k + -(-k * CAPACITY_SLACK_PERCENT // 100))
        wanted = max(MIN_SAMPLE_SIZE, min(MAX_SAMPLE_SIZE, -(-SAMPLE_HITS * numel // k)))
        chunks = -(-wanted // SAMPLE_CHUNK)
        if chunks < numel // SAMPLE_CHUNK:
            slots, sample_size = numel // SAMPLE_CHUNK, chunks * SAMPLE_CHUNK
        else:  # sampled whole, in order
            chunks = slots = -(-numel // SAMPLE_CHUNK)
            sample_size = numel
        sample_need = max(1, (k * sample_size + numel // 2) // numel)
        return cls(numel, k, capacity, sample_size, chunks, slots, sample_need)

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def for_ratio(cls, numel: int, k_ratio: float) -> SelectionPlan:
        """Cached: a comm hook asks for the same few buckets every step."""
        check_k_ratio(k_ratio)
        return cls.for_k(numel, max(1, min(numel, round(k_ratio * numel))))


def check_k_ratio(k_ratio: float) -> None:
    if not (isinstance(k_ratio, (int, float)) and 0.0 < k_ratio <= 1.0):
        raise ValueError(f"k_ratio must be a fraction in (0, 1], got {k_ratio!r}; 0.01 keeps 1 % of the bucket")


EXPONENT_SHIFT = 23
NONFINITE_EXPONENT = 255
"""inf and NaN have an all-ones exponent; they are counted in no bin."""
EXPONENT_BINS = 256
FINE_SHIFT = 11
FINE_BINS = 4096
"""Inside the binade that holds the threshold, magnitudes are binned by their next 12 bits
(fp32 bits >> 11, low 12 bits): bins 2**-12 of a binade wide, ordered like the magnitudes."""

GROUP_ELEMENTS = 1 << 18
"""The Triton kernel counts the entries of each 2**18 elements in one 64-bit word, from which
its programs place their entries in the payload."""

WORKSPACE_FINE_COUNTS = EXPONENT_BINS
WORKSPACE_COUNTERS = WORKSPACE_FINE_COUNTS + FINE_BINS
WORKSPACE_GROUP_WORDS = WORKSPACE_COUNTERS + 34 * 32 + 256
"""Selection workspace, int32, zeroed before each selection: counts per exponent, counts per fine
bin inside the exponent that holds the threshold (both filled by either backend), then for the
Triton kernel two counters its phases signal through and 32 copies of the threshold (a 128-byte
line each), the fine counts summed 16 bins at a time, and one int64 per group of GROUP_ELEMENTS."""
