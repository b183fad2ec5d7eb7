"""What a DDP comm hook does to a step, as the planner costs it: the bytes it puts on the wire, the
collective that carries them, and the hook's own compute.

    hook = CommHookCost.for_job(config)      # [parallel] comm_hook, on the model's own parameter shapes
    hook.wire_bytes                          # one rank's bytes per step, once the hook compresses
    hook.compute_seconds(device_type, ranks) # its kernels (or PowerSGD's host work) per step

The wire sizes come from the functions the hooks themselves use (kernels.compression's payload
layout and kernels.wire's encoding, workers/comm/hooks.py's PowerSGD rule): on GPT-2 124M, topk at
1 % is costed at 3,294,000 bytes a step and the hook sent 3,294,752 on two H200s (4,620,560 and
4,621,248 with topk_wire = "offsets"). PowerSGD's count over NCCL is checked
against the all-reduces torch's hook issues (tests/gpu/test_engine_nccl.py). The compute rates are
fitted to measured runs (planning/compute.py, HOOK_COMPUTE). The warm-up steps (plain all-reduce)
are not costed: the prediction is the steady state. What a hook keeps between steps (top-k's
residual, PowerSGD's error feedback) counts against each worker's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config import JobConfig
from core.plan import DeviceKind
from kernels.compression import payload_layout
from kernels.wire import wire_nbytes
from planning.compute import (
    ELIAS_FANO_CPU_CORE_NS_PER_ELEMENT,
    ELIAS_FANO_DECODE_TRAFFIC,
    ELIAS_FANO_LAUNCH_SECONDS_PER_ELEMENT,
    HOOK_COMPUTE,
    POWERSGD_HOST_SECONDS_PER_MATRIX,
)
from planning.devices import DeviceType
from planning.model_size import model_facts
from workers.comm.hooks import powersgd_wire
from workers.models import make_workload

COMPRESSING_HOOKS = ("bf16", "powersgd", "topk")
"""The hooks that send fewer bytes than the gradient buckets hold."""


def _core_seconds(core_ns: float, device: DeviceType) -> float:
    """Core-nanoseconds of work shared among a CPU worker's cores, in seconds."""
    return core_ns * 1e-9 / max(device.cores, 1)


def gradient_element_bytes(config: JobConfig) -> int:
    """Bytes of a gradient element in DDP's buckets: 2 with [train] bf16_weights (the copy's
    gradients are bf16), else 4."""
    return 2 if config.train.bf16_weights else 4


@dataclass(frozen=True, slots=True)
class CommHookCost:
    name: str
    wire_bytes: float
    """Bytes one rank hands to the collective per step (for an all-gather, its own payload)."""
    buffer_bytes: float
    """Bytes of DDP's gradient buckets per step: what the bucket size is counted in."""
    all_gather: bool = False
    """True for top-k: every rank receives every other rank's payload, so what each receives grows
    with the ranks; the others all-reduce."""
    collectives_per_bucket: int = 1
    """Collectives each bucket waits on in turn (PowerSGD: the uncompressed tensors, P, then Q)."""
    elements: int = 0
    """Gradient elements the hook's kernels pass over per step."""
    host_seconds: float = 0.0
    """Per-step work bound by the host, not the device (PowerSGD's per-matrix steps)."""
    state_bytes: float = 0.0
    """Bytes the hook keeps on each worker between steps: top-k's fp32 residual, PowerSGD's fp32
    error feedback of every bucket and its P and Q."""
    elias_fano: bool = False
    """topk's places go Elias–Fano coded: an encode a step, and a decode of every rank's wire."""
    overlaps_backward: bool = True
    """False where the step was measured to wait for all of the hook's communication (PowerSGD,
    whose buckets each chain three collectives through compute: on two H200s, the step exceeded
    the same hook's one-rank step by 9.2 ms over a 3.4 GB/s link, and its collectives were
    costed at 8.8 ms)."""

    @classmethod
    def plain(cls, buffer_bytes: float) -> CommHookCost:
        """DDP's own all-reduce of its buckets."""
        return cls("allreduce", buffer_bytes, buffer_bytes)

    @classmethod
    def for_job(cls, config: JobConfig, name: str | None = None, *, topk_wire: str | None = None) -> CommHookCost:
        """The job's [parallel] comm_hook, or the hook `name` on the same job (topk_wire: the other
        way of sending topk's places)."""
        shapes = model_facts(make_workload(config.model), config.model.seq_len).shapes
        elements = sum(math.prod(shape) for shape in shapes)
        buffer = elements * gradient_element_bytes(config)
        name = name or config.parallel.comm_hook
        if name == "bf16":
            return cls(name, elements * 2, buffer, elements=elements)
        if name == "topk":
            layout = payload_layout(elements, config.parallel.topk_ratio)
            elias_fano = (topk_wire or config.parallel.topk_wire) == "elias_fano"
            wire = wire_nbytes(layout) if elias_fano else layout.nbytes
            return cls(name, wire, buffer, all_gather=True, elements=elements, state_bytes=4 * elements,
                       elias_fano=elias_fano)
        if name == "powersgd":
            wire, matrices = powersgd_wire(shapes, config.parallel.powersgd_rank)
            return cls(name, wire, buffer, collectives_per_bucket=3,
                       host_seconds=matrices * POWERSGD_HOST_SECONDS_PER_MATRIX, state_bytes=4 * elements + wire,
                       overlaps_backward=False)
        return cls(name, buffer, buffer)  # allreduce, hierarchical, auto: the buckets as they are

    def compute_seconds(self, device: DeviceType, ranks: int, tensor_parallel: int = 1) -> float:
        """The hook's own work per step on `device` for one rank's 1/tensor_parallel of the gradients.
        It runs on the compute stream, so it lengthens the step: its passes over the gradients at the
        rate fitted for the hook, each other rank's payload read at the device's memory bandwidth
        (and, Elias–Fano coded, decoded), and PowerSGD's host-bound work. One rank has no DDP and no hook."""
        if ranks <= 1:
            return 0.0
        elements = self.elements / tensor_parallel
        seconds = self.host_seconds
        cpu = device.kind == DeviceKind.CPU
        rate = HOOK_COMPUTE.get(self.name)
        if rate is not None:
            seconds += (_core_seconds(elements * rate.cpu_core_ns_per_element, device) if cpu
                        else elements * rate.gpu_bytes_per_element / device.memory_bytes_per_s)
        if self.elias_fano:  # on CPU the torch twins encode once and decode every rank's wire
            seconds += (_core_seconds((1 + ranks) * elements * ELIAS_FANO_CPU_CORE_NS_PER_ELEMENT, device) if cpu
                        else elements * ELIAS_FANO_LAUNCH_SECONDS_PER_ELEMENT)
        if self.all_gather:
            moved = ELIAS_FANO_DECODE_TRAFFIC if self.elias_fano else 1
            seconds += (ranks - 1) * moved * self.wire_bytes / tensor_parallel / device.memory_bytes_per_s
        return seconds

    @property
    def compresses(self) -> bool:
        return self.wire_bytes < self.buffer_bytes
