"""From a Plan to Ray: where each worker is scheduled, and how it binds its device and cores.

Driver side (before TorchTrainer):

    kwargs = scaling_config_kwargs(plan)            # num_workers, use_gpu, resources_per_worker, label_selector
    trainer = TorchTrainer(..., scaling_config=ScalingConfig(**kwargs))

Worker side (first thing in the train loop):

    gpu_ids = ray_gpus_by_uuid(ray.get_gpu_ids())
    worker = claim(plan, ray_node_id=ray.get_runtime_context().get_node_id(), node_id=socket.gethostname(),
                   local_rank=ray.train.get_context().get_local_rank(), gpu_ids=gpu_ids)
    check_placement(worker, node=..., assigned=ray.get_runtime_context().get_assigned_resources(),
                    gpu_ids=gpu_ids, islands_requested=islands_reserved(plan, assigned))
    device = torch.device(bind(worker))             # the device by UUID, NUMA-local cores
    ranks = [None] * world; dist.all_gather_object(ranks, worker.rank)
    plan = plan.reordered(ranks)                    # plan rank i is now Ray's world rank i

Ray Train numbers workers itself (by node, then by Ray's GPU id), which need not be the plan's
order; a worker therefore claims the plan entry of its own node and local rank, and the plan is
renumbered to Ray's world ranks once every worker knows which entry it took.

What Ray can and cannot be asked (Ray 2.60):
- The node: each worker is pinned to its node with a label selector — `ray.io/node-id` when the
  topology came from the live cluster (it knows Ray's node ids), else the node's NVLink-domain
  label that `archipelago node-resources` advertises. ScalingConfig takes one selector per worker.
- The islands: Ray Train gives every worker the same resources (its worker group is one placement
  group of identical bundles), so a worker cannot reserve its own island. The group reserves the
  plan's islands together instead (`island_shares`), which keeps other island-aware jobs off them.
- The GPU: not at all. Ray hands each worker the lowest free GPU ids of its node (slots of the
  raylet's CUDA_VISIBLE_DEVICES, else 0 … N−1) and has no way to ask for a particular GPU. So
  each worker compares the GPU Ray gave it with the plan's (`check_placement`) and stops with a
  PlacementError naming the node and both GPUs when they differ: a plan lands on its GPUs when they
  are the node's lowest free ones, and fails loudly otherwise, never binding a GPU Ray gave another.
MIG slices reserve the `mig_<profile>` custom resource node-resources advertises (Ray does not count
MIG slices as GPUs); a plan that mixes whole GPUs and MIG slices reserves cores only, and then Ray
gives no GPU ids to check.

CUDA: bind() sets CUDA_VISIBLE_DEVICES to the UUID when CUDA has not started in the process — the
only way to reach a MIG slice. With use_gpu=True, Ray Train's TorchConfig calls
torch.cuda.set_device before the train function, and CUDA has started: bind() then selects the
visible GPU with that UUID.
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
RESOURCE_STEPS = 10_000
"""Ray counts a resource in steps of 0.0001 of a unit."""


def worker_resources(worker: WorkerPlacement) -> dict[str, float]:
    """What one worker reserves by itself: its cores, and its GPU or MIG slice (islands: island_shares)."""
    resources = {"CPU": float(worker.cpus)}
    if worker.device_kind == DeviceKind.GPU:
        resources["GPU"] = 1.0
    elif worker.device_kind == DeviceKind.MIG:
        resources[f"mig_{worker.device_model.rsplit(' ', 1)[-1]}"] = 1.0
    return resources


def island_shares(plan: Plan, *, elastic: bool = False) -> dict[str, float]:
    """What every worker reserves of the plan's NVLink islands, so that the group holds them all.

    Ray Train reserves one resource shape for all its workers, so a plan on islands 1 and 3 of a node
    cannot give each worker its own island. Each worker takes an equal share of every island the plan
    uses instead (rounded down to Ray's 0.0001): the group's shares add up to the plan's GPUs of each
    island, less the rounding, so the job holds those islands' units on the node and no other
    island-aware job gets them.
    That pins the islands to the job, not a worker to its island, nor a GPU: the GPU Ray gives is
    checked by check_placement. Only for a plan on one node (another node has none of its islands'
    resources); an elastic group, whose size varies, only when one island holds every worker."""
    counts = Counter(worker.island_resource for worker in plan.workers if worker.island_resource)
    nodes = {worker.ray_node_id or worker.node_id for worker in plan.workers}
    one_island_holds_all = list(counts.values()) == [plan.world_size]
    if len(nodes) > 1 or (elastic and not one_island_holds_all):
        return {}
    return {name: count * RESOURCE_STEPS // plan.world_size / RESOURCE_STEPS for name, count in counts.items()}


def label_selector(worker: WorkerPlacement) -> dict[str, str]:
    """Pins the worker to its node: by Ray's node id when known, else by the NVLink-domain label of
    its island (node-resources labels each node with its largest island). {} when neither exists."""
    if worker.ray_node_id:
        return {NODE_ID_LABEL: worker.ray_node_id}
    if worker.island_id:
        return {NVLINK_DOMAIN_LABEL: label_value(worker.island_id)}
    return {}


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
    elif DeviceKind.GPU in kinds:
        common.update(island_shares(plan, elastic=bool(elastic_min_workers)))
    selectors = [label_selector(worker) for worker in plan.workers]
    size = plan.world_size
    kwargs: dict = {"num_workers": (elastic_min_workers, size) if elastic_min_workers else size,
                    "use_gpu": "GPU" in common, "resources_per_worker": common}
    if all(selectors) and not elastic_min_workers:
        kwargs["label_selector"] = selectors
    return kwargs


def claim(plan: Plan, *, ray_node_id: str = "", node_id: str = "", local_rank: int,
          gpu_ids: list = ()) -> WorkerPlacement:
    """This worker's plan entry on its node, the node named by Ray's node id (plans made from the live
    cluster) or by the topology's node id (hostname): the entry of the GPU Ray gave it (`gpu_ids`, best
    as ray_gpus_by_uuid gives them) when exactly one entry holds it; else the `local_rank`-th entry.

    Ray Train gives a node's local ranks in the order of its workers' Ray GPU ids (WorkerGroup.
    _sort_workers_by_gpu_id_grouped_by_node), so without a GPU to match the node's entries are taken
    in the order of their GPU index. That order can differ from Ray's (ids that are UUIDs, CUDA's
    device order on a node of mixed models), which matching by the GPU itself does not mind."""
    on_node = [w for w in plan.workers if (ray_node_id and w.ray_node_id == ray_node_id) or
               (not w.ray_node_id and node_id and w.node_id == node_id)]
    holding = [w for w in on_node if holds_planned_gpu(w, list(gpu_ids))]
    if len(holding) == 1:
        return holding[0]
    if all(w.gpu_index is not None for w in on_node):
        on_node.sort(key=lambda w: w.gpu_index)
    if not 0 <= local_rank < len(on_node):
        raise PlacementError(f"local rank {local_rank} on node {ray_node_id or node_id!r}, which the plan gives "
                             f"{len(on_node)} workers", where="plan",
                             fix="schedule workers with scaling_config_kwargs(plan) so each node gets the plan's "
                                 "workers, or plan again on the current cluster")
    return on_node[local_rank]


def islands_reserved(plan: Plan, assigned: dict[str, float]) -> bool:
    """Whether the worker group was scheduled with island resources: when the plan's workers share one
    island (scaling_config_kwargs carries it, elastic or not), or when Ray reports an island among the
    worker's resources (island_shares of a plan on one node)."""
    islands = {worker.island_resource for worker in plan.workers}
    return (len(islands) == 1 and "" not in islands) or any(name.startswith("nvlink_island_") for name in assigned)


