"""How the planner costs DDP comm hooks: the bytes each puts on the wire, and the step on two H200s against the steps measured there, over
NVSwitch and over a 3.4 GB/s link (benchmarks/RESULTS.md, "Comm hooks over a slow link")."""

from pathlib import Path

import pytest

from core.config import JobConfig
from core.errors import ConfigError, PlacementError
from core.plan import Plan
from planning import planner as planner_module
from planning.calibration import Calibration
from planning.collectives import (
    NVLINK_DDP_COMPUTE_SLOWDOWN,
    CollectiveCostModel,
    LinkCalibration,
    LinkClass,
    parse_calibration,
)
from planning.compute import POWERSGD_HOST_SECONDS_PER_MATRIX, ComputeModel
from planning.costing import PlanningJob
from planning.devices import DeviceType
from planning.hook_costs import CommHookCost
from planning.planner import AUTO_BF16_MIN_GAIN, Planner
from topology import machines
from topology.cluster import ClusterTopology

TOPOLOGIES = Path(__file__).resolve().parents[2] / "examples" / "topologies"
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304}
MEASURED_STEP_MS = {  # GPT-2 124M, 32 x 1024 tokens per GPU, two H200s (benchmarks/multigpu.py --only hooks)
    "nvswitch": {"allreduce": 65.33, "bf16": 65.16, "powersgd": 97.48, "topk": 65.08},
    "sockets": {"allreduce": 174.49, "bf16": 116.19, "powersgd": 85.06, "topk": 62.10},
}
MEASURED_TOPK_WIRE = "offsets"
"""How topk sent its places in the runs above: the planner costs the same wire."""


