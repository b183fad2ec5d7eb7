"""DDP communication hooks: how each gradient bucket is averaged across workers.

    allreduce      plain fp32 all-reduce (what DDP does without a hook), counted
    bf16           cast to bf16, all-reduce, cast back: half the bytes, no state
    powersgd       torch's PowerSGD (low-rank, error feedback), after `warmup_steps` plain steps
    topk           top-k by magnitude + int8 codes with error feedback (kernels.compression),
                   exchanged with one all-gather; after `warmup_steps` plain steps, sending a
                   share that falls from 25% to k_ratio over `ramp_steps` steps when asked;
                   places go Elias–Fano coded (kernels.wire): the wire 29 % smaller than the
                   payload with int16 offsets at k = 1 %, 45 % at 10 %, unless
                   [parallel] topk_wire = "offsets"
    hierarchical   reduce-scatter inside each NVLink island, all-reduce across islands,
                   all-gather inside the island: the slow links carry 1/island_size of the bytes

Every hook adds the bytes this rank hands to collectives into `CommStats`, so a run's metrics
show what each choice costs on the wire.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from core.errors import NonFiniteGradientError
from core.rules import COMM_HOOKS
from kernels.compression import compress, decompress_accumulate, decompress_sum
from kernels.wire import decode_wires, encode_wire
from workers.comm.groups import IslandGroups
from workers.comm.stats import CommStats

TOPK_WIRES = ("elias_fano", "offsets")

Hook = Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class HookState:
    stats: CommStats
    world_size: int
    warmup_steps: int = 0
    steps_done: int = 0
    """Optimizer steps whose last bucket this hook has reduced."""

    def check(self) -> None:
        """Raises what a hook found but did not stop to report (called once per metrics window)."""

    def step_of(self, bucket: dist.GradBucket) -> int:
        """The step `bucket` belongs to (0 is the first); call once per bucket. Steps are counted by
        DDP's last bucket of each, as torch's PowerSGD counts them: DDP regroups its buckets after
        the first step, and counting calls per bucket index gave an index first seen then a
        warm-up of its own, a dense all-reduce a step late."""
        step = self.steps_done
        if bucket.is_last():
            self.steps_done += 1
        return step


def _future(work: dist.Work, value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future holding `value` once `work` is done. NCCL works have futures (the wait is a stream
    dependency, not a host block); some gloo collectives have none, and on CPU waiting here costs
    nothing worth overlapping."""
    try:
        return work.get_future().then(lambda _: value)
    except RuntimeError:  # "Work::getFuture not implemented"
        work.wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(value)
        return done


def start_average(state: HookState, buffer: torch.Tensor, *, bf16: bool) -> tuple[torch.Tensor, dist.Work]:
    """Starts the all-reduce that averages `buffer` over the ranks, its bytes counted: on the buffer
    itself, divided in place first, or on a bf16 copy of it. Returns (what is reduced, its work).
    The next-forward overlap sends with it too, so both paths compute the same bits."""
    wire = buffer.to(torch.bfloat16) if bf16 else buffer
    state.stats.add(wire.numel() * wire.element_size())
    wire.div_(state.world_size)
    return wire, dist.all_reduce(wire, async_op=True)