def holds_planned_gpu(worker: WorkerPlacement, gpu_ids: list) -> bool | None:
    """Whether the GPU ids Ray gave the worker (ray.get_gpu_ids()) are exactly its planned GPU.

    Ray's ids are entries of the raylet's CUDA_VISIBLE_DEVICES when it was set (CUDA indices or UUIDs),
    else CUDA indices 0 … N−1. A CUDA index is the plan's gpu_index (NVML's, in PCI bus order) on a node
    of one GPU model or under CUDA_DEVICE_ORDER=PCI_BUS_ID. None when it cannot tell: not a whole-GPU
    worker, no GPU ids (the group reserved cores only), or an index against a plan without one."""
    if worker.device_kind != DeviceKind.GPU or not gpu_ids:
        return None
    ids = {str(gpu_id) for gpu_id in gpu_ids}
    if len(ids) > 1:
        return False
    (given,) = ids
    if given.isdigit():
        return None if worker.gpu_index is None else int(given) == worker.gpu_index
    # CUDA_VISIBLE_DEVICES takes a UUID or a unique prefix of one.
    return (worker.device_uuid or "").lower().startswith(given.lower())


def ray_gpus_by_uuid(gpu_ids: list, *, environ: MutableMapping[str, str] | None = None, cuda=None) -> list:
    """Ray's GPU ids (ray.get_gpu_ids()) as the UUIDs of those GPUs ("GPU-…") when CUDA has started in this
    process (Ray Train's TorchConfig starts it on GPU workers): a CUDA index means the GPU in CUDA's device
    order, which on a node of mixed GPU models need not be NVML's, so holds_planned_gpu compares UUIDs,
    exactly. Each id is a CUDA_VISIBLE_DEVICES entry (Ray Train shows a node's workers all the node's
    reserved GPUs), so its position there is its CUDA device. The ids as they are when CUDA has not
    started (bind() then makes the plan's GPU the visible one) or an id is not among the visible."""
    environ = os.environ if environ is None else environ
    cuda = cuda if cuda is not None else _torch_cuda()
    if not gpu_ids or not all(str(gpu_id).isdigit() for gpu_id in gpu_ids) or cuda is None or not cuda.is_initialized():
        return gpu_ids  # UUIDs already (the raylet's CUDA_VISIBLE_DEVICES named GPUs or MIG slices by UUID)
    visible = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    positions = [visible.index(str(gpu_id)) if visible else int(gpu_id) for gpu_id in gpu_ids
                 if not visible or str(gpu_id) in visible]
    if len(positions) != len(gpu_ids) or max(positions) >= cuda.device_count():
        return gpu_ids
    return [f"GPU-{cuda.get_device_properties(position).uuid}" for position in positions]


