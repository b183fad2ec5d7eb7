"""The elastic policy without Ray: [elastic] config, the map cut to granted workers, re-planning, events."""

import dataclasses

import pytest

import planning
from core.config import JobConfig
from core.errors import ConfigError, PlacementError
from core.spec import WorkerSpec
from orchestrator.coordinator import (ElasticState, config_for_world, granted_topology, matches, placement_wait_note,
                                      ray_cpu_slots)
from planning.memory import profile
from topology.cluster import ClusterTopology, NodeTopology, NumaNode
from workers.elastic import WorkerReport
from workers.models import make_workload

JOB = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 32},
       "train": {"global_batch_size": 8, "micro_batch_size": 2},
       "cluster": {"num_workers": 3}, "elastic": {"min_workers": 1}}


def job(**sections) -> JobConfig:
    return JobConfig.from_dict({**JOB, **sections})


def node(name: str, cpus: int = 2, ray_cpus: float = 1.0, hostname: str = "") -> NodeTopology:
    return NodeTopology(node_id=name, hostname=hostname or name, address=f"10.0.0.{ord(name[-1]) % 50}",
                        ray_node_id=name.upper() * 4, cpu_count=cpus, memory_bytes=8 * 2**30,
                        numa_nodes=[NumaNode(numa_id=0, cpus=f"0-{cpus - 1}")], ray_resources={"CPU": ray_cpus})


def reports(*nodes: NodeTopology) -> list[WorkerReport]:
    return [WorkerReport(world_rank=r, local_rank=0, ray_node_id=n.ray_node_id, address=n.address, pid=100 + r,
                         started_at=1000.0) for r, n in enumerate(nodes)]


@pytest.mark.parametrize("section, message", [
    ({"elastic": {"min_workers": -1}}, "[elastic] min_workers: must be 0 or more"),
    ({"elastic": {"min_workers": 4}}, "[elastic] min_workers: 4 is above [cluster] num_workers = 3"),
    ({"elastic": {"max_preemption_failures": -3}}, "[elastic] max_preemption_failures: must be -1 (no limit) or more"),
    ({"elastic": {"preemption_check_steps": 0}}, "[elastic] preemption_check_steps: must be positive"),
    ({"elastic": {"resize_check_s": -1.0}}, "[elastic] resize_check_s: must be 0 or more"),
    ({"elastic": {"min_workers": 1}, "train": {"global_batch_size": 7, "micro_batch_size": 2}},
     "[train] global_batch_size: 7 samples cannot be split over 2 or 3 workers"),
])
def test_bad_elastic_values_name_the_key_and_the_fix(section, message):
    with pytest.raises(ConfigError) as info:
        job(**section)
    assert message in str(info.value) and " — " in str(info.value)


def test_a_worker_range_relaxes_the_even_split_check():
    assert job().train.global_batch_size == 8  # 8 over 3 workers: the planner splits it unevenly
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size × num_workers"):
        job(elastic={"min_workers": 0})


def test_the_map_keeps_only_what_ray_granted():
    a, b, c = node("a", cpus=4, ray_cpus=4), node("b"), node("c")
    granted = granted_topology([a, b, c], reports(a, a, c), cpus_per_worker=1, use_gpu=False)
    assert [(n.node_id, n.cpu_count, [d.cpus for d in n.numa_nodes]) for n in granted.nodes] == \
           [("a", 2, ["0-1"]), ("c", 1, ["0"])]
    shared = [node("x", hostname="box"), node("y", hostname="box")]  # two Ray nodes, one machine
    cut = granted_topology(shared, reports(*shared), cpus_per_worker=1, use_gpu=False)
    assert [n.numa_nodes for n in cut.nodes] == [[], []]  # unpinned, not both on core 0
    slots_map, slots = ray_cpu_slots(ClusterTopology(nodes=[a, b, c]), cpus_per_worker=1)
    assert slots == 6 and [n.cpu_count for n in slots_map.nodes] == [4, 1, 1]


