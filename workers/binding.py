"""From a Plan to Ray: where each worker is scheduled, and how it binds its device and cores.

Driver side (before TorchTrainer):

    kwargs = scaling_config_kwargs(plan)            # num_workers, use_gpu, resources_per_worker, label_selector
    trainer = TorchTrainer(..., scaling_config=ScalingConfig(**kwargs))
    bundles = placement_bundles(plan)               # the same placement as ray.util.placement_group arguments

Worker side (first thing in the train loop):

    worker = claim(plan, ray_node_id=ray.get_runtime_context().get_node_id(), node_id=socket.gethostname(),
                   local_rank=ray.train.get_context().get_local_rank())
    device = torch.device(bind(worker))             # the device by UUID, NUMA-local cores
    ranks = [None] * world; dist.all_gather_object(ranks, worker.rank)
    plan = plan.reordered(ranks)                    # plan rank i is now Ray's world rank i

Ray Train numbers workers itself (by node, then by Ray's GPU id), which need not be the plan's
order; a worker therefore claims the plan entry of its own node and local rank, and the plan is
renumbered to Ray's world ranks once every worker knows which entry it took.

CUDA: bind() sets CUDA_VISIBLE_DEVICES to the UUID when CUDA has not started in the process — the
only way to reach a MIG slice. With use_gpu=True, Ray Train's TorchConfig calls
torch.cuda.set_device before the train function, and CUDA has started: bind() then selects the
visible GPU with that UUID. Ray reserves GPUs by count, not by UUID, so the plan's GPUs are the
visible ones when the plan uses whole nodes (or whole islands, through the island resources).

Scheduling: each worker is pinned to its node with a label selector — `ray.io/node-id` when the
topology came from the live cluster (it knows Ray's node ids), else the node's NVLink-domain
label that `archipelago node-resources` advertises. Whole GPUs reserve Ray's "GPU" resource and,
inside an NVLink island of two or more, one unit of the island's `nvlink_island_<id>` resource, so a
plan that uses part of a node is scheduled where its islands have room; MIG slices reserve the
`mig_<profile>` custom resource node-resources advertises (Ray does not count MIG slices as GPUs).
Ray Train gives every worker the same resources (its worker group takes one bundle shape), so
ScalingConfig carries the island resource when the plan's workers share one island, and a plan
that mixes whole GPUs and MIG slices reserves cores only; `placement_bundles` gives each worker its
own, for a placement group. Either way each worker checks what Ray gave it (`check_placement`) and
stops with a PlacementError naming the node and the GPUs when it is not what the plan placed.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, MutableMapping

from core.errors import PlacementError
from core.plan import DeviceKind, Plan, WorkerPlacement
from topology.ray_resources import NVLINK_DOMAIN_LABEL, label_value
from topology.sysfs import parse_cpu_list

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its node id."""


def worker_resources(worker: WorkerPlacement) -> dict[str, float]:
    """What one worker reserves: its cores, and its GPU or MIG slice."""
    resources = {"CPU": float(worker.cpus)}
    if worker.device_kind == DeviceKind.GPU:
        resources["GPU"] = 1.0
        if worker.island_resource:
            resources[worker.island_resource] = 1.0
    elif worker.device_kind == DeviceKind.MIG:
        resources[f"mig_{worker.device_model.rsplit(' ', 1)[-1]}"] = 1.0
    return resources


def label_selector(worker: WorkerPlacement) -> dict[str, str]:
    """Pins the worker to its node: by Ray's node id when known, else by the NVLink-domain label of
    its island (node-resources labels each node with its largest island). {} when neither exists."""
    if worker.ray_node_id:
        return {NODE_ID_LABEL: worker.ray_node_id}
    if worker.island_id:
        return {NVLINK_DOMAIN_LABEL: label_value(worker.island_id)}
    return {}


