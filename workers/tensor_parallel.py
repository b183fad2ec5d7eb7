"""The device mesh a plan names, and tensor parallelism applied on it.

    mesh = device_mesh(plan, device)                 # dims of core.plan.MESH_DIMS the plan uses
    apply_tensor_parallel(model, workload, mesh["tp"])
    with loss_context(tensor_parallel=True): loss = …; loss.backward()

Each worker sits in the mesh where its plan entry says (its replica, its tensor-parallel rank), not
where its rank would put it row-major: the planner numbers each tensor-parallel group consecutively
inside one NVLink island (under hsdp each shard group is one island), but Ray numbers the workers
itself, and the plan renumbered to Ray's order keeps the groups, not their order.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from core.errors import ConfigError, PlacementError
from core.plan import DataParallel, Plan
from core.workload import Workload


def device_mesh(plan: Plan, device: torch.device) -> DeviceMesh:
    """The plan's mesh, always with a dp_replicate and a dp_shard dimension (size 1 where the plan has
    none): FSDP2 then shards over dp_shard and replicates over dp_replicate, which covers fsdp, hsdp
    and, with dp_shard of 1, ddp beside tensor parallelism."""
    sizes = dict(zip(plan.mesh_dim_names, plan.mesh_shape))
    shape = (sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1), sizes.get("tp", 1))
    return DeviceMesh(device.type, mesh_ranks(plan, shape), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def mesh_ranks(plan: Plan, shape: tuple[int, int, int]) -> torch.Tensor:
    """Each worker's rank at its place in the (dp_replicate, dp_shard, tp) mesh, by its plan entry's
    replica and tensor-parallel rank: Ray numbers the workers itself (Plan.reordered), so a group the
    plan put on one island need not be consecutive ranks, as a mesh laid out from the shape would assume."""
    ranks = torch.full(shape, -1, dtype=torch.int)
    shard = shape[1]
    for worker in plan.workers:
        replica = worker.data_parallel_rank
        ranks[replica // shard, replica % shard, worker.tensor_parallel_rank] = worker.rank
    if sorted(ranks.flatten().tolist()) != list(range(plan.world_size)):
        raise PlacementError(f"the plan's replicas and tensor-parallel ranks do not fill the {'×'.join(map(str, shape))} "
                             "mesh once each", where="plan", fix="plan again with `archipelago plan`")
    return ranks


def data_parallel_mesh(plan: Plan, mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP2 spreads the model over: a 1-D shard mesh for fsdp, else the 2-D replicate × shard mesh
    (hsdp, and ddp as FSDP2 with shards of one rank, since DDP does not take DTensor parameters)."""
    if plan.data_parallel == DataParallel.FSDP:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]


def apply_tensor_parallel(model: torch.nn.Module, workload: Workload, tp_mesh: DeviceMesh) -> None:
    """Splits `model` in place over `tp_mesh` by its workload's tensor-parallel plan."""
    plan_of = getattr(workload, "tensor_parallel_plan", None)
    if plan_of is None:
        raise ConfigError(f"the model {workload.name} has no tensor-parallel plan", where="[placement] tensor_parallel_size",
                          fix="set tensor_parallel_size = 1 (FSDP shards a custom model), or train the built-in "
                              "gpt or llama")
    for path, styles in plan_of(model).items():
        for style in styles:
            parallelize_module(model, tp_mesh, {path: style})
    workload.tie_weights(model)


def loss_context(tensor_parallel: bool):
    """torch's loss_parallel() under tensor parallelism (cross-entropy on vocabulary shards; it must
    cover the forward and the backward), nothing otherwise."""
    return loss_parallel() if tensor_parallel else contextlib.nullcontext()
