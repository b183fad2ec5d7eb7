"""Which choices go together: each rule a pure function, one place for every caller.

    refusal = comm_hook_refusal("powersgd", backend="gloo")    # Refusal(what, where, fix) or None
    if refusal: raise refusal.error()

The job config's checks, the planner (which hooks "auto" and its notes may consider, what a device
pool allows) and the Plan's own validation all ask these, so a combination that cannot run is
refused on the driver, before Ray starts, with the same words wherever it is found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import ConfigError

COMM_HOOKS = ("allreduce", "bf16", "powersgd", "topk", "hierarchical")
"""The DDP comm hooks the workers run (workers/comm/hooks.py); a plan names one of them."""
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""What a plan trains in ("auto" in the config resolves to fp32 or bf16)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a combination cannot run: the same three parts as every ArchipelagoError."""

    what: str
    where: str
    fix: str

    def error(self) -> ConfigError:
        return ConfigError(self.what, where=self.where, fix=self.fix)


def comm_hook_refusal(hook: str, *, backend: str, strategy: str = "ddp", bf16_weights: bool = False,
                      compiled_autograd: bool = False) -> Refusal | None:
    """Whether DDP comm hook `hook` ("auto" included) can run over `backend` ("gloo" or "nccl") with
    this strategy, weight precision and compile mode."""
    where = "[parallel] comm_hook"
    if strategy != "ddp" and hook not in ("allreduce", "auto"):
        return Refusal(f"{hook!r} is a DDP comm hook; FSDP reduce-scatters its own gradients", where,
                       'use strategy = "ddp" with this hook, or comm_hook = "allreduce" with fsdp')
    if compiled_autograd and hook not in ("allreduce", "auto"):
        return Refusal("compiled autograd captures DDP's all-reduce itself, so comm hooks cannot run",
                       "[compile] ddp_mode", 'use ddp_mode = "ddp_optimizer" with a comm hook, or comm_hook = "allreduce"')
    if hook == "powersgd" and backend == "gloo":
        return Refusal("powersgd hangs over gloo (CPU workers, backend = \"gloo\", several MIG slices of one GPU): "
                       "torch's PowerSGD hook waits for one all-reduce inside the callback of another, on the gloo "
                       "thread that would have to run it", where,
                       'use comm_hook = "bf16" or "topk" over gloo; powersgd needs GPUs reducing over nccl')
    if bf16_weights and hook not in ("allreduce", "auto", "hierarchical"):
        return Refusal(f"{hook!r} compresses fp32 gradients; with bf16_weights they are bf16 already", where,
                       'use comm_hook = "allreduce" or "hierarchical", or bf16_weights = false')
    return None


def overlap_refusal(*, strategy: str, hook: str, precision: str, grad_clip: float = 0.0, bf16_weights: bool = False,
                    compiled_autograd: bool = False, builtin_model: bool = True) -> Refusal | None:
    """Whether the next-forward overlap can run with these choices (precision as configured or resolved;
    a plan, which holds no clipping, compile or model settings, asks with the defaults)."""
    where, fix = "[parallel] overlap", 'or set overlap = "off"'
    if not builtin_model:
        return Refusal("applies updates between a model's blocks, which only the built-in gpt and llama models "
                       "let it do", where, f'use [model] kind = "gpt" or "llama", {fix}')
    if strategy != "ddp":
        return Refusal("reorders DDP's buckets; FSDP2 reduce-scatters its own", where, f'use strategy = "ddp", {fix}')
    if hook not in ("allreduce", "bf16"):
        return Refusal(f"sends plain or bf16 buckets itself, so comm_hook {hook!r} would not run", where,
                       f'use comm_hook = "allreduce" or "bf16", {fix}')
    if grad_clip != 0:
        return Refusal("applies each bucket's update before the others have arrived, so the global gradient norm "
                       f"that clipping (grad_clip = {grad_clip:g}) divides by is not known yet", where,
                       f"set [train] grad_clip = 0, {fix}")
    if precision == "fp16":
        return Refusal("applies updates before every bucket has arrived, so a step whose gradients overflow cannot "
                       "be skipped as fp16's loss scaling needs", where, f'use precision = "bf16", {fix}')
    if bf16_weights:
        return Refusal("steps the fp32 model's optimizer per bucket; bf16_weights steps a separate bf16 copy", where,
                       f"set [train] bf16_weights = false, {fix}")
    if compiled_autograd:
        return Refusal("needs DDP's comm hook, which compiled autograd replaces", where,
                       f'set [compile] ddp_mode = "auto", {fix}')
    return None