def placement_bundles(plan: Plan) -> dict:
    """Keyword arguments for `ray.util.placement_group`: one bundle per worker in plan order."""
    selectors = [label_selector(worker) for worker in plan.workers]
    arguments: dict = {"bundles": [worker_resources(worker) for worker in plan.workers], "strategy": "PACK"}
    if any(selectors):
        arguments["bundle_label_selector"] = selectors
    return arguments


def scaling_config_kwargs(plan: Plan, *, elastic_min_workers: int | None = None) -> dict:
    """Keyword arguments for `ray.train.ScalingConfig` that place the plan's workers.

    elastic_min_workers makes it elastic, num_workers=(min, plan size), without per-worker node pins:
    a worker pinned to a node that is gone could never be scheduled again, and Ray could not grow
    the job onto a node that joins later. The plan follows the workers instead: on every start of
    the group the driver plans again for the workers Ray granted (orchestrator/coordinator.py)."""
    kinds = Counter(worker.device_kind for worker in plan.workers)
    resources = [worker_resources(worker) for worker in plan.workers]
    common = {key: value for key, value in resources[0].items() if all(r.get(key) == value for r in resources)}
    if len(kinds) > 1:
        common = {"CPU": float(min(worker.cpus for worker in plan.workers))}
    selectors = [label_selector(worker) for worker in plan.workers]
    size = plan.world_size
    kwargs: dict = {"num_workers": (elastic_min_workers, size) if elastic_min_workers else size,
                    "use_gpu": "GPU" in common, "resources_per_worker": common}
    if all(selectors) and not elastic_min_workers:
        kwargs["label_selector"] = selectors
    return kwargs


def claim(plan: Plan, *, ray_node_id: str = "", node_id: str = "", local_rank: int) -> WorkerPlacement:
    """This worker's plan entry: the `local_rank`-th of the plan's workers on its node, the node named
    by Ray's node id (plans made from the live cluster) or by the topology's node id (hostname)."""
    on_node = [w for w in plan.workers if (ray_node_id and w.ray_node_id == ray_node_id) or
               (not w.ray_node_id and node_id and w.node_id == node_id)]
    if not 0 <= local_rank < len(on_node):
        raise PlacementError(f"local rank {local_rank} on node {ray_node_id or node_id!r}, which the plan gives "
                             f"{len(on_node)} workers", where="plan",
                             fix="schedule workers with scaling_config_kwargs(plan) so each node gets the plan's "
                                 "workers, or plan again on the current cluster")
    return on_node[local_rank]


def islands_reserved(plan: Plan, assigned: dict[str, float]) -> bool:
    """Whether the worker group was scheduled with island resources: through ScalingConfig when the
    plan's workers share one island (scaling_config_kwargs), or per worker through placement_bundles
    (then Ray reports an island among the worker's resources)."""
    islands = {worker.island_resource for worker in plan.workers}
    return (len(islands) == 1 and "" not in islands) or any(name.startswith("nvlink_island_") for name in assigned)


def check_placement(worker: WorkerPlacement, *, node: str, assigned: dict[str, float], gpu_ids: list,
                    islands_requested: bool = True) -> None:
    """Refuses a worker that Ray scheduled where the plan did not put it: without a unit of its NVLink
    island's resource when islands were requested (islands_reserved). The GPU itself is checked by
    bind(): inside its island the plan's GPU is bound by UUID, whichever GPU id Ray counted (Ray
    hands out the lowest free ids and knows nothing of islands). `node`: where the worker runs, for
    the message; `assigned`: Ray's resources for this worker (runtime context); `gpu_ids`:
    ray.get_gpu_ids(), for the message."""
    planned = f"GPU {worker.gpu_index} ({worker.device_uuid})" if worker.gpu_index is not None else worker.device_uuid
    held_gpus = f"Ray GPU ids {sorted(map(str, gpu_ids))}" if gpu_ids else "no Ray GPU ids"
    if islands_requested and worker.island_resource and assigned.get(worker.island_resource, 0.0) <= 0:
        islands = sorted(name for name in assigned if name.startswith("nvlink_island_")) or ["none"]
        raise PlacementError(f"rank {worker.rank} runs on node {node} with {held_gpus} and island resources "
                             f"{', '.join(islands)}; the plan placed it on node {worker.node_id}, {planned}, holding "
                             f"{worker.island_resource}", where=f"worker rank {worker.rank}",
                             fix="schedule the workers with binding.scaling_config_kwargs(plan) or placement_bundles(plan) "
                                 "(they reserve each island), start the nodes with `ray start $(archipelago "
                                 "node-resources)`, or plan again on the cluster as it is now")


