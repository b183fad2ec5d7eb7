"""From a plan to Ray: resources, label selectors, ScalingConfig, the check of what Ray gave, and each
worker's device and cores."""

import types

import pytest

from core.errors import PlacementError
from core.plan import DeviceKind
from tests.unit.test_placement_plan import cpu_plan, gpu_worker
from topology.ray_resources import NVLINK_DOMAIN_LABEL, island_resource, label_value
from workers.binding import (
    NODE_ID_LABEL,
    bind,
    check_placement,
    claim,
    holds_planned_gpu,
    island_shares,
    label_selector,
    ray_gpus_by_uuid,
    scaling_config_kwargs,
    worker_resources,
)

NO_CUDA_YET = types.SimpleNamespace(is_initialized=lambda: False)


def gpu_plan(ray_node_ids=("", "")):
    workers = [gpu_worker(0, "GPU-a", 12, accum=1), gpu_worker(1, "GPU-b", 4, accum=1)]
    workers[0].ray_node_id, workers[1].ray_node_id = ray_node_ids
    workers[0].cpu_affinity, workers[1].cpu_affinity = "0-3", "4-7"
    return cpu_plan(workers=workers, global_batch_size=16, intra_island_groups=[[0, 1]])


def test_whole_gpus_and_mig_slices_reserve_what_node_resources_advertises():
    gpu = gpu_worker(0, "GPU-a", 8)
    mig = gpu_worker(1, "MIG-b", 8, kind=DeviceKind.MIG, island=None)
    mig.device_model = "H100-SXM5-80GB 1g.10gb"
    assert worker_resources(gpu) == {"CPU": 1.0, "GPU": 1.0}
    assert worker_resources(mig) == {"CPU": 1.0, "mig_1g.10gb": 1.0}
    assert label_selector(gpu) == {NVLINK_DOMAIN_LABEL: label_value("n0-nvl0")}
    gpu.ray_node_id = "abc123"
    assert label_selector(gpu) == {NODE_ID_LABEL: "abc123"}
    assert label_selector(mig) == {}


def test_scaling_config_pins_every_worker_to_its_node():
    from ray.train import ScalingConfig

    plan = gpu_plan(("node-1", "node-2"))
    kwargs = scaling_config_kwargs(plan)
    assert kwargs == {"num_workers": 2, "use_gpu": True, "resources_per_worker": {"CPU": 1.0, "GPU": 1.0},
                      "label_selector": [{NODE_ID_LABEL: "node-1"}, {NODE_ID_LABEL: "node-2"}]}
    config = ScalingConfig(**scaling_config_kwargs(plan, elastic_min_workers=1))
    assert config.min_workers == 1 and config.max_workers == 2


def island_plan(gpus, *, node="box"):
    """Workers on `gpus` of an 8-GPU node whose island k holds GPUs 2k and 2k + 1, in plan order."""
    workers = [gpu_worker(rank, f"GPU-{gpu}", 4, accum=1, island=f"{node}-nvl{gpu // 2}")
               for rank, gpu in enumerate(gpus)]
    for worker, gpu in zip(workers, gpus):
        worker.gpu_index, worker.island_resource, worker.ray_node_id = gpu, island_resource(worker.island_id), node
    ranks = list(range(len(gpus)))
    return cpu_plan(workers=workers, global_batch_size=4 * len(gpus), intra_island_groups=[[r] for r in ranks],
                    inter_island_groups=[ranks], tensor_parallel_groups=[[r] for r in ranks],
                    data_parallel_groups=[ranks])


def test_the_group_holds_every_island_of_a_plan_on_part_of_a_node():
    one, three = island_resource("box-nvl1"), island_resource("box-nvl3")
    kwargs = scaling_config_kwargs(island_plan([2, 6]))
    assert kwargs["resources_per_worker"] == {"CPU": 1.0, "GPU": 1.0, one: 0.5, three: 0.5}
    # Shares round down to Ray's 0.0001, so three workers never ask for more than the islands have.
    shares = island_shares(island_plan([2, 3, 6]))
    assert shares == {one: 0.6666, three: 0.3333} and 3 * shares[one] <= 2 and 3 * shares[three] <= 1
    assert island_shares(island_plan([2, 3])) == {one: 1.0}
    # An elastic group's size varies: only an island that holds every worker is reserved.
    assert island_shares(island_plan([2, 6]), elastic=True) == {}
    assert scaling_config_kwargs(island_plan([2, 3]), elastic_min_workers=1)["resources_per_worker"][one] == 1.0
    # A worker on another node could hold no share of this node's islands.
    two_nodes = island_plan([2, 6])
    two_nodes.workers[1].ray_node_id = "other"
    assert island_shares(two_nodes) == {}


