"""Gradient reduction that runs on into the next step's forward ([parallel] overlap = "next_forward").

    overlap = NextForwardOverlap(model, optimizer, world_size=2, stats=stats, wire="fp32", backward_share=0.3)
    overlap.register(ddp)                     # DDP's comm hook, and the model's call before each stage
    overlap.begin_step(lr); forward; backward; grad_norm = overlap.end_step()
    overlap.settle()                          # before reading metrics, evaluating or saving

Plain DDP reduces its buckets in the order backward fills them, the last layers' first, and the
optimizer waits for every one before the next forward can start: on a link slower than backward
the step is the forward plus the whole reduction. Here the optimizer step is cut by bucket and
moved to where each bucket's parameters are next used:

- **backward** (`hook`): a bucket goes on the wire at once while the bytes sent in this backward
  stay within `backward_share` of the step's (what the link carries while backward still runs,
  ByteScheduler's observation, SOSP'19); later buckets are held, and the last bucket's call sends
  them in the order the next forward needs them, the first layers' first. The hook's future is
  complete when returned, so DDP does not make the step wait: the gradients stay in the bucket,
  which the all-reduce overwrites in place with their average.
- **next forward** (`before_stage`, called by the built-in models (workers/models/stack.py) before
  their embeddings and before each block):
  every bucket holding a parameter that stage is the first to use is waited for (on GPUs a stream
  dependency, not a host wait), its optimizer update applied with its own step's learning rate,
  and its gradients released; the later buckets are still on the wire meanwhile.

Every rank makes the same collectives in the same order: what is sent when depends on the bucket
sizes alone, never on timing, as NCCL requires. The updates are torch's own optimizer steps over a
subset of its parameters, so the weights come out as with plain DDP and one step, bit for bit
(tests/unit/test_overlap.py).

What it cannot do, and the rules refuse (core/rules.py, overlap_refusal): clip gradients (a bucket's
update would need the global norm of buckets still on the wire), fp16's loss scaling (a step is
known to be skipped only once every bucket has arrived), bf16_weights, FSDP, compiled autograd,
and the compressing hooks other than bf16.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.comm.hooks import HookState, start_average
from workers.comm.stats import CommStats
from workers.models.stack import BlockStack

WIRES = ("fp32", "bf16")


@dataclass
class _Reduction:
    """One bucket of one step, from its hook call until its update is applied."""
    step: int
    need: int
    """The first forward stage that uses one of its parameters: it must be applied before it."""
    index: int
    """DDP's bucket index: breaks ties in `need`, so every rank orders the same way."""
    buffer: torch.Tensor
    """The bucket: this rank's gradients, then their average once the reduction lands."""
    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor]
    """Each parameter's gradient as a view of `buffer`. Not `p.grad`: DDP regroups its buckets at the
    next forward after the first step, and points the gradients at the new ones before this lands."""
    wire: torch.Tensor | None = None
    """What the all-reduce runs on: the buffer itself, or its bf16 copy."""
    work: dist.Work | None = None