def bind(worker: WorkerPlacement, *, environ: MutableMapping[str, str] | None = None, cuda=None,
         set_affinity: Callable[[int, set[int]], None] | None = None,
         get_affinity: Callable[[int], set[int]] | None = None) -> str:
    """Makes this process use the worker's device and cores; returns the torch device to use.

    Device, by UUID (NVML and CUDA number GPUs differently; a UUID means one device):
    - before CUDA has initialised in this process, CUDA_VISIBLE_DEVICES=<UUID> leaves exactly that
      GPU or MIG slice visible: "cuda:0". This is the only way to reach a MIG slice, since CUDA
      reads the variable once, at initialisation.
    - after (Ray Train's TorchConfig calls torch.cuda.set_device before the train function when
      the worker reserved Ray GPUs), the visible device whose UUID matches is made current:
      "cuda:<its index>"; a UUID that is not visible is a PlacementError.
    Environment: the plan's variables for the worker (NCCL's NICs) are set first.
    Cores: the worker's NUMA-local share, intersected with what the process may use (containers
    restrict it); left alone when that leaves nothing. `cuda` defaults to torch.cuda (a seam for
    tests: is_initialized, device_count, get_device_properties, set_device)."""
    environ = os.environ if environ is None else environ
    # NCCL reads its NIC choice when a communicator starts, at the first collective, which comes after.
    environ.update(worker.environment)
    device = "cpu"
    if worker.device_uuid is not None:
        cuda = cuda if cuda is not None else _torch_cuda()
        if cuda is not None and cuda.is_initialized():
            device = _select_visible(worker, cuda)
        else:
            environ["CUDA_VISIBLE_DEVICES"] = worker.device_uuid
            environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            device = "cuda:0"
    cores = set(parse_cpu_list(worker.cpu_affinity)) if worker.cpu_affinity else set()
    allowed = (get_affinity or os.sched_getaffinity)(0)
    if cores & allowed:
        (set_affinity or os.sched_setaffinity)(0, cores & allowed)
        if worker.device_uuid is None:
            environ["OMP_NUM_THREADS"] = str(min(worker.cpus, len(cores & allowed)))
    return device


def _torch_cuda():
    """torch.cuda if torch is imported already (binding must not be what imports it), else None."""
    import sys

    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None else None


def _select_visible(worker: WorkerPlacement, cuda) -> str:
    wanted = worker.device_uuid.split("-", 1)[1].lower()  # CUDA prints UUIDs without GPU-/MIG-
    visible = [str(cuda.get_device_properties(i).uuid).lower() for i in range(cuda.device_count())]
    if wanted not in visible:
        raise PlacementError(f"CUDA is already initialised and {worker.device_uuid} is not among its "
                             f"{len(visible)} visible devices", where=f"worker rank {worker.rank}",
                             fix="call binding.bind(worker) before anything touches CUDA (with Ray Train: "
                                 "set PYTORCH_NVML_BASED_CUDA_CHECK=1 in the workers' environment so its "
                                 "device check does not initialise CUDA), or let Ray reserve the plan's GPUs")
    index = visible.index(wanted)
    cuda.set_device(index)
    return f"cuda:{index}"