def test_a_cpu_plan_reserves_cores_only():
    kwargs = scaling_config_kwargs(cpu_plan())
    assert kwargs["use_gpu"] is False and kwargs["resources_per_worker"] == {"CPU": 1.0}
    assert "label_selector" not in kwargs  # nothing names the laptop's node to Ray


def test_workers_claim_their_entry_by_node_and_local_rank_and_the_plan_follows_ray_ranks():
    plan = gpu_plan(("node-1", "node-1"))
    assert claim(plan, ray_node_id="node-1", local_rank=1).device_uuid == "GPU-b"
    with pytest.raises(PlacementError, match="local rank 2 on node 'node-1', which the plan gives 2 workers"):
        claim(plan, ray_node_id="node-1", local_rank=2)
    # Ray made the worker on GPU-b world rank 0: renumber the plan to Ray's ranks.
    renumbered = plan.reordered([1, 0])
    assert [w.device_uuid for w in renumbered.workers] == ["GPU-b", "GPU-a"]
    assert [w.rank for w in renumbered.workers] == [0, 1]
    assert renumbered.batch_layout().global_batch == 16
    with pytest.raises(PlacementError, match="each of 0"):
        plan.reordered([0, 0])


def test_a_node_s_workers_claim_its_entries_in_the_order_of_their_gpus_as_ray_train_ranks_them():
    plan = island_plan([6, 2])
    assert [claim(plan, ray_node_id="box", local_rank=rank).gpu_index for rank in (0, 1)] == [2, 6]


def test_a_worker_claims_the_entry_of_the_gpu_ray_gave_it_whatever_order_ray_ranked_them_in():
    """A raylet started with CUDA_VISIBLE_DEVICES=<UUIDs> gives UUIDs, and Ray Train ranks a node's workers
    by them as strings: here GPU 6's worker is local rank 0. It claims GPU 6's entry all the same."""
    plan = island_plan([2, 6])
    plan.workers[0].device_uuid, plan.workers[1].device_uuid = "GPU-f00", "GPU-a00"
    assert claim(plan, ray_node_id="box", local_rank=0, gpu_ids=["GPU-a00"]).gpu_index == 6
    assert claim(plan, ray_node_id="box", local_rank=1, gpu_ids=["GPU-f00"]).gpu_index == 2
    # A GPU no entry holds: the local rank's entry, which check_placement then refuses.
    assert claim(plan, ray_node_id="box", local_rank=0, gpu_ids=["GPU-b00"]).gpu_index == 2


def test_the_gpu_ray_gave_is_compared_with_the_plan_s():
    worker = island_plan([6]).workers[0]
    assert holds_planned_gpu(worker, ["6"]) is True and holds_planned_gpu(worker, [6]) is True
    assert holds_planned_gpu(worker, ["0"]) is False and holds_planned_gpu(worker, ["6", "7"]) is False
    # A raylet started with CUDA_VISIBLE_DEVICES=<UUIDs> hands out UUIDs, or the unique prefixes it was given.
    assert holds_planned_gpu(worker, ["gpu-6"]) is True and holds_planned_gpu(worker, ["GPU-7"]) is False
    # Nothing to compare: no GPU from Ray (a group that reserved cores only), or no index in the plan.
    assert holds_planned_gpu(worker, []) is None
    worker.gpu_index = None
    assert holds_planned_gpu(worker, ["6"]) is None


def test_a_worker_on_another_gpu_than_the_plan_s_is_refused_naming_node_and_both_gpus():
    worker = island_plan([6]).workers[0]
    assigned = {"CPU": 1.0, "GPU": 1.0, worker.island_resource: 1.0}
    check_placement(worker, node="box (abc)", assigned=assigned, gpu_ids=["6"])
    with pytest.raises(PlacementError) as refused:
        check_placement(worker, node="box (abc)", assigned=assigned, gpu_ids=["7"])
    assert refused.value.what == ("rank 0 runs on node box (abc) on Ray's GPU 7, with island resources "
                                  "nvlink_island_box-nvl3; the plan placed it on node n0, GPU 6 (GPU-6), holding "
                                  "nvlink_island_box-nvl3")
    assert refused.value.fix.startswith("plan again for the node's free GPUs (Ray gives the lowest free ones")
    # Its GPU but not its island, when the group reserved islands.
    with pytest.raises(PlacementError, match="on Ray's GPU 6, with island resources none;") as refused:
        check_placement(worker, node="box", assigned={"GPU": 1.0}, gpu_ids=["6"])
    assert "node-resources" in refused.value.fix
    check_placement(worker, node="box", assigned={"GPU": 1.0}, gpu_ids=["6"], islands_requested=False)


