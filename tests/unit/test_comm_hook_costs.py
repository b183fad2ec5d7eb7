"""How the planner costs DDP comm hooks: the bytes each puts on the wire, and the step on two H200s against the steps measured there, over
NVSwitch and over a 3.4 GB/s link (benchmarks/RESULTS.md, "Comm hooks over a slow link")."""

from pathlib import Path

import pytest

from orchestrator.config import JobConfig
from orchestrator.cost import POWERSGD_HOST_SECONDS_PER_MATRIX, CollectiveCostModel
from orchestrator.placement.comm_hooks import Collective, CommHookCost
from orchestrator.placement.plan import Plan
from orchestrator.placement.planner import AUTO_BF16_MIN_GAIN, Planner
from orchestrator.topology import machines
from orchestrator.topology.model import ClusterTopology

TOPOLOGIES = Path(__file__).resolve().parents[2] / "examples" / "topologies"
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304}
MEASURED_STEP_MS = {  # GPT-2 124M, 32 x 1024 tokens per GPU, two H200s (benchmarks/multigpu.py --only hooks)
    "nvswitch": {"allreduce": 66.94, "bf16": 67.33, "powersgd": 94.96, "topk": 66.96},
    "sockets": {"allreduce": 174.49, "bf16": 116.19, "powersgd": 85.06, "topk": 62.10},
}


def job(hook: str, **sections) -> JobConfig:
    data = {"name": "hooks", "model": GPT2_124M, "cluster": {"use_gpu": True, "num_workers": 2},
            "train": {"global_batch_size": 64, "micro_batch_size": 32, "precision": "bf16"},
            "compile": {"enable": True, "ddp_mode": "ddp_optimizer"}, "parallel": {"comm_hook": hook},
            "placement": {"min_gpus": 2, "max_gpus": 2}}
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return JobConfig.from_dict(data)


def test_wire_bytes_are_what_the_hooks_sent_on_two_h200s():
    """Bytes per rank and step that CommStats counted in the measured runs (after the warm-up)."""
    topk, powersgd, plain = (CommHookCost.for_job(job(hook)) for hook in ("topk", "powersgd", "allreduce"))
    assert powersgd.wire_bytes == 3_281_920  # the hook's own rule, tensor by tensor: exact
    assert topk.wire_bytes == pytest.approx(4_621_248, rel=1e-3)  # costed as one bucket; DDP sent ~20
    assert plain.wire_bytes == 497_495_040
    assert topk.collective == Collective.ALL_GATHER and powersgd.collective == Collective.ALL_REDUCE
    assert powersgd.host_seconds == pytest.approx(50 * POWERSGD_HOST_SECONDS_PER_MATRIX)  # 50 matrices compressed


def predicted_steps_ms(link: str) -> dict[str, float]:
    """The planner's step for each hook on the probed two-H200 map, with DDP's default buckets as the runs had."""
    topology = ClusterTopology.load(TOPOLOGIES / "h200x2-nvswitch.json")
    collectives = CollectiveCostModel.load(TOPOLOGIES / f"h200x2-{link}.calibration.json")
    return {hook: Planner(topology, job(hook), collectives=collectives, exact_memory=False).naive(2)
            .predicted.step_seconds * 1e3 for hook in MEASURED_STEP_MS[link]}


def test_over_a_slow_link_the_hooks_rank_and_time_as_measured():
    predicted, measured = predicted_steps_ms("sockets"), MEASURED_STEP_MS["sockets"]
    assert sorted(predicted, key=predicted.get) == sorted(measured, key=measured.get)  # topk, powersgd, bf16, allreduce
    for hook in ("allreduce", "topk", "powersgd"):
        assert predicted[hook] == pytest.approx(measured[hook], rel=0.06)
    # bf16 hid less of its all-reduce behind backward than the model lets it (predicted 96.6 ms)
    assert predicted["bf16"] == pytest.approx(measured["bf16"], rel=0.20)