@pytest.fixture
def state_and_nodes():
    config = job()
    memory = profile(config, device_type="cpu")
    nodes = [node("a"), node("b"), node("c")]
    plan_for = lambda topology, cfg, noise: planning.make_plan(topology, cfg, memory=memory,  # noqa: E731
                                                               measured_noise_scale=noise)
    first = plan_for(granted_topology(nodes, reports(*nodes), cpus_per_worker=1, use_gpu=False), config, None)
    clock = iter(float(t) for t in range(2000, 3000))
    spec = WorkerSpec.for_plan(config, first, workload=make_workload(config.model), flops_per_token=1e6,
                               data_location="data/tiny", tokenizer="bytes")
    state = ElasticState(config, spec, nodes, plan_for=plan_for, discover=lambda: ClusterTopology(nodes=nodes),
                         clock=lambda: next(clock))
    return state, nodes


def test_a_lost_worker_is_recorded_once_and_the_smaller_group_is_replanned(state_and_nodes):
    state, (a, b, c) = state_and_nodes
    first, rows = state.group_started(reports(a, b, c))
    plan = first.plan
    assert rows == [] and plan.world_size == 3 and list(plan.replica_micro_batch_sizes()) == [2, 1, 1]
    state.reached(7, at=1990.0)
    lost = state.failed({1: "ActorDiedError: The actor died unexpectedly\nmore detail"})
    assert lost[0]["event"] == "worker_lost" and lost[0]["step"] == 7
    assert lost[0]["nodes"] == [f"{b.address} ({b.ray_node_id[:8]})"] and lost[0]["error"].endswith("unexpectedly")
    assert state.failed({1: "the same failure, polled again"}) == []

    spec, rows = state.group_started(reports(a, c))
    plan = spec.plan
    assert [r["event"] for r in rows] == ["resize", "replan"]
    assert rows[0]["previous_world_size"] == 3 and rows[0]["world_size"] == 2
    assert rows[1]["comm_hook"] == plan.comm_hook != ""  # the hook the new group runs
    assert plan.world_size == 2 and plan.global_batch_size == 8
    assert sorted(w.ray_node_id for w in plan.workers) == sorted([a.ray_node_id, c.ray_node_id])
    assert sum(plan.replica_micro_batch_sizes()) * plan.grad_accum_steps == 8
    # The spec the new group's workers get is the re-plan's, settings and all, not the first group's.
    assert spec.plan is state.plan and spec.plan != first.plan
    assert rows[1]["micro_batch_sizes"] == list(spec.plan.replica_micro_batch_sizes())
    assert spec.train.precision == spec.plan.precision == "fp32" and spec.data == first.data
    assert (spec.model, spec.checkpoint, spec.compile) == (first.model, first.checkpoint, first.compile)
    marks = {"planned": 2100.0, "restore_start": 2101.0, "restored": 2101.5, "first_step_done": 2102.0}
    (restart,) = state.first_step(4, marks)
    assert restart["steps_redone"] == 3 and restart["step"] == 4 and restart["cause"] == "worker lost"
    assert restart["restore_s"] == 0.5 and restart["recompile_s"] == 0.5 and restart["setup_s"] == 1.0
    assert restart["recovery_s"] == 2102.0 - 1990.0 and restart["detect_s"] > 0
    assert state.failure_summary().startswith("group 1: rank 1 on 10.0.0.")


def test_the_same_workers_keep_the_plan_and_a_planner_refusal_names_the_group(state_and_nodes):
    state, (a, b, c) = state_and_nodes
    spec, _ = state.group_started(reports(a, c))
    assert matches(spec.plan, reports(a, c)) and not matches(spec.plan, reports(a, b))
    same, rows = state.group_started(reports(c, a)[::-1])
    assert same is spec and rows == []
    state.config = job(train={"global_batch_size": 1, "micro_batch_size": 1}, elastic={"min_workers": 0},
                       cluster={"num_workers": 1})
    with pytest.raises(PlacementError, match="no plan for the 2 workers Ray granted"):
        state.group_started(reports(a, b))


def test_a_replan_plans_with_the_noise_scale_the_run_measured_last(state_and_nodes):
    state, (a, b, c) = state_and_nodes
    state.group_started(reports(a, b, c))
    state.config = dataclasses.replace(state.config, placement=dataclasses.replace(state.config.placement,
                                                                                   objective="goodput"))
    state.reached(5, at=1990.0, noise_scale=250.0)
    state.reached(6, at=1991.0)  # a window without an estimate keeps the last one
    spec, _ = state.group_started(reports(a, c))
    assert "planned with the run's measured gradient noise scale 250 samples" in spec.plan.notes


