"""The planner's parallelism choices: tensor-parallel groups only inside NVLink islands even where
other GPUs are cheaper, HSDP where sharding across nodes costs too much, and a 70B-class model that
only fits with its layers split. Memory comes from synthetic profiles (what the fake steps of a
model this size would measure), so no test builds a large fake model."""

from __future__ import annotations

import pytest
from rich.console import Console

from core.config import JobConfig
from core.errors import PlacementError
from core.plan import DataParallel, DeviceKind
from planning.memory import MemoryProfile, StepMemory, StepSpec
from planning.plan_table import print_plan
from planning.planner import Planner
from topology import machines

GIB = 2**30
LLAMA_70B = {"kind": "llama", "n_layer": 80, "n_embd": 8192, "n_head": 64, "n_kv_head": 8, "ffn_dim": 28672,
             "vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0}
"""Llama-3.1-70B's shape."""


def job(model: dict, **sections) -> JobConfig:
    base = {"name": "t", "model": model, "cluster": {"use_gpu": True},
            "train": {"global_batch_size": 64, "micro_batch_size": 1, "steps": 1000}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return JobConfig.from_dict(base)


def synthetic_profile(config: JobConfig, *, parameters: float, activation_gib_per_sample: float,
                      block_share: float = 0.0125, root_share: float = 0.03) -> MemoryProfile:
    """The profile of a model of `parameters` fp32 weights trained with AdamW: 4 bytes each of weights
    and gradients, 8 of optimizer state, and activations growing with the micro-batch."""
    weights = int(4 * parameters)

    def step(micro_batch: int) -> StepMemory:
        activations = int(activation_gib_per_sample * GIB * micro_batch)
        peak = 4 * weights + activations
        return StepMemory(micro_batch_size=micro_batch, peak_bytes=peak, ddp_peak_bytes=peak, parameter_bytes=weights,
                          gradient_bytes=weights, optimizer_bytes=2 * weights, activation_bytes=activations,
                          largest_block_parameter_bytes=int(weights * block_share),
                          root_parameter_bytes=int(weights * root_share))
    return MemoryProfile(spec=StepSpec.for_job(config, device_type="cuda"), points=(step(1), step(2)))


def plan_of(cluster: str, config: JobConfig, **profile):
    return Planner(machines.cluster(cluster), config, memory=synthetic_profile(config, **profile),
                   exact_memory=False).plan()


TINY = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128, "vocab_size": 257}


def test_a_cheaper_gpu_without_nvlink_never_gets_a_tensor_parallel_group():
    """The L40S (no NVLink) is priced so low that a data-parallel plan would take it: with
    tensor_parallel_size = 2 the planner keeps every group on the H100s' NVSwitch island anyway."""
    cheap = {"placement": {"objective": "cheapest", "prices": {"L40S": 0.01, "H100-SXM5-80GB": 3.0}}}
    data_parallel = plan_of("8xH100-SXM:1,8xL40S:1", job(TINY, **cheap), parameters=1e6, activation_gib_per_sample=0.1)
    assert {w.device_model for w in data_parallel.workers} == {"L40S"}  # the price alone would pick them
    config = job(TINY, placement={**cheap["placement"], "tensor_parallel_size": 2})
    plan = plan_of("8xH100-SXM:1,8xL40S:1", config, parameters=1e6, activation_gib_per_sample=0.1)
    assert plan.tensor_parallel_size == 2 and plan.world_size >= 2
    for group in plan.tensor_parallel_groups:
        members = [plan.workers[rank] for rank in group]
        assert all(w.device_kind == DeviceKind.GPU and w.device_model == "H100-SXM5-80GB" for w in members)
        assert len({w.island_id for w in members}) == 1 and members[0].island_id is not None


def test_strategy_auto_shards_inside_islands_where_ddp_does_not_fit_and_fsdp_crosses_nodes():
    """7B parameters: AdamW's 112 GB do not fit one H100 (no DDP); sharded over 8 they do, and hsdp
    gathers on each node's NVSwitch where fsdp would gather across the nodes' network every micro-step."""
    config = job(TINY, parallel={"strategy": "auto"}, placement={"min_gpus": 16})
    plan = plan_of("8xH100-SXM:2", config, parameters=7e9, activation_gib_per_sample=2.0)
    assert plan.data_parallel == DataParallel.HSDP
    assert (plan.mesh_dim_names, plan.mesh_shape) == (["dp_replicate", "dp_shard"], [2, 8])
    fsdp = plan_of("8xH100-SXM:2", job(TINY, parallel={"strategy": "fsdp"}, placement={"min_gpus": 16}),
                   parameters=7e9, activation_gib_per_sample=2.0)
    assert plan.predicted.step_seconds < fsdp.predicted.step_seconds
    with pytest.raises(PlacementError, match="one sample does not fit"):
        plan_of("8xH100-SXM:2", job(TINY, parallel={"strategy": "ddp"}), parameters=7e9, activation_gib_per_sample=2.0)


def test_a_70b_model_fits_only_with_tensor_parallelism_inside_the_island():
    """Llama-70B at 8k tokens a sample on four 8xH100 nodes: sharded 32 ways its state takes ~35 GB a
    GPU, but one sample's activations (~180 GB without checkpointing) fit only split 8 ways by
    sequence-parallel layers; DDP and FSDP alone are refused, saying why."""
    profile = {"parameters": 70.6e9, "activation_gib_per_sample": 170.0}
    for strategy in ("ddp", "fsdp"):
        with pytest.raises(PlacementError, match="one sample does not fit a H100-SXM5-80GB"):
            plan_of("8xH100-SXM:4", job(LLAMA_70B, parallel={"strategy": strategy}), **profile)
    plan = plan_of("8xH100-SXM:4", job(LLAMA_70B, parallel={"strategy": "auto"},
                                       placement={"tensor_parallel_size": 0}), **profile)
    assert plan.tensor_parallel_size == 8
    assert plan.mesh_dim_names[-1] == "tp" and plan.mesh_shape[-1] == 8
    assert all(len({plan.workers[r].island_id for r in group}) == 1 for group in plan.tensor_parallel_groups)
    assert all(w.predicted_peak_memory_bytes <= w.memory_capacity_bytes for w in plan.workers)
    assert "tensor_parallel_size = 0 took 8" in plan.notes[-1] and "1: refused, one sample does not fit" in plan.notes[-1]


def test_tensor_parallel_size_0_weighs_only_sizes_the_job_can_run():
    """With qat (no tensor-parallel plan for its layers) the planner stays at 1 instead of weighing
    sizes the config would refuse."""
    config = job(TINY, placement={"tensor_parallel_size": 0}, train={"qat": "int8-weight"})
    plan = plan_of("8xH100-SXM:1", config, parameters=1e6, activation_gib_per_sample=0.1)
    assert plan.tensor_parallel_size == 1 and "tensor_parallel_size = 0 took 1" in plan.notes[-1]


@pytest.mark.parametrize(("min_gpus", "max_gpus", "planned"), [(1, 3, 2), (2, 3, 2), (4, 5, 4), (1, 5, 4)])
def test_a_gpu_range_is_planned_in_whole_tensor_parallel_groups(min_gpus, max_gpus, planned):
    """The most GPUs the range allows that tensor_parallel_size divides; the odd one left is not planned."""
    config = job(TINY, placement={"tensor_parallel_size": 2, "min_gpus": min_gpus, "max_gpus": max_gpus,
                                  "objective": "fastest"})
    plan = plan_of("8xH100-SXM:1", config, parameters=1e6, activation_gib_per_sample=0.1)
    assert plan.world_size == planned and plan.tensor_parallel_size == 2


@pytest.mark.parametrize("gpus", [3, 5])
def test_a_gpu_range_without_a_whole_tensor_parallel_group_count_is_refused_by_name(gpus):
    config = job(TINY, placement={"tensor_parallel_size": 2, "min_gpus": gpus, "max_gpus": gpus})
    with pytest.raises(PlacementError) as refused:
        plan_of("8xH100-SXM:1", config, parameters=1e6, activation_gib_per_sample=0.1)
    assert refused.value.where == "[placement] max_gpus"
    assert "holds no multiple of tensor_parallel_size = 2" in refused.value.what
    assert f"set max_gpus to {gpus + 1}" in refused.value.fix


def test_tensor_parallel_size_0_on_an_odd_gpu_count_takes_1_and_says_why_not_2():
    """What an elastic re-plan for 3 granted GPUs asks."""
    config = job(TINY, placement={"tensor_parallel_size": 0, "min_gpus": 3, "max_gpus": 3},
                 train={"global_batch_size": 48})
    plan = plan_of("8xH100-SXM:1", config, parameters=1e6, activation_gib_per_sample=0.1)
    assert (plan.world_size, plan.tensor_parallel_size) == (3, 1)
    assert "2: refused, min_gpus = 3 to max_gpus = 3 holds no multiple" in plan.notes[-1]


def test_tensor_parallel_size_0_says_why_the_sizes_the_model_cannot_split_over_were_not_weighed():
    """Two key/value heads split over 1 or 2 ranks; the island's 4 and 8 are named with the reason."""
    config = job({**TINY, "kind": "llama", "n_kv_head": 2}, placement={"tensor_parallel_size": 0})
    plan = plan_of("8xH100-SXM:1", config, parameters=1e6, activation_gib_per_sample=0.1)
    note = plan.notes[-1]
    for size in (4, 8):
        assert f"{size}: refused, [model] n_kv_head = 2 does not split evenly over {size} ranks" in note


def test_the_plan_headline_under_tensor_parallelism_names_fsdp2_replicas_and_no_ddp_hook_or_buckets():
    def headline(placement: dict) -> str:
        console = Console(record=True, width=400)
        print_plan(plan_of("8xH100-SXM:1", job(TINY, placement={"min_gpus": 4, "max_gpus": 4, **placement}),
                           parameters=1e6, activation_gib_per_sample=0.1), None, console)
        return console.export_text().splitlines()[0]
    ddp = headline({})
    assert ", ddp, " in ddp and "(comm hook allreduce)" in ddp and "; buckets" in ddp, ddp
    tp = headline({"tensor_parallel_size": 2})
    assert "ddp as FSDP2 replicas, tensor parallel 2, ring all-reduce" in tp, tp
    assert "comm hook" not in tp and "buckets" not in tp


GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 320}


@pytest.mark.parametrize("model, parameters, gpus, micro_batch_size, activation_gib, reason", [
    (TINY, 1e6, 4, 8, 0.1, "fewer would need micro-batches larger than [train] micro_batch_size = 8"),
    (TINY, 1e6, 4, 32, 5.0, "fewer would need micro-batches larger than memory allows (14 on H100-SXM5-80GB)"),
    # Micro-batch 32 fits twice over; only the last micro-step runs beside DDP's all-reduce, so two of 16 win.
    (GPT2_124M, 124e6, 2, 32, 0.1, "predicted faster than one step of larger micro-batches, which fit too"),
])
def test_the_accumulation_note_gives_the_reason_the_search_had(model, parameters, gpus, micro_batch_size,
                                                               activation_gib, reason):
    config = job(model, placement={"min_gpus": gpus, "max_gpus": gpus},
                 train={"global_batch_size": 64, "micro_batch_size": micro_batch_size})
    plan = plan_of("8xH100-SXM:1", config, parameters=parameters, activation_gib_per_sample=activation_gib)
    assert plan.grad_accum_steps == 2
    assert f"2 accumulation steps: {reason}" in plan.notes, plan.notes