def tensor_parallel_refusal(size: int, *, use_gpu: bool = True, builtin_model: bool = True, hook: str = "allreduce",
                            overlap: str = "off", precision: str = "bf16", bf16_weights: bool = False, qat: str = "",
                            divisible: dict[str, int] | None = None) -> Refusal | None:
    """Whether layers can be split over `size` GPUs with the rest of the job (1: nothing split; 0: the
    planner picks, and these are asked again for its pick). `divisible`: the model's sizes that each
    rank must get an equal whole share of ({"[model] n_head": 12, …})."""
    if size <= 1:
        return None
    where, fix = "[placement] tensor_parallel_size", "or set tensor_parallel_size = 1"
    if not use_gpu:  # the planner splits layers over an NVLink island's GPUs; CPU slots have none
        return Refusal(f"tensor_parallel_size = {size} splits layers over the GPUs of an NVLink island, and this job "
                       "trains on CPUs ([cluster] use_gpu = false), whose workers split the batch only", where,
                       "set tensor_parallel_size = 1, or use_gpu = true on GPUs")
    if not builtin_model:
        return Refusal(f"tensor_parallel_size = {size} splits layers by a plan only the built-in gpt and llama models have", where,
                       f'use [model] kind = "gpt" or "llama" (FSDP2 shards a custom or hf model: strategy = "fsdp"), {fix}')
    if hook not in ("allreduce", "auto"):
        return Refusal(f"tensor_parallel_size = {size} runs the data-parallel side on FSDP2, which has no DDP comm hook such as {hook!r}",
                       "[parallel] comm_hook", f'set comm_hook = "allreduce", {fix}')
    if overlap != "off":
        return Refusal(f"tensor_parallel_size = {size} runs the data-parallel side on FSDP2, whose reduce-scatters the next-forward overlap cannot "
                       "reorder", "[parallel] overlap", f'set overlap = "off", {fix}')
    if precision == "fp8":
        return Refusal(f"tensor_parallel_size = {size} has no float8 plan for split layers here", "[train] precision", f'use precision = "bf16", {fix}')
    if qat:
        return Refusal(f"tensor_parallel_size = {size} has no plan for the fake-quantized layers of qat = {qat!r}",
                       "[train] qat", f'set qat = "", {fix}')
    if bf16_weights:
        return Refusal(f"tensor_parallel_size = {size} gathers bf16 weights through FSDP2's mixed-precision policy, not a bf16 copy",
                       "[train] bf16_weights", f"set bf16_weights = false, {fix}")
    for name, value in (divisible or {}).items():
        if value % size:
            common = math.gcd(*divisible.values())  # a size every one of them splits over
            sizes = [str(d) for d in range(1, common + 1) if common % d == 0]
            listed = sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} or {sizes[-1]}"
            return Refusal(f"{name} = {value} does not split evenly over {size} ranks", where,
                           f"set tensor_parallel_size to {listed}")
    return None


def precision_refusal(precision: str, *, use_gpu: bool, compile: bool) -> Refusal | None:
    """Whether [train] precision can train on these devices (CPU or GPU) with compile on or off."""
    where = "[train] precision"
    if precision in ("fp16", "fp8") and not use_gpu:
        return Refusal(f"{precision} training needs CUDA GPUs; this job trains on CPU workers", where,
                       'use "fp32" or "bf16" on CPU workers, or set [cluster] use_gpu = true')
    if precision == "fp8" and not compile:
        return Refusal("float8 requires compile (eager float8 is slower than bf16)", where, "set [compile] enable = true")
    return None


def bf16_weights_refusal(precision: str, *, use_gpu: bool, strategy: str) -> Refusal | None:
    """Whether [train] bf16_weights (a bf16 copy of the model trains, fp32 masters step) fits the rest."""
    where = "[train] bf16_weights"
    if precision not in ("auto", "bf16"):
        return Refusal(f'keeps a bf16 copy of the model, which precision = "{precision}" does not train in', where,
                       'set precision = "bf16", or bf16_weights = false')
    if precision == "auto" and not use_gpu:
        return Refusal('keeps a bf16 copy of the model, and precision = "auto" trains CPU workers in fp32', where,
                       'set precision = "bf16" to train the CPU workers in bf16 (slow without bf16 units), or '
                       "bf16_weights = false")
    if strategy != "ddp":
        return Refusal("FSDP2 already gathers bf16 weights from fp32 shards (its mixed-precision policy)", where,
                       'set bf16_weights = false with strategy = "fsdp"')
    return None