def test_bind_sets_the_device_by_uuid_and_numa_local_cores():
    environ, pinned = {}, []
    worker = gpu_plan().workers[1]
    device = bind(worker, environ=environ, cuda=NO_CUDA_YET, get_affinity=lambda pid: set(range(8)),
                  set_affinity=lambda pid, cores: pinned.append(cores))
    assert device == "cuda:0" and environ["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert pinned == [{4, 5, 6, 7}]
    # Cores the container does not allow are left out; none allowed leaves the affinity alone.
    pinned.clear()
    bind(worker, environ={}, cuda=NO_CUDA_YET, get_affinity=lambda pid: {5, 6},
         set_affinity=lambda pid, cores: pinned.append(cores))
    bind(worker, environ={}, cuda=NO_CUDA_YET, get_affinity=lambda pid: {0},
         set_affinity=lambda pid, cores: pinned.append(cores))
    assert pinned == [{5, 6}]


class FakeCuda:
    """What bind reads of torch.cuda once CUDA has started, for a node where two GPUs are visible."""

    def __init__(self, uuids):
        self.uuids, self.current = uuids, None

    def is_initialized(self):
        return True

    def device_count(self):
        return len(self.uuids)

    def get_device_properties(self, index):
        return types.SimpleNamespace(uuid=self.uuids[index])

    def set_device(self, index):
        self.current = index


def test_bind_after_cuda_started_selects_the_visible_device_with_that_uuid():
    worker = gpu_plan().workers[1]
    worker.device_uuid = "GPU-2B4A0000-0000-0000-0000-000000000001"
    cuda = FakeCuda(["2b4a0000-0000-0000-0000-000000000000", "2b4a0000-0000-0000-0000-000000000001"])
    environ = {}
    assert bind(worker, environ=environ, cuda=cuda, get_affinity=lambda pid: set(),
                set_affinity=lambda pid, cores: None) == "cuda:1"
    assert cuda.current == 1 and "CUDA_VISIBLE_DEVICES" not in environ
    with pytest.raises(PlacementError, match="is not among its 1 visible devices"):
        bind(worker, environ={}, cuda=FakeCuda(["2b4a0000-0000-0000-0000-000000000000"]),
             get_affinity=lambda pid: set(), set_affinity=lambda pid, cores: None)


def test_once_cuda_started_ray_s_gpu_ids_are_compared_by_uuid_whatever_cuda_s_device_order():
    """Ray's id "6" is the second entry of the node's shared CUDA_VISIBLE_DEVICES, so CUDA device 1: its UUID
    decides, not the number (CUDA's default order need not be NVML's on a node of mixed GPU models)."""
    cuda = FakeCuda(["2b4a0000-0000-0000-0000-000000000002", "2b4a0000-0000-0000-0000-000000000006"])
    environ = {"CUDA_VISIBLE_DEVICES": "2,6"}
    assert ray_gpus_by_uuid(["6"], environ=environ, cuda=cuda) == ["GPU-2b4a0000-0000-0000-0000-000000000006"]
    worker = gpu_plan().workers[1]
    worker.gpu_index, worker.device_uuid = 3, "GPU-2B4A0000-0000-0000-0000-000000000006"  # NVML numbers it 3
    assert holds_planned_gpu(worker, ray_gpus_by_uuid(["6"], environ=environ, cuda=cuda)) is True
    assert holds_planned_gpu(worker, ray_gpus_by_uuid(["2"], environ=environ, cuda=cuda)) is False
    # Before CUDA starts (bind() will make the plan's GPU the visible one), or for an id CUDA cannot see: as given.
    assert ray_gpus_by_uuid(["6"], environ=environ, cuda=NO_CUDA_YET) == ["6"]
    assert ray_gpus_by_uuid(["7"], environ=environ, cuda=cuda) == ["7"]
    assert ray_gpus_by_uuid(["1"], environ={}, cuda=cuda) == ["GPU-2b4a0000-0000-0000-0000-000000000006"]
    assert ray_gpus_by_uuid(["GPU-2b4a"], environ={}, cuda=cuda) == ["GPU-2b4a"]  # a UUID (prefix) already


def test_bind_a_cpu_worker_sets_its_threads():
    environ, pinned = {}, []
    worker = cpu_plan().workers[1]
    assert bind(worker, environ=environ, get_affinity=lambda pid: {0, 1},
                set_affinity=lambda pid, cores: pinned.append(cores)) == "cpu"
    assert pinned == [{1}] and environ == {"OMP_NUM_THREADS": "1"}
