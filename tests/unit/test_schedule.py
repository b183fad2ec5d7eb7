"""The learning-rate schedule when a resumed run's [train] steps differ from the checkpoint's: the steps taken
keep their rates, and the next step's rate is the one the checkpoint's schedule gives there."""

import pytest

from core.config import TrainConfig
from core.errors import CheckpointError
from core.schedule import LrSchedule

TRAIN = dict(lr=2e-3, min_lr=2e-4, warmup_steps=4)


def schedule(steps: int) -> LrSchedule:
    return LrSchedule.for_train(TrainConfig(steps=steps, **TRAIN))


def test_raising_steps_in_the_cosine_decay_goes_on_from_the_rate_reached():
    eight = schedule(8)
    twelve = eight.resumed(TrainConfig(steps=12, **TRAIN), at_step=6, where="step_00000006")
    assert [twelve.lr_at(s) for s in range(7)] == [eight.lr_at(s) for s in range(7)]  # taken, and the next
    assert eight.lr_at(6) < schedule(12).lr_at(6)  # a cosine over 12 steps from the start would jump back up
    rates = [twelve.lr_at(s) for s in range(6, 13)]
    assert rates == sorted(rates, reverse=True) and rates[-1] == pytest.approx(2e-4)
    assert twelve.resumed(TrainConfig(steps=12, **TRAIN), at_step=9, where="") is twelve  # the same steps: as it was


def test_raising_steps_before_the_decay_began_is_the_longer_run_s_schedule():
    longer = schedule(8).resumed(TrainConfig(steps=12, **TRAIN), at_step=3, where="step_00000003")
    assert [longer.lr_at(s) for s in range(13)] == [schedule(12).lr_at(s) for s in range(13)]


def test_a_finished_run_trained_further_goes_on_at_min_lr():
    further = schedule(8).resumed(TrainConfig(steps=12, **TRAIN), at_step=8, where="step_00000008")
    assert [further.lr_at(s) for s in range(8, 12)] == pytest.approx([2e-4] * 4)


def test_a_changed_peak_is_refused_with_the_values_to_resume_with():
    with pytest.raises(CheckpointError, match=r"trained with \[train\] lr = 0.002 \(config 0.001\)"):
        schedule(8).resumed(TrainConfig(steps=12, lr=1e-3, min_lr=2e-4, warmup_steps=4), at_step=6, where="x")
