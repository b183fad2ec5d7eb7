"""The planner on generated clusters: islands, MIG, the heterogeneous split, objectives, refusals."""

import dataclasses

import pytest

from core.config import JobConfig
from core.errors import ConfigError, PlacementError
from core.plan import DataParallel, DeviceKind, Plan
from planning import memory
from planning.compute import ComputeModel
from planning.model_size import model_facts
from planning.planner import Planner
from topology import machines
from topology.cluster import ClusterTopology, MeasuredDevice, Nic, NicKind, NodeTopology, NumaNode
from workers.models import make_workload

TINY_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128, "vocab_size": 257}
NO_OVERHEAD = ComputeModel(micro_step_overhead_s_per_layer=0.0)
"""Step time proportional to FLOPs, so splits follow device speed exactly."""


def job(**sections) -> JobConfig:
    base = {"name": "t", "model": TINY_MODEL, "cluster": {"use_gpu": True},
            "train": {"global_batch_size": 64, "micro_batch_size": 16, "steps": 1000}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return JobConfig.from_dict(base)


def planner(cluster: str | ClusterTopology, config: JobConfig | None = None, **kwargs) -> Planner:
    topology = machines.cluster(cluster) if isinstance(cluster, str) else cluster
    return Planner(topology, config or job(), exact_memory=False, **kwargs)


def laptop(cores: int = 2) -> ClusterTopology:
    return ClusterTopology(nodes=[NodeTopology(
        node_id="laptop", cpu_count=cores, memory_bytes=16 * 2**30,
        numa_nodes=[NumaNode(numa_id=0, cpus=f"0-{cores - 1}", memory_bytes=16 * 2**30)],
        nics=[Nic(name="eth0", kind=NicKind.ETHERNET)])])


def test_the_cpu_demo_goes_through_the_planner():
    config = job(cluster={"use_gpu": False, "num_workers": 2, "cpus_per_worker": 1},
                 train={"global_batch_size": 32, "micro_batch_size": 16})
    plan = Planner(laptop(), config).plan()  # exact memory: two fake steps of the demo model
    assert not plan.uses_gpus and plan.world_size == 2 and plan.backend == "gloo"
    assert [w.device_uuid for w in plan.workers] == [None, None]
    assert [w.cpu_affinity for w in plan.workers] == ["0", "1"]
    assert [w.micro_batch_size for w in plan.workers] == [16, 16] and plan.grad_accum_steps == 1
    assert plan.predicted.step_seconds > 0 and plan.workers[0].predicted_peak_memory_bytes > 0
    assert Plan.from_json(plan.to_json()) == plan


DEMO_WORKER_STEP_FLOPS = 5_702_400 * 128 * 16
"""The demo model's counted FLOPs a token (planning/model_size.py) × 128 tokens × one worker's 16 sequences."""


def probed_laptop(**cpu_figures: float) -> ClusterTopology:
    topology = laptop()
    topology.nodes[0].measured = [MeasuredDevice(name="cpu", cores=2, **cpu_figures)]
    return topology


def test_cpu_workers_are_planned_at_the_probes_block_training_rate():
    """The demo on a 2-core AMD EPYC: the probe's product read 74 GFLOP/s a core (0.31 of it predicted 511 ms
    for a 245 ms step); training its reference block read 55 GFLOP/s, which prices the step at 212 ms on
    idle cores, and at 245 ms beside Ray's own processes (0.27 of the two cores: 13.5 % of each)."""
    demo = job(cluster={"use_gpu": False, "num_workers": 2, "cpus_per_worker": 1},
               train={"global_batch_size": 32, "micro_batch_size": 16})
    flops_only = ComputeModel(cpu_overhead_s_per_layer=0.0)

    def compute_ms(**figures: float) -> float:
        return planner(probed_laptop(**figures), demo, compute=flops_only).plan().predicted.compute_seconds * 1e3

    assert DEMO_WORKER_STEP_FLOPS == pytest.approx(11.68e9, rel=1e-3)
    # One core a worker: the core's block rate prices the step, whatever its product rate reads.
    assert compute_ms(fp32_tflops=0.074, fp32_block_tflops=0.055) == pytest.approx(212.3 / 0.865, abs=0.1)
    assert compute_ms(fp32_tflops=0.145, fp32_block_tflops=0.055) == pytest.approx(245.5, abs=0.1)
    # A map probed before the block was measured keeps the product rate's share.
    assert compute_ms(fp32_tflops=0.074) == pytest.approx(DEMO_WORKER_STEP_FLOPS / (0.074e12 * 0.31) * 1e3, rel=1e-6)
    assert compute_ms(fp32_tflops=0.074) == pytest.approx(509.1, abs=0.1)


def test_a_cpu_worker_of_two_cores_trains_at_both_cores_block_rate():
    config = job(cluster={"use_gpu": False, "num_workers": 1, "cpus_per_worker": 2},
                 train={"global_batch_size": 16, "micro_batch_size": 16})
    flops_only = ComputeModel(cpu_overhead_s_per_layer=0.0)
    plan = planner(probed_laptop(fp32_tflops=0.074, fp32_block_tflops=0.055), config, compute=flops_only).plan()
    assert plan.predicted.compute_seconds == pytest.approx(DEMO_WORKER_STEP_FLOPS / (2 * 0.055e12 * (1 - 0.27 / 2)))


def test_rays_own_processes_take_their_share_of_a_small_nodes_cores_only():
    """The probe measures idle cores; Ray's processes take 0.27 of a core while a job trains, which is
    13.5 % of each core of a 2-core node and 0.4 % of each of 64."""
    config = job(cluster={"use_gpu": False, "num_workers": 1, "cpus_per_worker": 1},
                 train={"global_batch_size": 16, "micro_batch_size": 16})
    flops_only = ComputeModel(cpu_overhead_s_per_layer=0.0)

    def compute_s(cores: int) -> float:
        topology = laptop()
        topology.nodes[0].measured = [MeasuredDevice(name="cpu", cores=cores, fp32_tflops=0.1, fp32_block_tflops=0.05)]
        return planner(topology, config, compute=flops_only).plan().predicted.compute_seconds

    idle = DEMO_WORKER_STEP_FLOPS / 0.05e12
    assert compute_s(2) == pytest.approx(idle / (1 - 0.27 / 2))
    assert compute_s(64) == pytest.approx(idle / (1 - 0.27 / 64))


def test_bf16_on_cpu_workers_is_planned_at_its_measured_speed_not_fp32s():
    """torch emulates bf16 on CPUs without bf16 units: the demo model trained ~8x slower in it."""
    cpu = {"use_gpu": False, "num_workers": 2, "cpus_per_worker": 1}
    flops_only = ComputeModel(cpu_overhead_s_per_layer=0.0)
    fp32, bf16 = (planner(laptop(), job(cluster=cpu, train={"precision": precision}), compute=flops_only).plan()
                  for precision in ("auto", "bf16"))
    ratio = bf16.predicted.compute_seconds / fp32.predicted.compute_seconds
    assert ratio == pytest.approx(flops_only.cpu_utilisation / flops_only.cpu_bf16_utilisation)
    assert 7 < ratio < 9


def test_a_bf16_compute_copy_is_planned_at_its_own_measured_speed():
    autocast = planner("1xH200:1", job(compile={"enable": True}))
    copy = planner("1xH200:1", job(compile={"enable": True}, train={"bf16_weights": True}))
    assert autocast.compute == ComputeModel.compiled() and copy.compute == ComputeModel.compiled(bf16_weights=True)
    assert copy.plan().predicted.compute_seconds < autocast.plan().predicted.compute_seconds


def test_a_llama_shape_is_planned_slower_per_flop_than_a_gpt_of_its_width():
    """Measured on one H200 (benchmarks/RESULTS.md, the plan check, 2026-12-04): the Llama-3.2-1B shape's
    step took 1.14x the GPT 1.3B's time per counted FLOP. Both are 2048 wide; its 128 K vocabulary's loss
    and embedding gradient, and an optimizer step over as many parameters for half the tokens, are
    memory traffic a FLOP count does not see."""
    def seconds_per_flop(model: dict, micro_batch: int) -> float:
        config = JobConfig.from_dict({"name": "t", "model": model, "cluster": {"use_gpu": True},
                                      "compile": {"enable": True}, "placement": {"max_gpus": 1},
                                      "train": {"global_batch_size": micro_batch, "micro_batch_size": micro_batch}})
        plan = planner("1xH200:1", config).plan()
        # One worker: its own figure is the whole step's compute, optimizer included.
        assert plan.workers[0].predicted_compute_seconds == pytest.approx(plan.predicted.compute_seconds)
        flops_per_token = model_facts(make_workload(config.model), config.model.seq_len).flops_per_token
        return plan.predicted.compute_seconds / (flops_per_token * plan.tokens_per_step)

    gpt = seconds_per_flop({"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "vocab_size": 50304}, 8)
    llama = seconds_per_flop({"preset": "llama3-1b", "seq_len": 2048}, 4)
    assert 1.08 < llama / gpt < 1.2


def test_heterogeneous_split_sums_to_the_global_batch_in_proportion_to_speed():
    config = job(placement={"min_gpus": 16}, train={"global_batch_size": 512, "micro_batch_size": 64})
    plan = planner("8xH100-SXM:1,8xL40S:1", config, compute=NO_OVERHEAD).plan()
    sizes = {w.device_model: w.micro_batch_size for w in plan.workers}
    assert sum(w.micro_batch_size for w in plan.workers) * plan.grad_accum_steps == 512
    assert plan.batch_layout().global_batch == 512
    speed_ratio = 989.4 / 362.05
    assert sizes["H100-SXM5-80GB"] / sizes["L40S"] == pytest.approx(speed_ratio, rel=0.15)
    times = [w.predicted_compute_seconds for w in plan.workers]
    assert max(times) / min(times) < 1.15  # they finish together, up to one sample's rounding


def test_tensor_parallel_groups_stay_inside_one_nvlink_island():
    plan = planner("8xH100-SXM:2,8xL40S:1", job(placement={"tensor_parallel_size": 4})).plan()
    assert plan.tensor_parallel_size == 4 and plan.world_size % 4 == 0
    for group in plan.tensor_parallel_groups:
        members = [plan.workers[r] for r in group]
        assert len({w.island_id for w in members}) == 1
        assert all(w.device_kind == DeviceKind.GPU and w.device_model == "H100-SXM5-80GB" for w in members)
        assert len({w.micro_batch_size for w in members}) == 1
    for group in plan.intra_island_groups:
        assert len({plan.workers[r].island_id for r in group}) == 1


def test_mig_slices_are_never_in_a_tensor_parallel_group():
    with pytest.raises(PlacementError, match="needs an NVLink island of 2 whole GPUs; there are none"):
        planner("1xH100-MIG7:2", job(placement={"tensor_parallel_size": 2})).plan()
    plan = planner("8xH100-SXM:1,1xH100-MIG7:1", job(placement={"tensor_parallel_size": 2, "min_gpus": 8})).plan()
    assert all(w.device_kind == DeviceKind.GPU for w in plan.workers)


def test_slices_of_one_gpu_reduce_through_gloo():
    plan = planner("1xH100-MIG7:1", job(placement={"min_gpus": 2})).plan()
    assert all(w.device_kind == DeviceKind.MIG and w.island_id is None for w in plan.workers)
    assert plan.backend == "gloo" and any("NCCL runs one rank per GPU" in note for note in plan.notes)


def test_cheapest_may_use_fewer_devices_than_fastest():
    config = job(train={"global_batch_size": 512, "micro_batch_size": 64})
    fastest = planner("4xL4:4", config, compute=NO_OVERHEAD).plan()
    cheapest = planner("4xL4:4", dataclasses.replace(config, placement=dataclasses.replace(
        config.placement, objective="cheapest")), compute=NO_OVERHEAD).plan()
    assert cheapest.world_size < fastest.world_size
    assert cheapest.predicted.dollars_per_million_tokens <= fastest.predicted.dollars_per_million_tokens
    assert fastest.predicted.step_seconds <= cheapest.predicted.step_seconds


@pytest.mark.parametrize("cluster", ["8xH100-SXM:1,4xL4:1", "4xA100-PCIE-bridged:1,1xA10G:4", "1xH200:2,1xH100-MIG7:1"])
@pytest.mark.parametrize("objective", ["fastest", "cheapest"])
def test_the_search_is_within_five_percent_of_the_exhaustive_optimum(cluster, objective):
    p = planner(cluster, job(placement={"objective": objective}, train={"global_batch_size": 256}))
    found, best = p.search(p.costing), p.exhaustive(p.costing)
    assert found.score[0] <= best.score[0] * 1.05


def test_the_naive_plan_packs_in_node_order_with_one_micro_batch():
    p = planner("8xL40S:1,8xH100-SXM:1", job(placement={"max_gpus": 8}, train={"global_batch_size": 256}),
                compute=NO_OVERHEAD)
    plan = p.plan()
    naive = p.naive(plan.world_size)
    assert {w.device_model for w in plan.workers} == {"H100-SXM5-80GB"}
    assert {w.device_model for w in naive.workers} == {"L40S"} and naive.world_size == plan.world_size
    assert len({w.micro_batch_size for w in naive.workers}) == 1
    assert naive.predicted.step_seconds > plan.predicted.step_seconds


def test_a_planned_plan_round_trips_through_json(tmp_path):
    plan = planner("8xH100-SXM:2", job(placement={"min_gpus": 16})).plan()
    assert plan.intra_island_groups == [list(range(8)), list(range(8, 16))]
    assert plan.inter_island_groups == [[k, 8 + k] for k in range(8)]
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan


# ---- what does not fit says why, and what would --------------------------------------------------
def shrunk(cluster: str, memory_bytes: int) -> ClusterTopology:
    topology = machines.cluster(cluster)
    for node in topology.nodes:
        for gpu in node.gpus:
            gpu.memory_bytes = memory_bytes
    return ClusterTopology(nodes=topology.nodes)


def test_a_model_too_large_for_ddp_is_told_about_fsdp():
    config = job()
    profile = memory.profile(config)
    ddp = profile.peak_bytes(1, data_parallel="ddp", world_size=2)
    fsdp = profile.peak_bytes(1, data_parallel="fsdp", world_size=4)
    assert fsdp < ddp
    usable = (ddp + fsdp) // 2
    capacity = int((usable + memory.RUNTIME_RESERVE_BYTES["cuda"]) / (1 - memory.ALLOCATOR_SLACK)) + 1
    with pytest.raises(PlacementError) as refused:
        planner(shrunk("4xL4:1", capacity), config).plan()
    message = str(refused.value)
    assert "does not fit" in message and 'set [parallel] strategy = "fsdp" (fits from' in message
    plan = planner(shrunk("4xL4:1", capacity), job(parallel={"strategy": "fsdp"})).plan()
    assert plan.data_parallel == DataParallel.FSDP and plan.world_size >= 2


@pytest.mark.parametrize("cluster, config, where, message", [
    ("8xH100-SXM:2", job(placement={"min_gpus": 20}), "[placement] min_gpus",
     "asks for 20 workers; the cluster has 16 usable GPUs"),
    ("8xH100-SXM:1", job(model={"n_head": 16}, placement={"tensor_parallel_size": 16}), "[placement] tensor_parallel_size",
     "the largest has 8 GPUs"),
    ("8xH100-SXM:2", job(placement={"min_gpus": 16}, train={"global_batch_size": 8, "micro_batch_size": 1}),
     "[train] global_batch_size", "16 workers but a global batch of 8"),
    ("8xH100-SXM:1", job(placement={"objective": "cheapest_under_deadline", "deadline_hours": 1e-9}),
     "[placement] deadline_hours", "no plan finishes 1000 steps within"),
])
def test_refusals_name_the_constraint_and_the_fix(cluster, config, where, message):
    with pytest.raises(PlacementError) as refused:
        planner(cluster, config).plan()
    assert refused.value.where == where and message in refused.value.what and refused.value.fix


def unpriced(cluster: str) -> ClusterTopology:
    topology = machines.cluster(cluster)
    for node in topology.nodes:
        for gpu in node.gpus:
            gpu.model = "B300-SXM6-288GB"
    return ClusterTopology(nodes=topology.nodes)


@pytest.mark.parametrize("cluster, config, where", [
    (laptop(), job(), "topology"),
    ("8xL40S:1", job(placement={"tensor_parallel_size": 2}), "[placement] tensor_parallel_size"),
    ("8xH100-SXM:2", job(placement={"min_gpus": 20}), "[placement] min_gpus"),
    ("8xH100-SXM:2", job(placement={"min_gpus": 16}, train={"global_batch_size": 8, "micro_batch_size": 1}),
     "[train] global_batch_size"),
    (unpriced("1xH200:1"), job(placement={"objective": "cheapest"}), "[placement] prices"),
])
def test_refusals_that_need_no_memory_profile_come_before_it(monkeypatch, cluster, config, where):
    def no_profile(*args, **kwargs):
        raise AssertionError("profiled the model's memory for a job the cluster cannot hold")
    monkeypatch.setattr("planning.planner.profile", no_profile)
    with pytest.raises(PlacementError) as refused:
        planner(cluster, config)
    assert refused.value.where == where


def test_more_cpu_workers_than_cores():
    config = job(cluster={"use_gpu": False, "num_workers": 4, "cpus_per_worker": 1})
    with pytest.raises(PlacementError, match=r"\[cluster\] num_workers: asks for 4 workers; the cluster has 2"):
        Planner(laptop(), config, exact_memory=False).plan()


def test_an_optimistic_memory_profile_is_caught_by_the_exact_check():
    config = job()
    honest = memory.profile(config)
    one = honest.points[0]
    # A profile claiming every micro-batch costs what one sample does.
    optimistic = dataclasses.replace(honest, points=tuple(dataclasses.replace(
        one, micro_batch_size=p.micro_batch_size) for p in honest.points))
    usable = (honest.peak_bytes(4, accumulating=True, exact=True) +
              honest.peak_bytes(5, accumulating=True, exact=True)) // 2
    capacity = int((usable + memory.RUNTIME_RESERVE_BYTES["cuda"]) / (1 - memory.ALLOCATOR_SLACK)) + 1
    plan = Planner(shrunk("1xH200:1", capacity), config, memory=optimistic).plan()
    assert plan.workers[0].micro_batch_size == 4 and plan.grad_accum_steps == 16
    assert plan.workers[0].predicted_peak_memory_bytes <= usable


def test_bf16_weights_gradients_are_planned_at_half_the_bytes():
    """Two nodes over the network, 50M parameters: the all-reduce's bandwidth time halves; its latency does not."""
    wide = {**TINY_MODEL, "n_embd": 1024, "n_head": 8}
    fp32 = planner("8xH200:2", job(model=wide, placement={"min_gpus": 16})).plan()
    half = planner("8xH200:2", job(model=wide, placement={"min_gpus": 16},
                                   train={"bf16_weights": True, "precision": "bf16"})).plan()
    assert half.world_size == fp32.world_size == 16
    ratio = half.predicted.communication_seconds / fp32.predicted.communication_seconds
    assert 0.5 <= ratio < 0.65  # 0.56 at this size


def test_a_measured_calibration_file_replaces_the_link_table(tmp_path):
    # The two-H200 sweep (benchmarks/multigpu.py): NVSwitch at 323 GB/s bus bandwidth, not 0.85 × nominal.
    table = tmp_path / "calibration.json"
    table.write_text('{"nvswitch": {"alpha_us": 30.14, "bus_gb_per_s": 323.1}}')
    default = planner("8xH200:1", job(placement={"min_gpus": 8})).plan()
    measured = planner("8xH200:1", job(placement={"min_gpus": 8, "calibration_file": str(table)})).plan()
    assert measured.world_size == default.world_size == 8
    # Bandwidth time scales with 1 / bus bandwidth: 450 × 0.85 GB/s by default against 323.1 measured.
    ratio = measured.predicted.communication_seconds / default.predicted.communication_seconds
    assert ratio > 1.05
    with pytest.raises(ConfigError, match="calibration"):
        planner("8xH200:1", job(placement={"calibration_file": str(tmp_path / "missing.json")})).plan()


def test_the_plan_notes_say_what_becomes_of_the_next_forward_overlap():
    overlap = {"parallel": {"overlap": "next_forward"}, "train": {"grad_clip": 0.0}}
    alone = planner("1xH200:1", job(**overlap)).plan()
    assert alone.world_size == 1 and any("is ignored: one data-parallel worker" in note for note in alone.notes)
    pair = planner("8xH100-SXM:1", job(**overlap, placement={"min_gpus": 2})).plan()
    assert pair.world_size >= 2 and any("is not costed: the prediction is plain DDP's" in note for note in pair.notes)
    plain = planner("8xH100-SXM:1", job(placement={"min_gpus": 2})).plan()
    assert not any("overlap" in note for note in plain.notes)
