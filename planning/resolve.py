"""What a plan decides besides where the workers run: precision, backend, the comm hook's settings,
the bucket size, the overlap and activation checkpointing, resolved from the job config once.

    choices = plan_choices(config, use_gpu=True, replicas=8, comm_hook="bf16", backend="nccl",
                           bucket_bytes=2**25, prediction=prediction)      # Plan(**choices, …)
    spec = uniform_spec(config, world_size=2, micro_batch_size=4, grad_accum_steps=1)

The planner builds every Plan with `plan_choices`; `uniform_spec` gives tests and benchmarks, which
run the worker engine without the planner's search, a spec resolved the same way.
"""

from __future__ import annotations

from core.config import JobConfig
from core.plan import DataParallel, HookSettings, Plan, Prediction
from core.spec import WorkerSpec
from planning.model_size import model_facts
from workers.models import make_workload


def resolve_precision(requested: str, *, use_gpu: bool) -> str:
    """[train] precision for the devices: "auto" is bf16 on GPUs and fp32 on CPUs."""
    if requested != "auto":
        return requested
    return "bf16" if use_gpu else "fp32"


def overlap_backward_share(config: JobConfig, prediction: Prediction | None) -> float:
    """[parallel] overlap_backward_share, or for 0 the predicted backward time (two thirds of the
    compute) over the predicted communication time, at most 1 (1 without a prediction)."""
    if config.parallel.overlap_backward_share > 0:
        return config.parallel.overlap_backward_share
    if prediction is None or prediction.communication_seconds <= 0:
        return 1.0
    return min(1.0, 2 / 3 * prediction.compute_seconds / prediction.communication_seconds)


def plan_choices(config: JobConfig, *, use_gpu: bool, replicas: int, data_parallel: DataParallel,
                 comm_hook: str, backend: str, bucket_bytes: int | None,
                 prediction: Prediction | None) -> dict:
    """The Plan fields besides placement and batch. `comm_hook` is the hook to run ("auto" already
    resolved), `backend` the one the devices need (gloo on CPUs and for several MIG slices of a GPU;
    [parallel] backend overrides it when set), `bucket_bytes` the planner's bucket for the bottleneck
    link (None: [parallel] bucket_mb)."""
    par = config.parallel
    overlap = par.overlap if replicas > 1 and data_parallel == DataParallel.DDP else "off"
    bucket_mb = bucket_bytes / 2**20 if bucket_bytes else par.bucket_mb
    if config.compile.enable and overlap == "off" and not config.compile.uses_compiled_autograd:
        # Dynamo's DDPOptimizer, which splits compiled DDP at bucket boundaries, asserts that no bucket
        # is below the 1 MiB of DDP's first one (torch 2.11, found on two H200s).
        bucket_mb = max(1.0, bucket_mb)
    return {"comm_hook": comm_hook,
            "hook_settings": HookSettings(warmup_steps=par.comm_warmup_steps, powersgd_rank=par.powersgd_rank,
                                          topk_ratio=par.topk_ratio, topk_ramp_steps=par.topk_ramp_steps,
                                          topk_wire=par.topk_wire),
            "bucket_cap_mb": bucket_mb,
            "backend": backend if par.backend == "auto" else par.backend,
            "precision": resolve_precision(config.train.precision, use_gpu=use_gpu),
            "activation_checkpointing": par.activation_checkpointing,
            "overlap": overlap,
            "overlap_backward_share": overlap_backward_share(config, prediction)}


def uniform_spec(config: JobConfig, *, world_size: int, micro_batch_size: int, grad_accum_steps: int,
                 use_gpu: bool | None = None, intra_island_groups: list[list[int]] | None = None,
                 tensor_parallel_size: int = 1, data_location: str = "", tokenizer: str = "bytes") -> WorkerSpec:
    """A spec of `world_size` identical workers with equal micro-batches, resolved from `config` as the
    planner resolves it, for running the worker engine without the planner: [parallel] comm_hook
    "auto" runs plain all-reduce and strategy "auto" ddp (nothing is costed), the buckets are [parallel] bucket_mb.
    use_gpu defaults to [cluster] use_gpu; tensor_parallel_size consecutive ranks form each group."""
    use_gpu = config.cluster.use_gpu if use_gpu is None else use_gpu
    data_parallel = DataParallel("ddp" if config.parallel.strategy == "auto" else config.parallel.strategy)
    hook = "allreduce" if config.parallel.comm_hook == "auto" else config.parallel.comm_hook
    choices = plan_choices(config, use_gpu=use_gpu, replicas=world_size // tensor_parallel_size,
                           data_parallel=data_parallel, comm_hook=hook,
                           backend="nccl" if use_gpu else "gloo", bucket_bytes=None, prediction=None)
    plan = Plan.uniform(job_name=config.name, world_size=world_size, micro_batch_size=micro_batch_size,
                        grad_accum_steps=grad_accum_steps, seq_len=config.model.seq_len,
                        intra_island_groups=intra_island_groups, data_parallel=data_parallel.value,
                        tensor_parallel_size=tensor_parallel_size, **choices)
    workload = make_workload(config.model)
    facts = model_facts(workload, config.model.seq_len)
    return WorkerSpec.for_plan(config, plan, workload=workload, flops_per_token=facts.flops_per_token,
                               data_location=data_location, tokenizer=tokenizer)
