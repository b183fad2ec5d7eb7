"""From a plan to Ray: resources, label selectors, ScalingConfig, and each worker's device and cores."""

import types

import pytest

from core.errors import PlacementError
from core.plan import DeviceKind
from tests.unit.test_placement_plan import cpu_plan, gpu_worker
from topology.ray_resources import NVLINK_DOMAIN_LABEL, label_value
from workers.binding import (
    NODE_ID_LABEL,
    bind,
    claim,
    label_selector,
    placement_bundles,
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
    bundles = placement_bundles(plan)
    assert bundles["bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert bundles["bundle_label_selector"] == [{NODE_ID_LABEL: "node-1"}, {NODE_ID_LABEL: "node-2"}]


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


def test_bind_a_cpu_worker_sets_its_threads():
    environ, pinned = {}, []
    worker = cpu_plan().workers[1]
    assert bind(worker, environ=environ, get_affinity=lambda pid: {0, 1},
                set_affinity=lambda pid, cores: pinned.append(cores)) == "cpu"
    assert pinned == [{1}] and environ == {"OMP_NUM_THREADS": "1"}