def test_over_nvswitch_no_hook_beats_plain_allreduce():
    predicted = predicted_steps_ms("nvswitch")
    assert min(predicted, key=predicted.get) == "allreduce"
    # PowerSGD's own work (host-bound, per matrix) makes it the slowest, as measured
    assert max(predicted, key=predicted.get) == "powersgd"


def test_a_slow_network_gets_a_note_with_each_hooks_prediction():
    """Four 4xL4 nodes over 40 Gbit/s Ethernet: plain all-reduce leaves the step waiting on the wire."""
    def plan(hook: str):
        config = job(hook, placement={"min_gpus": 16, "max_gpus": 16},
                     train={"global_batch_size": 128, "micro_batch_size": 8})
        return Planner(machines.cluster("4xL4:4"), config, exact_memory=False).plan()

    plain, topk = plan("allreduce"), plan("topk")
    advice = [note for note in plain.notes if "comm_hook =" in note]
    assert len(advice) == 1 and all(name in advice[0] for name in ("bf16", "powersgd", "topk"))
    assert plain.predicted.exposed_communication_seconds > 0.5 * plain.predicted.step_seconds
    assert topk.predicted.step_seconds < 0.6 * plain.predicted.step_seconds
    assert topk.predicted.compute_seconds > plain.predicted.compute_seconds  # its kernels are paid for
    assert topk.allreduce.value == "all_gather"
    assert any(note.startswith("comm hook topk: each rank sends") for note in topk.notes)
    assert not any("comm_hook =" in note for note in topk.notes)


def test_topk_all_gather_grows_with_the_ranks_an_all_reduce_does_not():
    def communication(hook: str, nodes: int) -> float:
        config = job(hook, placement={"min_gpus": 4 * nodes, "max_gpus": 4 * nodes},
                     train={"global_batch_size": 8 * 4 * nodes, "micro_batch_size": 8})
        return Planner(machines.cluster(f"4xL4:{nodes}"), config, exact_memory=False).plan().predicted.communication_seconds

    topk_growth = communication("topk", 8) / communication("topk", 2)
    plain_growth = communication("allreduce", 8) / communication("allreduce", 2)
    assert topk_growth > 3 and plain_growth < 1.5


def auto_plan(link: str, **sections) -> Plan:
    topology = ClusterTopology.load(TOPOLOGIES / "h200x2-nvswitch.json")
    collectives = CollectiveCostModel.load(TOPOLOGIES / f"h200x2-{link}.calibration.json")
    return Planner(topology, job("auto", **sections), collectives=collectives, exact_memory=False).plan()


def test_auto_takes_bf16_where_the_link_is_slow_and_plain_allreduce_where_it_is_not():
    slow, fast = auto_plan("sockets"), auto_plan("nvswitch")
    assert slow.comm_hook == "bf16" and fast.comm_hook == "allreduce"
    plain = predicted_steps_ms("sockets")["allreduce"] / 1e3
    assert slow.predicted.step_seconds < (1 - AUTO_BF16_MIN_GAIN) * plain
    assert any(note.startswith("comm_hook = auto took bf16") for note in slow.notes)
    assert Plan.from_json(slow.to_json()).comm_hook == "bf16"
    # bf16 weights reduce bf16 gradients already; compiled autograd runs no hook
    assert auto_plan("sockets", train={"bf16_weights": True}).comm_hook == "allreduce"
    assert auto_plan("sockets", compile={"ddp_mode": "compiled_autograd"}).comm_hook == "allreduce"


def test_auto_takes_the_hierarchical_hook_where_the_plan_reduces_island_by_island():
    """Four nodes of NVLink-bridged A100 pairs: the pairs reduce first, then across the network.
    (With fp32 gradients auto takes bf16 there; bf16 weights leave it the exact hooks.)"""
    config = job("auto", placement={"min_gpus": 16, "max_gpus": 16}, train={"global_batch_size": 128,
                 "micro_batch_size": 8, "bf16_weights": True})
    plan = Planner(machines.cluster("4xA100-PCIE-bridged:4"), config, exact_memory=False).plan()
    assert plan.allreduce.value == "hierarchical" and plan.comm_hook == "hierarchical"
    assert plan.inter_island_groups  # what the hierarchical hook builds its groups from
