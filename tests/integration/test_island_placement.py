"""Placement that holds on a partly used node, through the ScalingConfig fit gives Ray Train: on a fake
8-GPU node advertising four NVLink islands of two (what `archipelago node-resources` prints), where another
job holds every GPU but 2 (island 1) and 6 (island 3), a plan on those two GPUs runs its workers there, each
reporting its Ray GPU id and the islands the group holds; checked against a plan on GPUs 3 and 7 of the same
islands, each worker stops with a PlacementError naming the node and both GPUs.

Ray gives a node's lowest free GPU ids and cannot be asked for others, so this is what holds: a plan lands
on its GPUs when they are the node's lowest free ones, and a worker Ray put on another GPU is refused."""

from __future__ import annotations

import json

import pytest
import ray
from ray.train import RunConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.placement_group import placement_group, remove_placement_group

from core.plan import DataParallel, DeviceKind, Objective, Plan, Prediction, WorkerPlacement
from orchestrator.fit import scaling_config
from tests.conftest import tiny_job
from tests.placement_support import report_placement
from topology.ray_resources import island_resource
from workers import binding

ISLANDS = [f"box-nvl{k}" for k in range(4)]
"""Islands 0 … 3 of the node, GPUs 2k and 2k + 1 in island k."""
NEIGHBOUR_GPUS = [0, 1, 3, 4, 5, 7]
"""What the other job holds: two GPUs each of islands 0 and 2, one each of islands 1 and 3."""


def gpu_worker(rank: int, gpu: int, node_id: str) -> WorkerPlacement:
    island = ISLANDS[gpu // 2]
    return WorkerPlacement(rank=rank, node_id="box", ray_node_id=node_id, device_uuid=f"GPU-{gpu}",
                           device_kind=DeviceKind.GPU, device_model="H100-SXM5-80GB", island_id=island,
                           micro_batch_size=4, grad_accum_steps=1, data_parallel_rank=rank, gpu_index=gpu,
                           island_resource=island_resource(island))


def plan_on(gpus: list[int], node_id: str) -> Plan:
    ranks = list(range(len(gpus)))
    unknown = Prediction(step_seconds=0.0, compute_seconds=0.0, exposed_communication_seconds=0.0,
                         communication_seconds=0.0, tokens_per_second=0.0, dollars_per_hour=0.0,
                         dollars_per_step=0.0, dollars_per_million_tokens=0.0, job_hours=0.0, job_dollars=0.0)
    return Plan(job_name="islands", objective=Objective.FASTEST,
                workers=[gpu_worker(rank, gpu, node_id) for rank, gpu in enumerate(gpus)],
                global_batch_size=4 * len(gpus), seq_len=8, grad_accum_steps=1, data_parallel=DataParallel.DDP,
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


@pytest.fixture
def neighbour(box):
    """Another job on the box, holding NEIGHBOUR_GPUS and their island units. Ray hands out the lowest free
    GPU ids, so it takes GPUs 0 … 7 one group after another, then gives back 2 and 6."""
    groups = []
    for gpu in range(8):
        bundle = {"GPU": 1.0, island_resource(ISLANDS[gpu // 2]): 1.0}
        groups.append(placement_group([bundle], bundle_label_selector=[{binding.NODE_ID_LABEL: box}]))
        ray.get(groups[-1].ready(), timeout=60)
    for gpu in set(range(8)) - set(NEIGHBOUR_GPUS):
        remove_placement_group(groups[gpu])
    try:
        yield
    finally:
        for gpu in NEIGHBOUR_GPUS:
            remove_placement_group(groups[gpu])


def test_a_plan_on_islands_1_and_3_runs_on_its_gpus_and_a_worker_on_other_gpus_is_refused(box, neighbour, tmp_path):
    plan, misplaced = plan_on([2, 6], box), plan_on([3, 7], box)
    config = tiny_job(tmp_path, tmp_path, cluster={"num_workers": 2, "use_gpu": True})
    scaling = scaling_config(plan, config)
    one, three = island_resource(ISLANDS[1]), island_resource(ISLANDS[3])
    assert scaling.resources_per_worker == {"CPU": 1.0, "GPU": 1.0, one: 0.5, three: 0.5}
    TorchTrainer(report_placement, train_loop_config={"plan": plan, "misplaced": misplaced, "out": str(tmp_path)},
                 torch_config=TorchConfig(backend="gloo"), scaling_config=scaling,
                 run_config=RunConfig(name="islands", storage_path=str(tmp_path / "ray"))).fit()
    seen = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    assert [(s["node"], s["gpu_ids"], s["plan"]) for s in seen] == [
        (box, ["2"], {"gpu": 2, "error": None}), (box, ["6"], {"gpu": 6, "error": None})]
    for s in seen:
        assert {name: s["resources"][name] for name in ("GPU", one, three)} == {"GPU": 1.0, one: 0.5, three: 0.5}
    assert [s["misplaced"]["error"] for s in seen] == [
        f"rank {rank} runs on node {box} on Ray's GPU {given}, with island resources {one}, {three}; the plan "
        f"placed it on node box, GPU {planned} (GPU-{planned}), holding {island}"
        for rank, given, planned, island in [(0, 2, 3, one), (1, 6, 7, three)]]
    assert all(s["misplaced"]["fix"].startswith("plan again for the node's free GPUs") for s in seen)
