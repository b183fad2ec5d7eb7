"""Errors cross process boundaries (Ray pickles what a worker raises): each comes back as itself."""

import pickle

import pytest

from core import errors


@pytest.mark.parametrize("kind", [c for c in vars(errors).values()
                                  if isinstance(c, type) and issubclass(c, errors.ArchipelagoError)])
def test_every_user_error_survives_pickling(kind):
    again = pickle.loads(pickle.dumps(kind("shard is damaged", where="data/x/train-00000.tokens", fix="verify it")))
    assert type(again) is kind and (again.what, again.where, again.fix) == (
        "shard is damaged", "data/x/train-00000.tokens", "verify it")


def test_a_non_finite_gradient_error_survives_pickling():
    again = pickle.loads(pickle.dumps(errors.NonFiniteGradientError(3, 10, with_residual=True)))
    assert (again.nonfinite, again.numel, again.with_residual) == (3, 10, True)
