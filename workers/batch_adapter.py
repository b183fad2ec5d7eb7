"""The worker's side of the gradient noise scale and the adaptive batch (core/adaptive_batch.py).

    adapter = BatchAdapter(spec, restored=info.adaptive_batch)  # the batch and noise the checkpoint had
    engine.replan(adapter.plan)                                 # the group's plan re-split for that batch
    lr = adapter.lr(spec.lr_schedule, step, consumed_samples)
    adapter.measured(rows)              # each flushed metrics row gains noise_scale and global_batch
    event = adapter.maybe_change(step)  # at the same log boundary on every rank: a new batch, or None

Every rank computes the same numbers (the window's metrics are all-reduced before they are read),
and rank 0's decision is broadcast all the same: a rank that chose otherwise would wait in a
collective of another size for ever. A change re-splits the plan the group was given at its start,
so the workers, their process group and the model stay; the sampler goes on from the exact sample
where the last step ended, with the new layout.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from core.adaptive_batch import AdaptiveBatch, BatchPolicy, batch_choices
from core.plan import Plan
from core.schedule import LrSchedule
from core.spec import WorkerSpec


class BatchAdapter:
    def __init__(self, spec: WorkerSpec, restored: dict | None = None):
        self.policy = BatchPolicy.for_train(spec.train)
        self.group_plan = spec.plan
        """The plan the coordinator made for this group: each replica's micro-batch at its limit."""
        self.choices = batch_choices(self.policy, self.group_plan.replica_micro_batch_sizes())
        # A fresh run starts at the plan's batch: a goodput plan may have chosen another than [train]'s.
        first = self.group_plan.global_batch_size if self.policy.adaptive else self.policy.base_batch
        self.state = AdaptiveBatch.from_dict(restored) if restored else AdaptiveBatch(first)
        if self.state.batch not in self.choices:  # resumed on another group: the nearest batch it can split
            self.state.batch = min(self.choices, key=lambda b: abs(math.log(b / self.state.batch)))
        self.plan = self._plan_for(self.state.batch)

    def _plan_for(self, batch: int) -> Plan:
        return self.group_plan if batch == self.group_plan.global_batch_size else self.group_plan.with_global_batch(batch)

    def lr(self, schedule: LrSchedule, step: int, consumed_samples: int) -> float:
        if not self.policy.adaptive:
            return schedule.lr_at(step)
        return schedule.lr_at(self.policy.progress(consumed_samples)) * self.policy.lr_multiplier(self.state)

    def finished(self, step: int, consumed_samples: int, steps: int) -> bool:
        """Whether [train] steps are trained: by samples for an adaptive batch (BatchPolicy.finished)."""
        return self.policy.finished(step, consumed_samples, steps)

    def measured(self, rows: list[dict]) -> None:
        """Feeds the window's norms to the estimator; each row gains the step's global batch and the
        smoothed noise scale (None until there is one)."""
        for row in rows:
            small_sq, inverse_small_batch = row.pop("local_grad_sq"), row.pop("inverse_local_batch")
            if math.isfinite(small_sq) and inverse_small_batch > 0:
                self.state.measure(small_sq_norm=small_sq, small_batch=1 / inverse_small_batch,
                                   big_sq_norm=row["grad_norm"] ** 2)
            row["global_batch"] = self.state.batch
            row["noise_scale"] = self.state.noise_scale

    def maybe_change(self, step: int) -> dict | None:
        """Decides at this step boundary (collective): the batch_change event, with the plan re-split, or None."""
        if not self.policy.adaptive:
            return None
        choice = [self.policy.decide(self.state, self.choices)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0)
        new = choice[0]
        if new is None:
            return None
        old = self.state.batch
        self.state.batch, self.state.changes = new, self.state.changes + 1
        self.plan = self._plan_for(new)
        return {"event": "batch_change", "step": step, "from": old, "to": new, "noise_scale": self.state.noise_scale,
                "lr_multiplier": self.policy.lr_multiplier(self.state), "grad_accum_steps": self.plan.grad_accum_steps,
                "micro_batch_sizes": list(self.plan.replica_micro_batch_sizes())}

    def checkpointed(self) -> dict | None:
        """What a checkpoint keeps to go on with this batch and learning rate (None for a fixed batch)."""
        return self.state.to_dict() if self.policy.adaptive else None
