"""The gradient noise scale, from gradient norms a training step computes anyway.

    estimator = NoiseScaleEstimator()
    estimator.update(small_sq_norm=…, small_batch=…, big_sq_norm=…, big_batch=…)   # once a step
    estimator.noise_scale    # B_simple = tr(Σ) / |G|², smoothed; None until it has a positive |G|²

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A), the estimator
Pollux (OSDI'21) uses: the squared norm of a mean gradient over B samples has the expectation
E|g_B|² = |G|² + tr(Σ)/B. Two batch sizes seen in the same step give two equations, so

    |G|²  ≈ (B_big |g_big|² − B_small |g_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/B_small − 1/B_big)

The small batch is each data-parallel replica's (its norm read from its gradient bucket before the
all-reduce) or, on one worker, one micro-batch's; the big one is the reduced gradient, whose norm
gradient clipping computes already. No extra backward pass. Each estimate of one step is unbiased
but noisy (the ratio of two is not), so the two are smoothed apart and divided after: the ratio of
the averages, as the paper advises.

With replicas of different batches b_r, the mean of |g_r|² has the expectation |G|² + tr(Σ)·mean(1/b_r):
`small_batch` is then the harmonic mean 1 / mean(1/b_r).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SMOOTHING = 0.95
"""Weight of the past in the moving averages, per step: one step's tr(Σ) estimate on the tiny CPU
model scatters by more than its mean, so about 20 steps are averaged."""


@dataclass(slots=True)
class NoiseScaleEstimator:
    smoothing: float = SMOOTHING
    gradient_sq: float = 0.0
    """Moving average of the |G|² estimates (not yet divided by the bias correction)."""
    trace: float = 0.0
    """Moving average of the tr(Σ) estimates (likewise)."""
    weight: float = 0.0
    """1 − smoothing^updates: the bias correction of both averages (they start at 0)."""
    updates: int = 0

    def update(self, *, small_sq_norm: float, small_batch: float, big_sq_norm: float, big_batch: float) -> None:
        """One step's pair of norms: of the mean gradient over `small_batch` samples and over `big_batch`."""
        if not big_batch > small_batch > 0:
            raise ValueError(f"need big_batch > small_batch > 0, got {big_batch} and {small_batch}")
        gradient_sq = (big_batch * big_sq_norm - small_batch * small_sq_norm) / (big_batch - small_batch)
        trace = (small_sq_norm - big_sq_norm) / (1.0 / small_batch - 1.0 / big_batch)
        keep = self.smoothing
        self.gradient_sq = keep * self.gradient_sq + (1 - keep) * gradient_sq
        self.trace = keep * self.trace + (1 - keep) * trace
        self.weight = keep * self.weight + (1 - keep)
        self.updates += 1

    @property
    def noise_scale(self) -> float | None:
        """B_simple in samples; None before the averaged |G|² is positive (early, or pure noise)."""
        if self.weight == 0 or self.gradient_sq <= 0:
            return None
        return max(0.0, self.trace) / self.gradient_sq

    @property
    def gradient_sq_norm(self) -> float:
        """The smoothed |G|² (bias-corrected)."""
        return self.gradient_sq / self.weight if self.weight else 0.0

    @property
    def trace_covariance(self) -> float:
        """The smoothed tr(Σ) per sample (bias-corrected)."""
        return self.trace / self.weight if self.weight else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> NoiseScaleEstimator:
        return cls(**data)
