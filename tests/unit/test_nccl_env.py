"""NCCL's NICs from the node's map: the RDMA devices and interfaces nearest each GPU, per worker,
in the plan; none when [placement] nccl_nics is off."""

from rich.console import Console

from core.config import JobConfig
from planning.plan_table import print_plan
from planning.planner import Planner
from topology import machines
from topology.cluster import Nic, NicKind
from topology.links import LinkKind
from topology.nccl_env import nccl_environment


def test_each_gpu_gets_the_nics_under_its_own_pcie_switch():
    node = machines.cluster("8xH100-SXM:1").nodes[0]
    gpu = node.gpus[2]
    nearest = [nic.name for nic in node.nics if nic.gpu_paths.get(gpu.uuid) == LinkKind.PCIE_SWITCH]
    assert nearest  # the generated box has a NIC beside every pair of GPUs
    environment = nccl_environment(node, gpu.uuid)
    assert environment["NCCL_IB_HCA"] == "=" + ",".join(nearest)
    assert environment["NCCL_SOCKET_IFNAME"].startswith("=")
    assert nccl_environment(node, node.gpus[0].uuid)["NCCL_IB_HCA"] != environment["NCCL_IB_HCA"]


def test_without_paths_the_gpus_numa_node_decides_and_down_nics_are_skipped():
    node = machines.cluster("8xH100-SXM:1").nodes[0]
    gpu = node.gpus[0]
    node.nics = [Nic(name="mlx5_far", kind=NicKind.INFINIBAND, numa_node=1 - gpu.numa_node),
                 Nic(name="mlx5_near", kind=NicKind.INFINIBAND, numa_node=gpu.numa_node),
                 Nic(name="mlx5_down", kind=NicKind.INFINIBAND, numa_node=gpu.numa_node, up=False),
                 Nic(name="eth0", kind=NicKind.ETHERNET, numa_node=gpu.numa_node)]
    assert nccl_environment(node, gpu.uuid) == {"NCCL_IB_HCA": "=mlx5_near", "NCCL_SOCKET_IFNAME": "=eth0"}


def test_the_plan_names_each_workers_nics_unless_switched_off():
    def plan(nccl_nics: bool):
        config = JobConfig.from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64},
                                      "cluster": {"use_gpu": True}, "placement": {"nccl_nics": nccl_nics, "min_gpus": 8},
                                      "train": {"global_batch_size": 64, "micro_batch_size": 8}})
        return Planner(machines.cluster("8xH100-SXM:2"), config, exact_memory=False).plan()
    on = plan(True)
    nodes = {node.node_id: node for node in machines.cluster("8xH100-SXM:2").nodes}
    assert all(w.environment == nccl_environment(nodes[w.node_id], w.device_uuid) for w in on.workers)
    assert len({w.environment["NCCL_IB_HCA"] for w in on.workers}) > 1  # not one NIC for all
    assert all(w.environment == {} for w in plan(False).workers)


def test_the_printed_plan_shows_its_mesh_and_each_workers_nics():
    config = JobConfig.from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64},
                                  "cluster": {"use_gpu": True},
                                  "placement": {"min_gpus": 8, "max_gpus": 8, "tensor_parallel_size": 2},
                                  "parallel": {"strategy": "fsdp"},
                                  "train": {"global_batch_size": 64, "micro_batch_size": 8}})
    cluster = machines.cluster("8xH100-SXM:1")
    plan = Planner(cluster, config, exact_memory=False).plan()
    console = Console(record=True, width=400)
    print_plan(plan, None, console)
    text = console.export_text()
    assert "mesh dp_shard 4 × tp 2 (8 ranks" in text, text
    node = cluster.nodes[0]
    for worker in plan.workers:
        hca = nccl_environment(node, worker.device_uuid)["NCCL_IB_HCA"]
        row = next(line for line in text.splitlines() if line.split()[:1] == [str(worker.rank)])
        assert f"IB_HCA{hca}" in row, row