def test_config_for_world_pins_the_device_range():
    assert config_for_world(job(), 2).cluster.num_workers == 2
    gpu = config_for_world(job(cluster={"num_workers": 3, "use_gpu": True}), 5)
    assert (gpu.placement.min_gpus, gpu.placement.max_gpus) == (5, 5)


TRACEBACK = ('Traceback (most recent call last):\n  File "/job/my_models.py", line 41, in forward\n'
             '    return self.out(hidden[:, index])\nIndexError: index 300 is out of bounds for dimension 1 with size 32')


def test_the_same_error_at_the_same_step_after_a_restart_stops_the_run(state_and_nodes):
    state, (a, b, c) = state_and_nodes
    state.group_started(reports(a, b, c))
    state.reached(5, at=1990.0)
    state.failed({0: TRACEBACK, 1: "RuntimeError: [gloo] Connection closed by peer [10.0.0.7]:41234"})
    assert state.fatal is None  # once may be a node: Ray restarts the group
    state.group_started(reports(a, b, c))
    state.reached(4, at=1995.0)
    state.reached(5, at=1996.0)
    state.tracebacks[0] = TRACEBACK  # what rank 0 sent as it raised: Ray hands the controller the last line only
    state.failed({1: "RuntimeError: [gloo] Connection closed by peer [10.0.0.8]:51000", 0: TRACEBACK.splitlines()[-1]})
    error = state.fatal
    assert type(error).__name__ == "RepeatedFailureError" and error.where == "step 6, rank 0"
    assert error.what == ("the workers failed twice with the same error, so restarting cannot fix it: IndexError: "
                          "index 300 is out of bounds for dimension 1 with size 32 (raised at /job/my_models.py:41 "
                          "in forward)")
    with pytest.raises(type(error)):  # the group Ray starts next stops at once
        state.group_started(reports(a, b, c))


@pytest.mark.parametrize("first, second, second_step", [
    (TRACEBACK, TRACEBACK, 9),  # the restart got further: a fault it met later, not the same one
    ("ActorDiedError: The actor died unexpectedly", "ActorDiedError: The actor died unexpectedly", 5),  # a node
    ("DistBackendError: NCCL error: remote process exited", "DistBackendError: NCCL error: remote process exited", 5),
])
def test_a_failure_a_restart_may_fix_is_retried(state_and_nodes, first, second, second_step):
    state, (a, b, c) = state_and_nodes
    state.group_started(reports(a, b, c))
    state.reached(5, at=1990.0)
    state.failed({1: first})
    state.group_started(reports(a, b, c))
    state.reached(second_step, at=1995.0)
    state.failed({1: second})
    assert state.fatal is None


def test_a_worker_group_ray_holds_back_for_cpus_is_named_with_what_is_free():
    note = placement_wait_note([{"CPU": 1.0}, {"CPU": 1.0}], {"CPU": 1.0}, {"CPU": 2.0}, use_gpu=False)
    assert note == ("waiting for Ray to place 2 workers: they need 2 CPUs where the cluster has 1 of its 2 free (other "
                    "jobs or actors hold the rest; `ray status` lists the demands). The run starts once they are free; "
                    "to start now, stop what holds them or lower [cluster] num_workers (or set [elastic] min_workers).")


def test_a_gpu_group_held_back_names_the_gpus_and_max_gpus():
    bundles = [{"CPU": 1.0, "GPU": 1.0}] * 4
    note = placement_wait_note(bundles, {"CPU": 60.0, "GPU": 2.0}, {"CPU": 64.0, "GPU": 8.0}, use_gpu=True)
    assert "need 4 GPUs where the cluster has 2 of its 8 free" in note and "CPUs" not in note
    assert note.endswith("lower [placement] max_gpus.")


def test_a_group_whose_resources_are_free_gets_no_note():
    # Pending only for a moment (Ray is placing it), or held by something other than CPUs and GPUs.
    assert placement_wait_note([{"CPU": 1.0}] * 2, {"CPU": 2.0}, {"CPU": 2.0}, use_gpu=False) is None