def _allreduce(state: HookState, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    _, work = start_average(state, tensor, bf16=False)
    return _future(work, tensor)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _allreduce(state, bucket.buffer())


def bf16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed, work = start_average(state, buffer, bf16=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(compressed)
        return buffer

    return _future(work, compressed).then(decompress)


@dataclass
class PowerSgdHookState(HookState):
    rank: int = 4
    inner: powersgd.PowerSGDState | None = None

    def __post_init__(self) -> None:
        self.inner = powersgd.PowerSGDState(process_group=None,  # the default group: every DDP rank
                                            matrix_approximation_rank=self.rank,
                                            start_powerSGD_iter=max(2, self.warmup_steps),
                                            use_error_feedback=True, warm_start=True)


def powersgd_hook(state: PowerSgdHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.stats.add(_powersgd_bytes(state.inner, bucket))
    return powersgd.powerSGD_hook(state.inner, bucket)


def _powersgd_bytes(inner: powersgd.PowerSGDState, bucket: dist.GradBucket) -> int:
    """What powerSGD_hook will hand to all-reduce for this bucket."""
    if inner.iter < inner.start_powerSGD_iter:
        return bucket.buffer().numel() * bucket.buffer().element_size()
    wire_bytes, _ = powersgd_wire([grad.shape for grad in bucket.gradients()], inner.matrix_approximation_rank,
                                  inner.min_compression_rate, bucket.buffer().element_size())
    return wire_bytes


def powersgd_wire(shapes: Iterable[Sequence[int]], rank: int, min_compression_rate: float = 2.0,
                  element_bytes: int = 4) -> tuple[int, int]:
    """(bytes all-reduced, matrices compressed) by torch's PowerSGD hook, once it compresses, for
    gradients of these shapes: P and Q, (rows + cols) × rank values, for each matrix it compresses
    (by its own rule), the other gradients as they are. The planner costs the hook with it too."""
    total = matrices = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) > 1:
            rows, cols = shape[0], numel // shape[0]
            matrix_rank = min(rows, cols, rank)
            compress_it, _, _ = powersgd._should_compress(rows, cols, matrix_rank, min_compression_rate)
            if compress_it:
                total += (rows + cols) * matrix_rank * element_bytes
                matrices += 1
                continue
        total += numel * element_bytes
    return total, matrices


RAMP_START_RATIO = 0.25
"""Share of entries the top-k hook sends on its first compressed step when it ramps."""


def ramped_k_ratio(k_ratio: float, compressed_steps: int, ramp_steps: int) -> float:
    """The share to send after `compressed_steps` compressed steps: from RAMP_START_RATIO down to
    k_ratio, exponentially over ramp_steps steps (DGC's sparsity warm-up), then k_ratio. Every rank
    computes the same share for the same step, so their payloads keep one size for the all-gather."""
    if compressed_steps >= ramp_steps or k_ratio >= RAMP_START_RATIO:
        return k_ratio
    return RAMP_START_RATIO * (k_ratio / RAMP_START_RATIO) ** (compressed_steps / ramp_steps)


@dataclass
class TopkHookState(HookState):
    k_ratio: float = 0.01
    ramp_steps: int = 0
    """Compressed steps over which the share sent falls from RAMP_START_RATIO to k_ratio."""
    elias_fano: bool = True
    """Send places Elias–Fano coded (kernels.wire), not as the payload's offsets."""
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    nonfinite: torch.Tensor | None = None
    """NaN/inf entries any rank's buckets held since the last check, counted on the device: reading
    it in the hook would block the host on every bucket and stop communication overlapping backward."""

    def residual_for(self, bucket: dist.GradBucket) -> torch.Tensor:
        buffer = bucket.buffer()
        residual = self.residuals.get(bucket.index())
        if residual is None or residual.numel() != buffer.numel():  # DDP rebuilds buckets after step 1
            residual = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
            self.residuals[bucket.index()] = residual
        return residual

    def k_ratio_for(self, step: int) -> float:
        """The share to send at `step` (one past the warm-up or later)."""
        return ramped_k_ratio(self.k_ratio, step - self.warmup_steps, self.ramp_steps)

    def check(self) -> None:
        if self.nonfinite is not None and (count := int(self.nonfinite)):
            numel = sum(r.numel() for r in self.residuals.values())
            self.nonfinite = None
            raise NonFiniteGradientError(count, numel, with_residual=True)


def topk_hook(state: TopkHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    step = state.step_of(bucket)
    if step < state.warmup_steps:
        return _allreduce(state, bucket.buffer())
    buffer = bucket.buffer()
    mine = compress(buffer, state.residual_for(bucket), state.k_ratio_for(step), check_finite=False)
    wire = encode_wire(mine) if state.elias_fano else mine.payload
    state.stats.add(wire.numel())
    gathered = torch.empty(state.world_size * wire.numel(), dtype=wire.dtype, device=wire.device)

    def accumulate(fut: torch.futures.Future) -> torch.Tensor:
        payloads = gathered.view(state.world_size, -1)  # the rows decompress_sum reads
        if state.elias_fano:
            payloads = decode_wires(payloads, mine.layout)
        rows = [mine.with_payload(row) for row in payloads]
        # Every rank sees every payload's NaN count, so a poisoned bucket anywhere stops all ranks
        # at the next check(); counted on the device, the hook never waits for it.
        seen = torch.stack([row.header[1] for row in rows]).sum()
        state.nonfinite = seen if state.nonfinite is None else state.nonfinite + seen
        if buffer.dtype == torch.float32:  # one pass writes the average straight into DDP's bucket
            decompress_sum(buffer, payloads, mine, state.world_size)
            return buffer
        total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for row in rows:
            decompress_accumulate(total, row)
        buffer.copy_(total.div_(state.world_size))
        return buffer

    work = dist.all_gather_into_tensor(gathered, wire, async_op=True)
    return _future(work, gathered).then(accumulate)


@dataclass
class HierarchicalHookState(HookState):
    islands: IslandGroups | None = None
    padded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket whose length the island size does not divide: a padded copy, kept across steps."""

    def working_buffer(self, bucket: dist.GradBucket) -> torch.Tensor:
        buffer = bucket.buffer()
        size = self.islands.island_size
        if buffer.numel() % size == 0:
            return buffer
        padded = self.padded.get(bucket.index())
        if padded is None or padded.numel() != -(-buffer.numel() // size) * size:
            padded = torch.zeros(-(-buffer.numel() // size) * size, dtype=buffer.dtype, device=buffer.device)
            self.padded[bucket.index()] = padded
        padded[:buffer.numel()] = buffer
        return padded


def hierarchical_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatter in the island, all-reduce the shard across islands, all-gather in the island.

    Needs islands of equal size (the planner makes them so); bytes across islands are
    1/island_size of a flat all-reduce's."""
    islands = state.islands
    buffer = bucket.buffer()
    work_buffer = state.working_buffer(bucket)
    work_buffer.div_(state.world_size)
    shard = torch.empty(work_buffer.numel() // islands.island_size, dtype=buffer.dtype, device=buffer.device)
    crossings = 2 if islands.inter_group is not None else 1  # all-gather, and the cross-island all-reduce
    state.stats.add((work_buffer.numel() + crossings * shard.numel()) * buffer.element_size())

    def across_islands(fut: torch.futures.Future) -> torch.Tensor:
        if islands.inter_group is not None:
            dist.all_reduce(shard, group=islands.inter_group, async_op=True).wait()
        return shard

    def gather_in_island(fut: torch.futures.Future) -> torch.Tensor:
        dist.all_gather_into_tensor(work_buffer, shard, group=islands.intra_group, async_op=True).wait()
        if work_buffer is not buffer:
            buffer.copy_(work_buffer[:buffer.numel()])
        return buffer

    work = dist.reduce_scatter_tensor(shard, work_buffer, group=islands.intra_group, async_op=True)
    return _future(work, shard).then(across_islands).then(gather_in_island)


def make_hook(name: str, *, stats: CommStats, world_size: int, islands: IslandGroups | None, warmup_steps: int,
              powersgd_rank: int, topk_ratio: float, topk_ramp_steps: int = 0,
              topk_wire: str = "elias_fano") -> tuple[Hook, HookState]:
    if name == "allreduce":
        return allreduce_hook, HookState(stats=stats, world_size=world_size)
    if name == "bf16":
        return bf16_hook, HookState(stats=stats, world_size=world_size)
    if name == "powersgd":  # never over gloo: the Plan refuses that (core/rules.py)
        return powersgd_hook, PowerSgdHookState(stats=stats, world_size=world_size, warmup_steps=warmup_steps,
                                                rank=powersgd_rank)
    if name == "topk":
        if topk_wire not in TOPK_WIRES:
            raise ValueError(f"unknown topk wire {topk_wire!r} ([parallel] topk_wire); choose one of "
                             f"{', '.join(TOPK_WIRES)}")
        return topk_hook, TopkHookState(stats=stats, world_size=world_size, warmup_steps=warmup_steps,
                                        k_ratio=topk_ratio, ramp_steps=topk_ramp_steps,
                                        elias_fano=topk_wire == "elias_fano")
    if name == "hierarchical":
        return hierarchical_hook, HierarchicalHookState(stats=stats, world_size=world_size, islands=islands)
    raise ValueError(f"unknown comm hook {name!r}; choose one of {', '.join(COMM_HOOKS)}")
