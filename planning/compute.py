"""What a step's compute costs: model FLOPs utilisation anchors, comm hooks' own kernels, CPU rates."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

MFU_ANCHORS = ((768, 0.34), (2048, 0.53))
"""(n_embd, model FLOPs utilisation) measured in eager bf16 on one H200 (shared/bench, DESIGN.md):
GPT-2 124M at B=32, T=1024 and GPT 1.3B at B=8, T=2048. Wider models keep tensor cores busier. Eager
steps were measured whole, so this share covers everything in them (ComputeModel.traffic is zero)."""


@dataclass(frozen=True, slots=True)
class MemoryTraffic:
    """What a compiled step moves through device memory besides its matrix products and attention:
    effective bytes at the GPU's nominal memory bandwidth, so a GPU with less bandwidth per FLOP (an
    L4, an RTX card) pays more for them than an H200 does. Fitted to torch.profiler kernel groups of
    the engine's steps on one H200, two models each (bytes = the group's seconds × its 4.8 TB/s
    nominal). Where the Llama-3.2-1B shape differs from GPT 1.3B at the same width is here, not in the
    FLOPs: a 128 K vocabulary (loss and embedding) and half the tokens per parameter (the optimizer)."""

    per_token_layer_width: float = 0.0
    """Norms, activations, residual adds, casts and the step's idle gaps: each token, block and unit of
    the residual stream's width (Inductor's fused elementwise kernels)."""
    per_logit: float = 0.0
    """The loss over each token's vocabulary row (the fused loss's log-softmax, forward and backward)."""
    per_embedding_element: float = 0.0
    """Per micro-step, each element of the vocabulary × width embedding: its dense gradient (zeroed,
    scattered into, summed with a tied head's), eager kernels outside the compiled blocks."""
    per_parameter_step: float = 0.0
    """Per step, each parameter a worker updates: AdamW's read and write of weights, gradients and both
    moments, and clipping's norm."""


COMPILED_MFU_ANCHORS = ((768, 0.694), (2048, 0.721))
"""(n_embd, share of the dense bf16 peak) the compiled engine's matrix products and attention reach
(benchmarks/step.py --profile on one H200, bf16 autocast: GPT-2 124M at B=32, T=1024, 40.8 ms of
matmul and attention a step; GPT 1.3B at B=8, T=2048, 208.3 ms; benchmarks/RESULTS.md, 2026-11-29).
The rest of the step is COMPILED_TRAFFIC; the whole step then reaches 0.47 and 0.57 of peak."""
COMPILED_TRAFFIC = MemoryTraffic(per_token_layer_width=210.0, per_logit=10.1, per_embedding_element=199.0,
                                 per_parameter_step=52.9)
"""The same profiles' other groups (124M / 1.3B): elementwise with idle 12.0 / 34.2 ms and the loss 4.7 / 2.8,
both terms scale with tokens, so solved together to give each model's 16.7 / 37.0 ms exactly; eager
elementwise and copies (the embedding's gradient) 1.7 / 4.0, fused AdamW with clipping 1.4 / 14.2, the
mean of the two per unit. Measured with torch's fused AdamW, which writes the clipped gradients back; the
engine now steps through kernels.adamw's fp32 form on CUDA, 4 bytes a parameter less (not yet measured)."""
BF16_WEIGHTS_MFU_ANCHORS = ((768, 0.689), (2048, 0.724))
"""The compiled engine with [train] bf16_weights (a bf16 compute copy stepped by kernels.adamw's one
pass): GPT-2 124M as above, 41.1 ms (2026-11-30), and the Llama-3.2-1B shape at B=4, T=2048, 94.0 ms
(2026-12-03), matmul and attention a step."""
BF16_WEIGHTS_TRAFFIC = MemoryTraffic(per_token_layer_width=180.0, per_logit=7.0, per_embedding_element=145.0,
                                     per_parameter_step=45.5)
"""The same profiles (124M / Llama-1B), the mean of the two per unit: elementwise with idle 9.2 / 12.0 ms,
loss 2.3 / 1.6, eager elementwise 1.5 / the 5.6 ms outside the listed groups, the one-pass AdamW 1.2 / 11.5.
(Solving the first two together, as for autocast, gives the loss a negative cost: SwiGLU and RoPE make
more elementwise work per block and width than GPT's GELU.)"""


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a GPU step's cost depends on, from the model's counted facts and the job."""

    flops_per_sample: float
    seq_len: int
    n_layer: int
    width: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class HookComputeRate:
    """What a compressing comm hook's own kernels cost per gradient element per step."""

    gpu_bytes_per_element: float
    """Effective bytes of device memory traffic: seconds = elements × this / the GPU's memory bandwidth."""
    cpu_core_ns_per_element: float
    """Core-nanoseconds on CPU workers (the torch twins), divided among a worker's cores."""


HOOK_COMPUTE = {
    "bf16": HookComputeRate(gpu_bytes_per_element=35.6, cpu_core_ns_per_element=3.9),
    "topk": HookComputeRate(gpu_bytes_per_element=60.3, cpu_core_ns_per_element=88.0),
}
"""Fitted to one-rank runs of GPT-2 124M's 124.4 M gradient elements (benchmarks/multigpu.py --only
hooks, 2026-11-30): on an H200 (4.8 TB/s), bf16 0.92 ms and topk at 1 % 1.56 ms a step (earlier calls
0.77–1.28 and 1.06–1.77 ms: read these to within about 1.5×; those runs summed one payload); on this
project's 2-core CPU machine, 25 M elements: bf16 49 ms, topk (compress + decompress_sum of 2
payloads) 1.0–1.1 s."""

ELIAS_FANO_LAUNCH_SECONDS_PER_ELEMENT = 5.9e-12
"""The topk hook's Elias–Fano wire (kernels.wire) on top of HOOK_COMPUTE["topk"], on a GPU, at DDP's
25 MB buckets: benchmarks/kernels.py on an H200, 6.25 M elements at k = 1 %, encode 10.3 µs and
decode of 8 rows 26.8 µs (37.1 µs a bucket). Mostly launches and small kernels, so not scaled by
memory bandwidth; measured on an H200 only. Per element it falls with the bucket (68 µs at 100 MB,
491 µs at 1 GB), so larger buckets cost less than this. Two H200s training GPT-2 124M measured
0.4 ms a step more than the payload sent as it is (one call; single steps read to about 1 ms),
where this costs 0.74 ms."""
ELIAS_FANO_DECODE_TRAFFIC = 7
"""Bytes a GPU's decode moves per byte of each rank's wire at k = 1 %: the unary part read twice
and the low bits once (about 0.6 of the wire), the payload zeroed and written (2.4), its codes and
scales copied (1.1), and the entries' places filled and written as int32 (3.3)."""
ELIAS_FANO_CPU_CORE_NS_PER_ELEMENT = 1.0
"""The torch twins on CPU workers, per gradient element: to encode once, and to decode each rank's
wire (on this project's 2-core machine, 6.25 M elements at k = 1 %: encode 3.2 ms, 8 rows 25.5 ms)."""

POWERSGD_HOST_SECONDS_PER_MATRIX = 3.1e-4
"""torch's PowerSGD hook steps each compressed matrix from Python (orthogonalisation column by
column), so its cost follows the matrices, not the bytes: 15.4 ms a step for GPT-2 124M's 50 on an
H200 host (28.6 ms in an earlier call on another host)."""


CPU_UTILISATION_OF_MEASURED = 0.31
"""Share of the probe's measured product rate per core (topology/device_bench.py: 1024³, one thread on every
core) that a CPU worker's training step reaches beyond its fixed overhead, used only where the probe gave no
training rate (bf16 workers, maps probed before it measured one): the demo model (examples/cpu-tiny.toml, two
workers of micro-batch 16) on a 2-core Intel Xeon, nearly idle, in two `make demo` runs: the probe read 203
and 214 GFLOP/s a core and a step took 178 and 205 ms, shares 0.35 and 0.28 (benchmarks/RESULTS.md,
2026-12-03). It is that CPU's share, not every CPU's: on a 2-core AMD EPYC the product read 74-145 GFLOP/s a
core and the same step reached about half of it, so the share predicted 511 ms for a 245 ms step. Where the
probe trained its reference block, CPU workers are planned at that rate instead (ComputeModel)."""


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Per-device step time: FLOPs / (peak × utilisation) + memory traffic / bandwidth + a fixed cost
    per micro-step, and per step the optimizer's traffic.

    Utilisation is interpolated in log(n_embd) between measured anchors and held flat outside
    them; the same share of peak is assumed for every GPU (its own peak, or the peak its measured
    product rate implies: MIG slices and slower models are slower in proportion), and the traffic
    runs at its memory bandwidth (its measured copy's nominal equivalent, else the catalog's). CPU workers train at
    the rate the probe measured training a transformer block on their node's cores (fp32), else at a
    share of its measured product rate, else of a nominal peak per core."""

    mfu_anchors: tuple[tuple[int, float], ...] = MFU_ANCHORS
    traffic: MemoryTraffic = MemoryTraffic()
    """Beside the anchors' FLOPs: zero where the anchors cover the whole step (eager)."""
    micro_step_overhead_s_per_layer: float = 1e-4
    """Launch and Python overhead per transformer block per micro-step (eager: ~20 kernels × 5 µs)."""
    cpu_gflops_per_core: float = 100.0
    """fp32 peak of one core (2 AVX2/AVX-512 FMA units at ~3 GHz)."""
    cpu_utilisation: float = 0.25
    """Share of that peak a small transformer reaches in torch on CPU (the CPU demo measures ~27 GFLOP/s a core)."""
    cpu_bf16_utilisation: float = 0.0315
    """The same in bf16: the CPU demo's model trained at 1,078 tok/s in bf16 against 8,557 predicted at
    the fp32 share on a 2-core AMD EPYC without bf16 units (no AVX512-BF16 or AMX), so torch emulates
    it. CPUs with AMX would be faster; the run's measured step time, not this, is what the bill uses."""
    cpu_measured_utilisation: float = CPU_UTILISATION_OF_MEASURED
    cpu_overhead_s_per_layer: float = 5e-4
    """Per block per micro-step on CPU workers: Python and the work beside the blocks (the loss, the
    optimizer's step over every parameter), which a measured block rate leaves out."""
    efficiency: tuple[tuple[str, float], ...] = ()
    """(device model, factor) from a calibration: that model's compute runs `factor` times as fast as
    the figures above predict (planning/calibration.py)."""

    @classmethod
    def compiled(cls, *, bf16_weights: bool = False) -> ComputeModel:
        if bf16_weights:
            return cls(mfu_anchors=BF16_WEIGHTS_MFU_ANCHORS, traffic=BF16_WEIGHTS_TRAFFIC,
                       micro_step_overhead_s_per_layer=2e-5)
        return cls(mfu_anchors=COMPILED_MFU_ANCHORS, traffic=COMPILED_TRAFFIC, micro_step_overhead_s_per_layer=2e-5)

    def with_efficiency(self, efficiency: dict[str, float]) -> ComputeModel:
        return replace(self, efficiency=tuple(sorted(efficiency.items())))

    def efficiency_of(self, model: str) -> float:
        return dict(self.efficiency).get(model, 1.0)

    def utilisation(self, n_embd: int) -> float:
        return _interpolate_log(self.mfu_anchors, n_embd)

    def gpu_seconds_per_sample(self, peak_tflops: float, memory_bytes_per_s: float, step: StepShape) -> float:
        traffic = self.traffic
        bytes_per_token = step.n_layer * step.width * traffic.per_token_layer_width + step.vocab_size * traffic.per_logit
        return (step.flops_per_sample / (peak_tflops * 1e12 * self.utilisation(step.width))
                + step.seq_len * bytes_per_token / memory_bytes_per_s)

    def gpu_micro_step_seconds(self, memory_bytes_per_s: float, step: StepShape) -> float:
        """A GPU micro-step's traffic whatever its micro-batch: the embedding's gradient."""
        return step.vocab_size * step.width * self.traffic.per_embedding_element / memory_bytes_per_s

    def gpu_optimizer_seconds(self, memory_bytes_per_s: float, parameters: float) -> float:
        """Once a step, over the `parameters` a worker updates (its shard under FSDP)."""
        return parameters * self.traffic.per_parameter_step / memory_bytes_per_s

    def cpu_samples_per_second(self, tflops: float, flops_per_sample: float, dtype: str = "fp32", *,
                               measured: bool = False, training_tflops: float = 0.0) -> float:
        """A CPU slot's `training_tflops` (its cores' measured rate training the probe's reference block,
        FLOPs counted as the model's are) as it is: that rate is what a step of small matrices, attention
        and elementwise work reaches on this CPU. Without it, `tflops` (its cores' measured product rate
        in the job's dtype, fp32 or bf16, or the nominal peak) at the share of it a training step reaches."""
        if training_tflops:
            return training_tflops * 1e12 / flops_per_sample
        if measured:
            utilisation = self.cpu_measured_utilisation
        else:
            utilisation = self.cpu_bf16_utilisation if dtype == "bf16" else self.cpu_utilisation
        return tflops * 1e12 * utilisation / flops_per_sample

    def overhead_s(self, n_layer: int, *, cpu: bool) -> float:
        return n_layer * (self.cpu_overhead_s_per_layer if cpu else self.micro_step_overhead_s_per_layer)


@functools.lru_cache(maxsize=64)
def _interpolate_log(anchors: tuple[tuple[int, float], ...], x: int) -> float:
    """Linear in log(x) between sorted anchors, flat outside them."""
    anchors = tuple(sorted(anchors))
    if x <= anchors[0][0]:
        return anchors[0][1]
    for (x0, y0), (x1, y1) in zip(anchors, anchors[1:]):
        if x <= x1:
            return y0 + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (y1 - y0)
    return anchors[-1][1]