def job(hook: str, **sections) -> JobConfig:
    data = {"name": "hooks", "model": GPT2_124M, "cluster": {"use_gpu": True, "num_workers": 2},
            "train": {"global_batch_size": 64, "micro_batch_size": 32, "precision": "bf16"},
            "compile": {"enable": True, "ddp_mode": "ddp_optimizer"},
            "parallel": {"comm_hook": hook, "topk_wire": MEASURED_TOPK_WIRE},
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
    assert topk.all_gather and not powersgd.all_gather
    assert powersgd.host_seconds == pytest.approx(50 * POWERSGD_HOST_SECONDS_PER_MATRIX)  # 50 matrices compressed


def test_topk_wire_bytes_follow_the_encoding_asked_for():
    """Places Elias-Fano coded (the default) or as the payload's offsets: both as the hook sent them
    on two H200s (benchmarks/multigpu.py --only hooks --topk-wires offsets elias_fano)."""
    coded, offsets = (CommHookCost.for_job(job("topk", parallel={"topk_wire": wire}))
                      for wire in ("elias_fano", "offsets"))
    assert coded.wire_bytes == pytest.approx(3_294_752, rel=1e-3)  # costed as one bucket; DDP sent ~20
    assert offsets.wire_bytes == pytest.approx(4_621_248, rel=1e-3)


def test_the_elias_fano_wire_costs_its_launches_and_a_decode_of_every_rank():
    """On top of top-k's own kernels: about what two H200s measured, and more with every rank whose
    wire is decoded, on a GPU and on CPU workers (the torch twins)."""
    coded, offsets = (CommHookCost.for_job(job("topk", parallel={"topk_wire": wire}))
                      for wire in ("elias_fano", "offsets"))
    h200 = two_h200s(job("topk"), "nvswitch").pool.domains[0].type
    cpu_job = job("topk", cluster={"use_gpu": False}, compile={"enable": False}, train={"precision": "fp32"})
    cpu = Planner(machines.cluster("1xH200"), cpu_job, exact_memory=False).pool.domains[0].type

    def extra(device: DeviceType, ranks: int) -> float:  # coded's compute beyond offsets'
        return coded.compute_seconds(device, ranks) - offsets.compute_seconds(device, ranks)

    assert 0.2e-3 < extra(h200, 2) < 0.8e-3  # measured 0.4 ms a step (one call; single steps read to ~1 ms)
    assert extra(h200, 2) < extra(h200, 8) < extra(h200, 64)
    assert 0 < extra(cpu, 2) < extra(cpu, 8)


def test_a_topk_plan_names_the_other_wire_where_it_is_predicted_faster():
    """Elias-Fano's smaller wire pays where the all-gather is exposed (sixteen 4xL4 nodes on Ethernet);
    over two H200s its launches cost more than the bytes it saves (as measured: 0.4 ms a step)."""
    def wire_notes(planner: Planner) -> list[str]:
        return [note for note in planner.plan().notes if "topk_wire" in note]

    over_nvswitch = wire_notes(two_h200s(job("topk", parallel={"topk_wire": "elias_fano"}), "nvswitch"))
    assert len(over_nvswitch) == 1 and over_nvswitch[0].startswith('[parallel] topk_wire = "offsets" is predicted')
    ethernet = job("topk", parallel={"topk_wire": "offsets"}, placement={"min_gpus": 1, "max_gpus": 64})
    on_l4s = wire_notes(Planner(machines.cluster("4xL4:16"), ethernet, exact_memory=False))
    assert len(on_l4s) == 1 and on_l4s[0].startswith('[parallel] topk_wire = "elias_fano" is predicted')
    assert not wire_notes(two_h200s(job("topk", parallel={"topk_wire": "offsets"}), "nvswitch"))


def two_h200s(config: JobConfig, link: str) -> Planner:
    """A planner on the probed two-H200 map, with the link's calibration row ("nvswitch" or "sockets")."""
    topology = ClusterTopology.load(TOPOLOGIES / "h200x2-nvswitch.json")
    collectives = Calibration.load(TOPOLOGIES / f"h200x2-{link}.calibration.json").collectives()
    return Planner(topology, config, collectives=collectives, exact_memory=False)


def predicted_steps_ms(link: str) -> dict[str, float]:
    """The planner's step for each hook, with DDP's default buckets as the runs had."""
    return {hook: two_h200s(job(hook), link).naive(2).predicted.step_seconds * 1e3 for hook in MEASURED_STEP_MS[link]}


def test_over_a_slow_link_the_hooks_rank_and_time_as_measured():
    predicted, measured = predicted_steps_ms("sockets"), MEASURED_STEP_MS["sockets"]
    assert sorted(predicted, key=predicted.get) == sorted(measured, key=measured.get)  # topk, powersgd, bf16, allreduce
    for hook in ("allreduce", "topk", "powersgd"):
        assert predicted[hook] == pytest.approx(measured[hook], rel=0.06)
    # bf16 hid less of its all-reduce behind backward than the model lets it (predicted 96.6 ms)
    assert predicted["bf16"] == pytest.approx(measured["bf16"], rel=0.20)


def test_over_nvswitch_compression_buys_nothing():
    predicted, measured = predicted_steps_ms("nvswitch"), MEASURED_STEP_MS["nvswitch"]
    # bf16 and topk were measured within 0.4 % of allreduce; the model keeps them within 2 %
    for hook in ("bf16", "topk"):
        assert abs(predicted[hook] / predicted["allreduce"] - 1) < 0.02
        assert abs(measured[hook] / measured["allreduce"] - 1) < 0.005
    # PowerSGD's own work (host-bound, per matrix) makes it the slowest, as measured
    assert max(predicted, key=predicted.get) == max(measured, key=measured.get) == "powersgd"


def test_over_nvswitch_the_step_is_what_two_gpus_measured():
    """Without the kernels' slowdown beside NCCL over NVLink every hook was predicted 7-9 % fast."""
    predicted, measured = predicted_steps_ms("nvswitch"), MEASURED_STEP_MS["nvswitch"]
    for hook in ("allreduce", "bf16", "topk"):
        assert predicted[hook] == pytest.approx(measured[hook], rel=0.03)


def test_ddp_over_nvlink_pays_the_measured_compute_slowdown():
    topology = ClusterTopology.load(TOPOLOGIES / "h200x2-nvswitch.json")

    def predicted(collectives: CollectiveCostModel):
        return Planner(topology, job("allreduce"), collectives=collectives, exact_memory=False).naive(2).predicted

    unslowed = CollectiveCostModel({LinkClass.NVSWITCH: LinkCalibration(alpha_us=6.0, efficiency=0.85)})
    # The micro-step runs beside the all-reduce; the optimizer's step after it is not slowed.
    optimizer = ComputeModel.compiled().gpu_optimizer_seconds(4.8e12, PlanningJob.from_config(job("allreduce")).parameters)
    alone = predicted(unslowed).compute_seconds
    assert predicted(CollectiveCostModel()).compute_seconds == pytest.approx(
        alone + (alone - optimizer) * NVLINK_DDP_COMPUTE_SLOWDOWN)


def test_a_calibration_row_keeps_its_link_class_slowdown_unless_it_gives_one():
    table = parse_calibration({"nvswitch": {"alpha_us": 30.0, "bus_gb_per_s": 320.0},
                               "nvlink": {"alpha_us": 5.0, "bus_gb_per_s": 100.0, "ddp_compute_slowdown": 0}},
                              where="calibration.json")
    assert table[LinkClass.NVSWITCH].ddp_compute_slowdown == NVLINK_DDP_COMPUTE_SLOWDOWN
    assert table[LinkClass.NVLINK].ddp_compute_slowdown == 0.0
    with pytest.raises(ConfigError, match="0.08 for 8 %"):  # a percentage where a share belongs
        parse_calibration({"nvswitch": {"alpha_us": 30.0, "ddp_compute_slowdown": 8}}, where="calibration.json")


def test_a_slow_network_gets_a_note_with_each_hooks_prediction():
    """Four 4xL4 nodes over 40 Gbit/s Ethernet: plain all-reduce leaves the step waiting on the wire."""
    def plan(hook: str):
        config = job(hook, placement={"min_gpus": 16, "max_gpus": 16},
                     train={"global_batch_size": 128, "micro_batch_size": 8})
        return Planner(machines.cluster("4xL4:4"), config, exact_memory=False).plan()

    plain, topk = plan("allreduce"), plan("topk")
    advice = [note for note in plain.notes if "comm_hook =" in note]
    assert len(advice) == 1 and all(name in advice[0] for name in ("bf16", "powersgd", "topk"))
    assert plain.predicted.exposed_communication_seconds > 0.4 * plain.predicted.step_seconds
    # topk's wire hides behind backward: the wait is gone, its step shorter by most of it
    assert topk.predicted.exposed_communication_seconds < 0.1 * plain.predicted.exposed_communication_seconds
    assert topk.predicted.step_seconds < plain.predicted.step_seconds - 0.7 * plain.predicted.exposed_communication_seconds
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
    return two_h200s(job("auto", **sections), link).plan()


def test_auto_takes_bf16_where_the_link_is_slow_and_plain_allreduce_where_it_is_not():
    slow, fast = auto_plan("sockets"), auto_plan("nvswitch")
    assert slow.comm_hook == "bf16" and fast.comm_hook == "allreduce"
    plain = two_h200s(job("allreduce"), "sockets").plan()
    assert slow.predicted.step_seconds < (1 - AUTO_BF16_MIN_GAIN) * plain.predicted.step_seconds
    assert any(note.startswith("comm_hook = auto took bf16") for note in slow.notes)
    assert Plan.from_json(slow.to_json()).comm_hook == "bf16"
    # bf16 weights reduce bf16 gradients already; compiled autograd runs no hook
    assert auto_plan("sockets", train={"bf16_weights": True}).comm_hook == "allreduce"
    assert auto_plan("sockets", parallel={"strategy": "fsdp"}).comm_hook == "allreduce"


def test_the_planner_keeps_no_state_between_searches():
    """Under "auto" each search is scored by a costing of its own: planning twice, or the exhaustive
    check before or after planning, gives the same answers."""
    planner = two_h200s(job("auto"), "sockets")
    before = planner.exhaustive()
    first, second = planner.plan(), planner.plan()
    after = planner.exhaustive()
    assert first == second and first.comm_hook == "bf16"
    assert before.score == after.score and planner.costing.comm_hook.name == "auto"
    fresh = two_h200s(job("auto"), "sockets")
    assert fresh.plan() == first


def test_auto_keeps_plain_allreduce_when_bf16_gains_less_than_the_threshold(monkeypatch):
    monkeypatch.setattr(planner_module, "AUTO_BF16_MIN_GAIN", 0.5)  # bf16 is predicted about 43 % faster here
    plan = auto_plan("sockets")
    assert plan.comm_hook == "allreduce" and not any("auto took" in note for note in plan.notes)
    assert auto_plan("sockets", compile={"ddp_mode": "compiled_autograd"}).comm_hook == "allreduce"


def test_powersgd_is_not_planned_where_the_reduction_goes_through_gloo():
    """Several MIG slices of one GPU reduce over gloo, where torch's PowerSGD hook hangs."""
    config = job("powersgd", placement={"min_gpus": 2, "max_gpus": 7, "use_mig": True},
                 train={"global_batch_size": 14, "micro_batch_size": 1})
    with pytest.raises(PlacementError, match="powersgd hangs over gloo"):
        Planner(machines.cluster("1xH100-MIG7:1"), config, exact_memory=False).plan()


def test_what_topk_and_powersgd_keep_counts_against_memory():
    def peak(hook: str) -> int:
        plan = Planner(machines.cluster("8xH200:1"), job(hook), exact_memory=False).plan()
        return plan.workers[0].predicted_peak_memory_bytes

    elements = 124_373_760
    assert peak("topk") - peak("allreduce") == 4 * elements  # the fp32 residual
    assert peak("powersgd") - peak("allreduce") == 4 * elements + 3_281_920  # error feedback, P and Q


def test_a_plan_naming_an_unknown_hook_is_refused_on_load():
    text = auto_plan("sockets").to_json().replace('"comm_hook": "bf16"', '"comm_hook": "gossip"')
    with pytest.raises(PlacementError, match="comm_hook 'gossip' is not one of"):
        Plan.from_json(text)
