"""The gradient noise scale from norms a step computes anyway (core/noise_scale.py), on synthetic
gradients whose true tr(Σ) and |G|² are known."""

import numpy as np
import pytest

from core.noise_scale import NoiseScaleEstimator

DIM = 2000
TRUE_G = np.full(DIM, 0.05)          # |G|² = 5
SIGMA = 0.5                          # per-coordinate std of one sample's gradient: tr(Σ) = 500
TRUE_NOISE_SCALE = DIM * SIGMA**2 / float(TRUE_G @ TRUE_G)   # 100 samples


def mean_gradient(rng, batch: int) -> np.ndarray:
    return TRUE_G + rng.normal(0.0, SIGMA / np.sqrt(batch), DIM)


@pytest.mark.parametrize("small, replicas", [(8, 4), (32, 2), (4, 16)])
def test_replica_norms_against_the_reduced_one_give_the_known_noise_scale_within_10_percent(small, replicas):
    rng = np.random.default_rng(0)
    estimator = NoiseScaleEstimator()
    for _ in range(300):
        locals_ = [mean_gradient(rng, small) for _ in range(replicas)]  # each replica's mean gradient
        reduced = np.mean(locals_, axis=0)                              # what the all-reduce makes
        estimator.update(small_sq_norm=float(np.mean([g @ g for g in locals_])), small_batch=small,
                         big_sq_norm=float(reduced @ reduced), big_batch=small * replicas)
    assert estimator.noise_scale == pytest.approx(TRUE_NOISE_SCALE, rel=0.10)
    assert estimator.trace_covariance == pytest.approx(DIM * SIGMA**2, rel=0.10)


def test_nothing_before_a_positive_gradient_estimate_and_the_state_round_trips():
    estimator = NoiseScaleEstimator()
    assert estimator.noise_scale is None
    estimator.update(small_sq_norm=4.0, small_batch=4, big_sq_norm=1.0, big_batch=8)  # |G|² estimate negative
    assert estimator.noise_scale is None
    estimator.update(small_sq_norm=3.0, small_batch=4, big_sq_norm=1.0, big_batch=8)
    assert NoiseScaleEstimator.from_dict(estimator.to_dict()) == estimator
    with pytest.raises(ValueError):
        estimator.update(small_sq_norm=1.0, small_batch=8, big_sq_norm=1.0, big_batch=8)
