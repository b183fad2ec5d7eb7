"""The Plan object: it checks itself, describes CPU and GPU workers, and survives a JSON round trip."""

import dataclasses
import json

import pytest

from core.errors import PlacementError
from core.plan import AllReduce, BatchLayout, DataParallel, DeviceKind, Objective, Plan, Prediction, WorkerPlacement
from storage.sampler import DeterministicSampler


def prediction(**overrides) -> Prediction:
    values = dict(step_seconds=1.0, compute_seconds=0.8, exposed_communication_seconds=0.2,
                  communication_seconds=0.5, tokens_per_second=1000.0, dollars_per_hour=3.6, dollars_per_step=0.001,
                  dollars_per_million_tokens=1.0, job_hours=1.0, job_dollars=3.6)
    return Prediction(**{**values, **overrides})


def cpu_plan(**overrides) -> Plan:
    workers = [WorkerPlacement(rank=r, node_id="laptop", device_uuid=None, device_kind=DeviceKind.CPU,
                               device_model="cpu", island_id=None, micro_batch_size=16, grad_accum_steps=1,
                               data_parallel_rank=r, cpus=1, cpu_affinity=f"{r}") for r in range(2)]
    values = dict(job_name="cpu-tiny", objective=Objective.FASTEST, workers=workers, global_batch_size=32,
                  seq_len=128, grad_accum_steps=1, data_parallel=DataParallel.DDP, allreduce=AllReduce.RING,
                  intra_island_groups=[[0, 1]], inter_island_groups=[[0], [1]], tensor_parallel_groups=[[0], [1]],
                  data_parallel_groups=[[0, 1]], ddp_bucket_bytes={"loopback": 2**20},
                  bottleneck_link_class="loopback", predicted=prediction())
    return Plan(**{**values, **overrides})


def gpu_worker(rank, uuid, micro_batch, *, dp=None, tp=0, island="n0-nvl0", kind=DeviceKind.GPU, accum=2):
    return WorkerPlacement(rank=rank, node_id="n0", device_uuid=uuid, device_kind=kind, device_model="H100-SXM5-80GB",
                           island_id=island, micro_batch_size=micro_batch, grad_accum_steps=accum,
                           data_parallel_rank=rank if dp is None else dp, tensor_parallel_rank=tp)


def test_a_cpu_plan_describes_the_cpu_demo_and_round_trips():
    plan = cpu_plan()
    assert not plan.uses_gpus and plan.world_size == 2 and plan.tokens_per_step == 32 * 128
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.workers[0].device_kind is DeviceKind.CPU and again.objective is Objective.FASTEST
    assert again.batch_layout() == BatchLayout((16, 16), 1)


def test_heterogeneous_micro_batches_drive_the_sampler_with_one_accumulation_count(tmp_path):
    workers = [gpu_worker(0, "GPU-a", 12), gpu_worker(1, "GPU-b", 4)]
    plan = cpu_plan(workers=workers, global_batch_size=32, grad_accum_steps=2, intra_island_groups=[[0, 1]],
                    tensor_parallel_groups=[[0], [1]])
    layout = plan.batch_layout()
    assert layout.global_batch == 32 and layout.micro_batch_sizes == (12, 4)
    sampler = DeterministicSampler(1000, seed=0)
    seen = [i for rank in range(2) for batch in sampler.rank_micro_batches(0, layout, rank) for i in batch]
    assert sorted(seen) == sorted(sampler.samples_at(0, 32))
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan


def test_tensor_parallel_ranks_share_one_replica():
    workers = [gpu_worker(r, f"GPU-{r}", 8, dp=r // 2, tp=r % 2) for r in range(4)]
    plan = cpu_plan(workers=workers, global_batch_size=32, grad_accum_steps=2, tensor_parallel_size=2,
                    tensor_parallel_groups=[[0, 1], [2, 3]], data_parallel_groups=[[0, 2], [1, 3]],
                    intra_island_groups=[[0, 1, 2, 3]], inter_island_groups=[[0], [1], [2], [3]])
    assert plan.replica_micro_batch_sizes() == (8, 8)


@pytest.mark.parametrize("change, message", [
    (dict(global_batch_size=30), "must add up to the global batch"),
    (dict(workers=[gpu_worker(0, "GPU-a", 16, accum=1), gpu_worker(1, "GPU-a", 16, accum=1)]), "given to 2 workers"),
    (dict(workers=[gpu_worker(1, "GPU-a", 16, accum=1), gpu_worker(0, "GPU-b", 16, accum=1)]), "has rank 1"),
    (dict(workers=[gpu_worker(0, "GPU-a", 16, accum=1), gpu_worker(1, "GPU-b", 16, accum=2)]), "same number"),
    (dict(tensor_parallel_groups=[[0]]), "every rank exactly once"),
    (dict(inter_island_groups=[[0, 9]]), "not the k-th rank of every intra-island group"),
    (dict(inter_island_groups=[[0, 1]]), "not the k-th rank of every intra-island group"),
])
def test_a_plan_that_contradicts_itself_is_refused(change, message):
    with pytest.raises(PlacementError, match=message):
        cpu_plan(**change)


def test_a_tensor_parallel_group_never_holds_a_mig_slice():
    workers = [gpu_worker(0, "GPU-a", 16, dp=0, tp=0, accum=1),
               gpu_worker(1, "MIG-b", 16, dp=0, tp=1, kind=DeviceKind.MIG, island=None, accum=1)]
    with pytest.raises(PlacementError, match="tensor-parallel groups stay inside one NVLink island"):
        cpu_plan(workers=workers, global_batch_size=16, tensor_parallel_size=2, tensor_parallel_groups=[[0, 1]],
                 data_parallel_groups=[[0], [1]])


def test_a_tensor_parallel_group_never_spans_two_nvlink_islands():
    """The plan's own island check, apart from the planner's (which never makes such a group)."""
    workers = [gpu_worker(0, "GPU-a", 16, dp=0, tp=0, island="n0-nvl0", accum=1),
               gpu_worker(1, "GPU-b", 16, dp=0, tp=1, island="n0-nvl1", accum=1)]
    groups = dict(global_batch_size=16, tensor_parallel_size=2, tensor_parallel_groups=[[0, 1]],
                  data_parallel_groups=[[0], [1]], intra_island_groups=[[0], [1]], inter_island_groups=[[0, 1]])
    with pytest.raises(PlacementError, match=r"group \[0, 1\] leaves one NVLink island"):
        cpu_plan(workers=workers, **groups)
    same_island = [dataclasses.replace(w, island_id="n0-nvl0") for w in workers]
    assert cpu_plan(workers=same_island, **groups | dict(intra_island_groups=[[0, 1]], inter_island_groups=[[0], [1]]))


def test_the_plan_names_its_mesh_and_hsdp_shards_inside_islands():
    workers = [gpu_worker(r, f"GPU-{r}", 8, island=f"n{r // 2}-nvl0", accum=1) for r in range(4)]
    hsdp = dict(workers=workers, data_parallel=DataParallel.HSDP, intra_island_groups=[[0, 1], [2, 3]],
                inter_island_groups=[[0, 2], [1, 3]], tensor_parallel_groups=[[r] for r in range(4)],
                data_parallel_groups=[[0, 1, 2, 3]])
    plan = cpu_plan(**hsdp)
    assert (plan.mesh_dim_names, plan.mesh_shape) == (["dp_replicate", "dp_shard"], [2, 2])
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlacementError, match=r"hsdp shards over groups of 2 replicas \(2 ranks\) in a row"):
        cpu_plan(**hsdp | dict(intra_island_groups=[[0, 2], [1, 3]], inter_island_groups=[[0, 1], [2, 3]]))
    # Ray numbered the workers otherwise (GPU order): the same islands, ranks no longer consecutive.
    renumbered = plan.reordered([0, 2, 1, 3])
    assert renumbered.intra_island_groups == [[0, 2], [1, 3]] and renumbered.workers[1].island_id == "n1-nvl0"
    with pytest.raises(PlacementError, match="mesh"):
        cpu_plan(**hsdp | dict(mesh_dim_names=["dp_shard"], mesh_shape=[4]))


def test_older_plans_read_with_plain_all_reduce_and_a_newer_one_is_refused():
    data = json.loads(cpu_plan(comm_hook="bf16").to_json())
    assert data["version"] == 5 and data["comm_hook"] == "bf16" and data["precision"] == "fp32"
    added_in_5 = ("gpu_index", "island_resource", "environment")
    workers_4 = [{key: value for key, value in w.items() if key not in added_in_5} for w in data["workers"]]
    version_4 = {key: value for key, value in data.items() if not key.startswith("mesh_")} | {
        "version": 4, "workers": workers_4}
    assert Plan.from_dict(version_4) == cpu_plan(comm_hook="bf16")  # the mesh its groups imply
    version_3 = {key: value for key, value in version_4.items() if key != "device_bases"} | {"version": 3}
    assert Plan.from_dict(version_3) == cpu_plan(comm_hook="bf16")
    resolved = ("hook_settings", "bucket_cap_mb", "precision", "activation_checkpointing", "overlap",
                "overlap_backward_share")
    version_2 = {key: value for key, value in version_3.items() if key not in resolved} | {"version": 2}
    assert Plan.from_dict(version_2) == cpu_plan(comm_hook="bf16")
    version_1 = {key: value for key, value in version_2.items() if key != "comm_hook"} | {"version": 1}
    assert Plan.from_dict(version_1) == cpu_plan(comm_hook="allreduce")
    with pytest.raises(PlacementError, match="plan version 6; this archipelago reads 5"):
        Plan.from_dict({**data, "version": 6})


@pytest.mark.parametrize("choices, named", [
    ({"comm_hook": "auto"}, "comm_hook 'auto' is not one of"),
    ({"comm_hook": ""}, "comm_hook '' is not one of"),
    ({"precision": "auto"}, "precision 'auto' is not one of"),
    ({"comm_hook": "powersgd", "backend": "gloo"}, "powersgd hangs over gloo"),
    ({"overlap": "next_forward", "precision": "fp16"}, "loss scaling"),
    ({"overlap": "next_forward", "comm_hook": "topk"}, "comm_hook 'topk' would not run"),
    ({"bucket_cap_mb": 0.0}, "bucket_cap_mb 0.0"),
])
def test_a_plan_names_only_resolved_choices_that_go_together(choices, named):
    """What the workers read is decided: no "auto", no empty hook, nothing the rules refuse."""
    with pytest.raises(PlacementError, match=named):
        cpu_plan(**choices)


def test_a_damaged_plan_file_names_the_field():
    data = json.loads(cpu_plan().to_json())
    data["workers"][1]["micro_batch_size"] = "16"
    with pytest.raises(PlacementError, match=r"workers\[1\]\.micro_batch_size"):
        Plan.from_dict(data)
    with pytest.raises(PlacementError, match="not an archipelago plan"):
        Plan.from_dict({"workers": []})


def test_a_list_where_a_plan_names_a_choice_is_refused_not_a_type_error():
    data = json.loads(cpu_plan().to_json())
    data["objective"] = ["fastest"]
    with pytest.raises(PlacementError, match=r"plan.objective: \['fastest'\] is not one of fastest"):
        Plan.from_dict(data)


def test_a_plan_path_that_is_not_a_readable_file_says_so(tmp_path):
    for path, reason in [(tmp_path, "Is a directory"), (tmp_path / "none.json", "No such file or directory")]:
        with pytest.raises(PlacementError) as refused:
            Plan.load(path)
        assert refused.value.where == str(path) and refused.value.what == f"cannot read it ({reason})"
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(PlacementError, match="byte 0 is not UTF-8"):
        Plan.load(binary)


def test_inter_island_groups_are_none_or_the_kth_rank_of_every_island():
    workers = [gpu_worker(r, f"GPU-{r}", 4, island=f"n{r // 2}-nvl0") for r in range(4)]
    two_islands = dict(workers=workers, global_batch_size=32, grad_accum_steps=2, intra_island_groups=[[0, 1], [2, 3]],
                       tensor_parallel_groups=[[r] for r in range(4)], data_parallel_groups=[[0, 1, 2, 3]])
    plan = cpu_plan(**two_islands, inter_island_groups=[[0, 2], [1, 3]])
    assert plan.reordered([2, 3, 0, 1]).inter_island_groups == [[2, 0], [3, 1]]
    assert cpu_plan(**two_islands, inter_island_groups=[]).inter_island_groups == []
    data = json.loads(plan.to_json())
    data["inter_island_groups"] = [[0, 9]]  # a hand-edited file: refused on load, not a KeyError in the worker
    with pytest.raises(PlacementError, match=r"plan: inter_island_groups: inter_island_groups \[\[0, 9\]\]"):
        Plan.from_dict(data)
