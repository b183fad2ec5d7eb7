"""The learning-rate schedule: linear warmup, then cosine decay to min_lr at the last step — and how a
resumed run with another step count continues it without a jump.

    schedule = LrSchedule.for_train(config.train)          # a new run: warmup, then one cosine to [train] steps
    schedule = recorded.resumed(config.train, at_step=8)   # --resume after [train] steps changed
    lr = schedule.lr_at(step)                               # the LR of the step that follows `step` done steps

The schedule is a pure function of the step, so restoring the step restores it. Every checkpoint
records the schedule it was trained under. When a run is resumed with another `[train] steps`, the
steps already taken keep their rates and the decay goes on from the rate reached at the checkpoint
to min_lr at the new last step: one more cosine segment. Raising `steps` before the decay has
started (during warmup) gives exactly the schedule a run with that many steps would have had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config import TrainConfig
from core.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class Decay:
    """A cosine from `start_lr` at `start_step` down to the schedule's min_lr at `end_step`."""

    start_step: int
    start_lr: float
    end_step: int


@dataclass(frozen=True, slots=True)
class LrSchedule:
    peak_lr: float
    """[train] lr: the rate warmup climbs to."""
    min_lr: float
    warmup_steps: int
    decays: tuple[Decay, ...]
    """The cosine segments after warmup, in step order; each later one starts where a resume changed the steps."""

    @classmethod
    def for_train(cls, train: TrainConfig) -> LrSchedule:
        return cls(train.lr, train.min_lr, train.warmup_steps, (Decay(train.warmup_steps, train.lr, train.steps),))

    @classmethod
    def from_dict(cls, data: dict) -> LrSchedule:
        """The schedule as a checkpoint's archipelago.json records it (dataclasses.asdict)."""
        return cls(data["peak_lr"], data["min_lr"], data["warmup_steps"], tuple(Decay(**d) for d in data["decays"]))

    @property
    def end_step(self) -> int:
        return self.decays[-1].end_step

    def lr_at(self, step: float) -> float:
        """The rate of the optimizer step taken after `step` completed steps. An adaptive batch passes
        the samples trained in steps of the base batch (a fraction: the schedule is in tokens)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        decay = next(d for d in reversed(self.decays) if d.start_step <= step)
        progress = (step - decay.start_step) / max(1, decay.end_step - decay.start_step)
        return self.min_lr + 0.5 * (decay.start_lr - self.min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def resumed(self, train: TrainConfig, *, at_step: int, where: str) -> LrSchedule:
        """This schedule, recorded in a checkpoint of step `at_step`, continued to `train.steps`.

        Refuses a changed lr, min_lr or warmup_steps: the rates of the steps already taken came from them."""
        recorded = {"lr": self.peak_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps}
        changed = [f"{key} = {value!r} (config {getattr(train, key)!r})" for key, value in recorded.items()
                   if getattr(train, key) != value]
        if changed:
            raise CheckpointError(f"the checkpoint was trained with [train] {', '.join(changed)}; resuming with "
                                  "other values would make the learning rate jump", where=where,
                                  fix="set them back to resume, or start a new run (--overwrite or another name) "
                                      "for another schedule")
        if train.steps == self.end_step:
            return self
        last = self.decays[-1]
        if at_step <= last.start_step:  # the last segment has not begun: it may still end elsewhere
            return self._with_decays(self.decays[:-1] + (Decay(last.start_step, last.start_lr, train.steps),))
        return self._with_decays(self.decays + (Decay(at_step, self.lr_at(at_step), train.steps),))

    def _with_decays(self, decays: tuple[Decay, ...]) -> LrSchedule:
        return LrSchedule(self.peak_lr, self.min_lr, self.warmup_steps, decays)
