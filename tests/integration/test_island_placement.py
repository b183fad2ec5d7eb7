"""Placement that holds on a partly used node: on a fake 8-GPU node advertising four NVLink islands of
two (what `archipelago node-resources` prints), a plan on islands 1 and 3 gets its workers there through
placement_bundles, each reporting the island it holds; a worker Ray placed without its island's
reservation stops with a PlacementError naming the node and the GPUs."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from core.errors import PlacementError
from core.plan import DataParallel, DeviceKind, Objective, Plan, Prediction, WorkerPlacement
from topology.ray_resources import island_resource
from workers import binding

ISLANDS = [f"box-nvl{k}" for k in range(4)]
"""Islands 0 … 3 of the node, GPUs 2k and 2k + 1 in island k."""


@ray.remote(num_cpus=0)
class Worker:
    def report(self, worker: WorkerPlacement, islands_requested: bool | None = None) -> dict:
        context = ray.get_runtime_context()
        assigned = context.get_assigned_resources()
        requested = islands_requested if islands_requested is not None else any(
            name.startswith("nvlink_island_") for name in assigned)
        try:
            binding.check_placement(worker, node=context.get_node_id(), assigned=assigned,
                                    gpu_ids=ray.get_gpu_ids(), islands_requested=requested)
            error = None
        except PlacementError as e:
            error = e
        return {"node": context.get_node_id(), "resources": assigned, "error": error}


def gpu_worker(rank: int, gpu: int, node_id: str) -> WorkerPlacement:
    island = ISLANDS[gpu // 2]
    return WorkerPlacement(rank=rank, node_id="box", ray_node_id=node_id, device_uuid=f"GPU-{gpu}",
                           device_kind=DeviceKind.GPU, device_model="H100-SXM5-80GB", island_id=island,
                           micro_batch_size=4, grad_accum_steps=1, data_parallel_rank=rank, gpu_index=gpu,
                           island_resource=island_resource(island))


def actor_resources(worker: WorkerPlacement) -> dict:
    """What an actor takes from its bundle: the worker's resources, as a Ray Train worker asks for them."""
    resources = dict(binding.worker_resources(worker))
    return {"num_cpus": resources.pop("CPU"), "num_gpus": resources.pop("GPU", 0), "resources": resources}


def plan_on(workers: list[WorkerPlacement]) -> Plan:
    ranks = list(range(len(workers)))
    unknown = Prediction(step_seconds=0.0, compute_seconds=0.0, exposed_communication_seconds=0.0,
                         communication_seconds=0.0, tokens_per_second=0.0, dollars_per_hour=0.0,
                         dollars_per_step=0.0, dollars_per_million_tokens=0.0, job_hours=0.0, job_dollars=0.0)
    return Plan(job_name="islands", objective=Objective.FASTEST, workers=workers, global_batch_size=4 * len(workers),
                seq_len=8, grad_accum_steps=1, data_parallel=DataParallel.DDP,
                intra_island_groups=[[r] for r in ranks], tensor_parallel_groups=[[r] for r in ranks],
                data_parallel_groups=[ranks], predicted=unknown)


@pytest.fixture(scope="module")
def box(cluster):
    """A GPU node joined to the package's cluster for this module: 8 fake GPUs in 4 islands of 2."""
    node = cluster.add_node(num_cpus=2, num_gpus=8, resources={island_resource(i): 2.0 for i in ISLANDS})
    cluster.wait_for_nodes()
    node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU"))
    try:
        yield node_id
    finally:
        cluster.remove_node(node)


def test_a_plan_on_islands_1_and_3_runs_there_and_a_misplaced_worker_is_refused(box):
    plan = plan_on([gpu_worker(0, 2, box), gpu_worker(1, 6, box)])
    group = placement_group(**binding.placement_bundles(plan))
    ray.get(group.ready(), timeout=60)
    try:
        workers = [Worker.options(**actor_resources(entry), scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, entry.rank)).remote() for entry in plan.workers]
        reports = ray.get([w.report.remote(entry) for w, entry in zip(workers, plan.workers)])
    finally:
        remove_placement_group(group)
    for report, entry in zip(reports, plan.workers):
        assert report["error"] is None and report["node"] == box
        assert report["resources"][entry.island_resource] == 1.0 and report["resources"]["GPU"] == 1.0
    assert {name for r in reports for name in r["resources"] if name.startswith("nvlink_island_")} == {
        island_resource(ISLANDS[1]), island_resource(ISLANDS[3])}

    # Plain Ray scheduling of a plan made for island 3: one GPU, the lowest free id, no island reserved.
    misplaced = plan_on([gpu_worker(0, 6, box)])
    worker = Worker.options(num_gpus=1).remote()
    report = ray.get(worker.report.remote(misplaced.workers[0], binding.islands_reserved(misplaced, {})))
    error = report["error"]
    assert isinstance(error, PlacementError) and box in error.what and "GPU 6 (GPU-6)" in error.what
    assert "Ray GPU ids ['0']" in error.what and island_resource(ISLANDS[3]) in error.what and error.fix