def check_placement(worker: WorkerPlacement, *, node: str, assigned: dict[str, float], gpu_ids: list,
                    islands_requested: bool = True) -> None:
    """Refuses a worker that Ray scheduled where the plan did not put it: on another GPU than the
    plan's (holds_planned_gpu), or without its NVLink island's resource when islands were requested
    (islands_reserved). `node`: where the worker runs, for the message; `assigned`: Ray's resources
    for this worker (runtime context); `gpu_ids`: ray.get_gpu_ids()."""
    on_planned_gpu = holds_planned_gpu(worker, gpu_ids)
    outside_island = bool(islands_requested and worker.island_resource
                          and assigned.get(worker.island_resource, 0.0) <= 0)
    if on_planned_gpu is not False and not outside_island:
        return
    planned = f"GPU {worker.gpu_index} ({worker.device_uuid})" if worker.gpu_index is not None else worker.device_uuid
    held_gpus = f"Ray's GPU {', '.join(sorted(map(str, gpu_ids)))}".replace("GPU GPU-", "GPU-") if gpu_ids else "no Ray GPU"
    islands = sorted(name for name in assigned if name.startswith("nvlink_island_")) or ["none"]
    holding = f", holding {worker.island_resource}" if worker.island_resource else ""
    if on_planned_gpu is False:
        fix = ("plan again for the node's free GPUs (Ray gives the lowest free ones and cannot be asked for others), "
               "or start Ray there with CUDA_VISIBLE_DEVICES listing only the GPUs it may give")
    else:
        fix = ("schedule the workers with binding.scaling_config_kwargs(plan) (it reserves the plan's islands), "
               "start the nodes with `ray start $(archipelago node-resources)`, or plan again on the cluster "
               "as it is now")
    raise PlacementError(f"rank {worker.rank} runs on node {node} on {held_gpus}, with island "
                         f"resources {', '.join(islands)}; the plan placed it on node {worker.node_id}, "
                         f"{planned}{holding}", where=f"worker rank {worker.rank}", fix=fix)


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