class NextForwardOverlap:
    def __init__(self, model: BlockStack, optimizer: torch.optim.Optimizer, *, world_size: int, stats: CommStats,
                 wire: str, backward_share: float):
        if wire not in WIRES:
            raise ValueError(f"unknown overlap wire {wire!r}; choose one of {', '.join(WIRES)}")
        if not 0.0 <= backward_share <= 1.0:
            raise ValueError(f"backward_share must be in [0, 1], got {backward_share!r}")
        self.model = model
        self.optimizer = optimizer
        self.wire = wire
        self.state = HookState(stats=stats, world_size=world_size)
        self.stage_of = model.forward_stages()
        self.element_bytes = 2 if wire == "bf16" else 4
        step_bytes = sum(p.numel() for p in model.parameters() if p.requires_grad) * self.element_bytes
        self.backward_bytes = backward_share * step_bytes
        """Bytes a backward sends as its buckets fill; the rest waits for its last bucket."""
        self.step = 0
        self.sent_bytes = 0
        self.held: list[_Reduction] = []
        self.unapplied: list[_Reduction] = []
        """Every reduction whose update is not applied yet, in the order the forward needs them."""
        self.lrs: dict[int, float] = {}
        self.grad_norms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per step: (sum of squared bucket norms so far, the norm it becomes once every bucket is applied)."""
        self.waits: list[tuple] = []
        """How the forward stalled on each reduction applied so far of the oldest unapplied step."""
        self.last_waits: list[tuple] = []
        """The same for the last step whose updates are all applied."""

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self.state, self.hook)
        self.model.before_stage = self.before_stage

    def begin_step(self, lr: float) -> None:
        """The learning rate this step's gradients will be applied with (in the next step's forward)."""
        self.lrs[self.step] = lr
        zero = torch.zeros((), dtype=torch.float32, device=next(self.model.parameters()).device)
        self.grad_norms[self.step] = (zero, torch.zeros_like(zero))

    def end_step(self) -> torch.Tensor:
        """This step's global gradient norm: a tensor that holds it once its buckets are all applied
        (at the latest after `settle`)."""
        norm = self.grad_norms[self.step][1]
        self.step += 1
        return norm

    # Annotated with the real classes, not strings (no `from __future__ import annotations` here):
    # DDP's register_comm_hook checks the bucket parameter's annotation.
    def hook(self, state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params = list(bucket.parameters())
        reduction = _Reduction(step=self.step, need=min(self.stage_of[id(p)] for p in params), index=bucket.index(),
                               buffer=bucket.buffer(), params=params, grads=bucket.gradients())
        self.unapplied.append(reduction)
        nbytes = reduction.buffer.numel() * self.element_bytes
        if self.sent_bytes + nbytes <= self.backward_bytes:
            self._send(reduction)
            self.sent_bytes += nbytes
        else:
            self.held.append(reduction)
        if bucket.is_last():
            self._send_held()
            self.unapplied.sort(key=lambda r: (r.step, r.need, r.index))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(reduction.buffer)
        return done

    def _send_held(self) -> None:
        """Sends the held buckets, the first the next forward needs first. Python's sort is stable and
        the keys are the same on every rank: so is the order."""
        for held in sorted(self.held, key=_by_need):
            self._send(held)
        self.held, self.sent_bytes = [], 0

    def _send(self, reduction: _Reduction) -> None:
        reduction.wire, reduction.work = start_average(self.state, reduction.buffer, bf16=self.wire == "bf16")

    def before_stage(self, stage: int) -> None:
        """Applies every update the forward's stage `stage` needs (the model calls it; 0 is the embeddings)."""
        while self.unapplied and self.unapplied[0].need <= stage and self.unapplied[0].work is not None:
            self._apply(self.unapplied.pop(0))

    def settle(self) -> None:
        """Applies every update still pending: the weights, optimizer state and norms are then the step's."""
        self._send_held()  # holds any only after a backward that did not finish
        while self.unapplied:
            self._apply(self.unapplied.pop(0))

    @torch.no_grad()
    def _apply(self, reduction: _Reduction) -> None:
        # Called inside the forward: out of its autocast, so the update's arithmetic is the optimizer's own.
        with torch.autocast(reduction.buffer.device.type, enabled=False):
            self._apply_reduced(reduction)

    def _apply_reduced(self, reduction: _Reduction) -> None:
        self._wait(reduction)
        if reduction.wire is not reduction.buffer:
            reduction.buffer.copy_(reduction.wire)
        for p, grad in zip(reduction.params, reduction.grads):
            p.grad = grad
        squares, norm = self.grad_norms[reduction.step]
        squares.add_(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(reduction.grads))).square())
        self._optimizer_step(reduction.params, self.lrs[reduction.step])
        for p in reduction.params:
            p.grad = None
        if not any(r.step == reduction.step for r in self.unapplied):
            norm.copy_(squares.sqrt())
            del self.lrs[reduction.step], self.grad_norms[reduction.step]
            self.last_waits, self.waits = self.waits, []

    def _wait(self, reduction: _Reduction) -> None:
        """Makes what follows wait for the reduction, timing how long the forward stalls on it."""
        if reduction.buffer.is_cuda:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            reduction.work.wait()
            after.record()
            self.waits.append((before, after))
        else:
            started = time.perf_counter()
            reduction.work.wait()
            self.waits.append((time.perf_counter() - started,))

    def exposed_seconds(self) -> float | None:
        """How long the forward waited for the wire in the last step whose updates are all applied
        (None before one is): the time the stream stalled at each wait, or on CPU the host blocked.
        Waits for that step's events, so read it with the metrics, not every step."""
        if not self.last_waits:
            return None
        if len(self.last_waits[0]) == 1:
            return sum(seconds for (seconds,) in self.last_waits)
        self.last_waits[-1][1].synchronize()
        return sum(before.elapsed_time(after) for before, after in self.last_waits) / 1e3

    def _optimizer_step(self, params: list[torch.nn.Parameter], lr: float) -> None:
        """torch's own step over `params` alone, each in its group, at `lr`: the same arithmetic as
        a step over every parameter (the optimizers update parameter by parameter)."""
        chosen = {id(p) for p in params}
        groups = self.optimizer.param_groups
        subset = [{**group, "params": [p for p in group["params"] if id(p) in chosen], "lr": lr} for group in groups]
        self.optimizer.param_groups = [group for group in subset if group["params"]]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups


def _by_need(reduction: _Reduction) -> tuple[int, int]:
    return reduction.need, reduction.index
