"""The live bill: MFU, dollars, device-hours and tokens per dollar against hand-computed cases;
rewinds; convergence cost (interpolated and projected)."""

import dataclasses
from dataclasses import replace

import pytest

from core.plan import DeviceKind, Plan, Prediction
from orchestrator.accounting.bill import BillMeter, Rates, cost_to_reach, mfu, trajectory

FLOPS_PER_TOKEN = 744e6  # 6 × 124 M parameters


def plan(device_model: str = "H100-SXM5-80GB", *, dollars_per_hour: float = 5.98, step_s: float = 0.4,
         world: int = 2, kind: DeviceKind = DeviceKind.GPU) -> Plan:
    """world × device_model, 32 samples of 1,024 tokens per step (32,768 tokens)."""
    base = Plan.uniform(job_name="bill", world_size=world, micro_batch_size=16 // world * 2, grad_accum_steps=1,
                        seq_len=1024)
    workers = [replace(w, device_kind=kind, device_model=device_model,
                       device_uuid=None if kind == DeviceKind.CPU else f"GPU-{w.rank}") for w in base.workers]
    predicted = Prediction(step_seconds=step_s, compute_seconds=step_s * 0.9,
                           exposed_communication_seconds=step_s * 0.1,
                           communication_seconds=step_s * 0.3, tokens_per_second=32768 / step_s,
                           dollars_per_hour=dollars_per_hour, dollars_per_step=dollars_per_hour * step_s / 3600,
                           dollars_per_million_tokens=0.0, job_hours=0.0, job_dollars=0.0)
    return replace(base, workers=workers, predicted=predicted)


START = {"event": "start", "step": 0, "world_size": 2, "device": "cuda:0", "params": 124_000_000, "precision": "bf16",
         "flops_per_token": FLOPS_PER_TOKEN}


def steps(first: int, last: int, tokens_per_s: float = 65536.0, **last_row) -> list[dict]:
    rows = [{"step": s, "loss": 3.0, "tokens_per_s": tokens_per_s} for s in range(first, last + 1)]
    rows[-1].update({"consumed_samples": 32 * last, **last_row})
    return rows


def test_mfu_is_model_flops_over_the_peak_of_the_devices_used():
    # 744e6 FLOPs/token × 65,536 tokens/s = 4.876e13 FLOP/s on 2 × 989.4 TFLOP/s = 1,978.8 TFLOP/s.
    assert mfu(FLOPS_PER_TOKEN, 65536, 1978.8) == pytest.approx(0.024640, rel=1e-4)
    assert mfu(0, 65536, 1978.8) is None and mfu(FLOPS_PER_TOKEN, 65536, 0.0) is None
    rates = Rates.from_plan(plan())
    assert rates.peak_tflops["bf16"] == pytest.approx(1978.8) and rates.peak_tflops["fp8"] == pytest.approx(3957.8)
    # A MIG slice of 3 of 7 compute slices has 3/7 of the GPU's peak: 989.4 × 3/7 = 424.03.
    mig = Rates.from_plan(plan("H100-SXM5-80GB 3g.40gb", world=1, kind=DeviceKind.MIG))
    assert mig.peak_tflops["bf16"] == pytest.approx(424.0286, rel=1e-6)
    # CPU workers: the nominal 0.1 TFLOP/s per core, flagged as nominal.
    cpu = Rates.from_plan(plan("cpu", kind=DeviceKind.CPU))
    assert cpu.peak_tflops["fp32"] == pytest.approx(0.2) and cpu.nominal_peak
    assert Rates.from_plan(plan("B300-made-up")).peak_tflops == {}


def test_dollars_device_hours_and_tokens_per_dollar_by_hand():
    meter = BillMeter(Rates.from_plan(plan()))
    # Two steps arrive 10 s after launch; each took 32,768 / 65,536 = 0.5 s, so step 1 ended at 9.5 s.
    first, second = meter.observe([START, *steps(1, 2)], now=10.0)
    assert (first["elapsed_s"], second["elapsed_s"]) == (9.5, 10.0)
    assert first["step_s"] == second["step_s"] == 0.5
    assert first["dollars"] == pytest.approx(5.98 * 9.5 / 3600)                 # $0.015781
    assert second["dollars"] == pytest.approx(0.0166111, rel=1e-5)              # 5.98 $/h × 10 s
    assert second["dollars_per_step"] == pytest.approx(5.98 * 0.5 / 3600)
    assert second["device_hours"] == pytest.approx(2 * 10 / 3600)
    assert second["bf16_tflops_hours"] == pytest.approx(1978.8 * 10 / 3600)     # 5.4967
    assert second["tokens"] == 64 * 1024                                        # consumed samples × seq_len
    assert second["tokens_per_dollar"] == pytest.approx(65536 / 0.0166111, rel=1e-5)  # 3.945 M
    assert second["mfu"] == pytest.approx(0.024640, rel=1e-4)
    assert second["predicted_step_s"] == 0.4
    # Wall time between deliveries is billed whether or not steps ran in it (validation, checkpoints).
    (third,) = meter.observe(steps(3, 3), now=70.0)
    assert third["dollars"] == pytest.approx(5.98 * 70 / 3600)


def test_window_extras_become_shares_of_the_step():
    meter = BillMeter(Rates.from_plan(plan()))
    row = meter.observe([START, *steps(1, 1, exposed_comm_s=0.1, data_wait_s=0.05, skipped_steps=2,
                                       compile={"recompilations": 1})], now=1.0)[0]
    assert row["window_end"] and row["exposed_comm_share"] == pytest.approx(0.2) and row["data_wait_share"] == 0.1
    assert row["skipped_steps"] == 2 and row["recompilations"] == 1


def test_a_smaller_worker_group_pays_and_peaks_in_proportion():
    meter = BillMeter(Rates.from_plan(plan()))
    meter.observe([START, *steps(1, 1)], now=3600.0)  # one hour on both workers: $5.98
    shrunk = {**START, "step": 1, "world_size": 1}
    (row,) = meter.observe([shrunk, *steps(2, 2)], now=7200.0)  # one more hour on one worker: $2.99
    assert row["dollars"] == pytest.approx(5.98 + 2.99)
    assert row["device_hours"] == pytest.approx(3.0)
    assert row["mfu"] == pytest.approx(2 * 0.024640, rel=1e-4)  # the same tokens/s on half the peak


def test_a_resumed_run_carries_the_dollars_and_the_clock():
    carried = {"step": 8, "elapsed_s": 100.0, "dollars": 1.0, "device_hours": 0.5, "bf16_tflops_hours": 2.0,
               "tokens": 8 * 32768}
    meter = BillMeter(Rates.from_plan(plan()), carried=carried)
    (row,) = meter.observe([START, *steps(9, 9)], now=36.0)
    assert row["elapsed_s"] == 136.0 and row["dollars"] == pytest.approx(1.0 + 5.98 * 36 / 3600)
    assert row["device_hours"] == pytest.approx(0.5 + 2 * 36 / 3600)


def test_a_group_started_from_a_checkpoint_counts_tokens_from_it():
    """Resumed from step 40 after an earlier invocation billed to step 55: step 41 has trained 41 steps'
    tokens, not 56 (the meter carried 55's until the next log window corrected it)."""
    carried = {"step": 55, "elapsed_s": 100.0, "dollars": 1.0, "tokens": 55 * 32768}
    meter = BillMeter(Rates.from_plan(plan()), carried=carried)
    inside_a_window = {"step": 41, "loss": 3.0, "tokens_per_s": 65536.0}  # no consumed_samples: not a window's end
    (row,) = meter.observe([{**START, "step": 40, "consumed_samples": 40 * 32}, inside_a_window], now=10.0)
    assert row["tokens"] == 41 * 32768
    assert row["tokens_per_dollar"] == pytest.approx(41 * 32768 / row["dollars"])


def test_without_a_clock_each_step_takes_its_measured_time():
    rows = BillMeter(Rates.from_plan(plan())).observe([START, *steps(1, 4)])
    assert [r["elapsed_s"] for r in rows] == [0.5, 1.0, 1.5, 2.0]


def test_trajectory_replaces_redone_steps_and_keeps_their_dollars():
    rows = [{"step": s, "dollars": d} for s, d in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 4.0), (3, 5.0), (4, 6.0)]]
    assert [(r["step"], r["dollars"]) for r in trajectory(rows)] == [(1, 1.0), (2, 4.0), (3, 5.0), (4, 6.0)]


def evals(*points: tuple[float, float]) -> list[dict]:
    """Bill rows with validation losses at (dollars, loss); steps, device-hours and tokens follow dollars."""
    return [{"step": 100 * (i + 1), "val_loss": loss, "dollars": d, "device_hours": 2 * d, "tokens": 1000 * d,
             "loss": loss} for i, (d, loss) in enumerate(points)]


def test_cost_to_reach_interpolates_between_the_bracketing_evaluations():
    rows = evals((1.0, 4.0), (3.0, 2.0))
    early, middle = cost_to_reach(rows, [3.0, 5.0])  # easiest (highest loss) first
    assert (early.target, early.reached, early.dollars, early.step) == (5.0, True, 1.0, 100)  # at the first eval
    # 3.0 is half way from 4.0 to 2.0: half way from $1 to $3, step 100 to 200.
    assert (middle.target, middle.reached) == (3.0, True)
    assert (middle.dollars, middle.device_hours, middle.tokens, middle.step) == (2.0, 4.0, 2000.0, 150.0)


def test_the_next_target_is_projected_from_a_power_law_in_dollars():
    rows = evals((1.0, 4.0), (3 ** 0.5, 2 * 2 ** 0.5), (3.0, 2.0))
    # loss = 4 · d^b with 4 → 2 as $1 → $3: b = ln(1/2) / ln 3; loss 1 needs two halvings: $9.
    next_one, later = cost_to_reach(rows, [1.0, 0.5])
    assert next_one.projected and not next_one.reached and next_one.dollars == pytest.approx(9.0)
    assert next_one.step == pytest.approx(900.0)  # 100 steps per $1 between the fitted evaluations
    assert later.dollars is None and not later.projected  # only the next target is projected
    flat = cost_to_reach(evals((1.0, 3.0), (2.0, 3.1), (3.0, 3.2)), [2.0])[0]
    assert flat.dollars is None  # a loss that is not falling projects nothing


def test_a_projection_never_lands_before_the_evaluation_that_missed_the_target():
    """The last evaluation sits above the fitted line: the fit alone would place 2.9 before it (step 29 of
    a run whose step 30 measured 2.935). The slope is drawn through that last evaluation instead."""
    rows = evals((0.9103, 4.1177), (0.9809, 3.1287), (1.0374, 2.9350))
    (cost,) = cost_to_reach(rows, [2.9])
    assert cost.projected and cost.dollars > 1.0374 and cost.step > 300
    slope = -2.6496  # the least-squares slope of these three in log-log
    assert cost.dollars == pytest.approx(1.0374 * (2.9 / 2.935) ** (1 / slope), rel=1e-3)


def test_a_projection_past_a_hundred_times_the_dollars_spent_is_not_made():
    # loss = 4 · d^b falling by 1 % from $1 to $2: 2.0 would need 2^(ln 2 / ln(4 / 3.96)) ≈ $2^69.
    (cost,) = cost_to_reach(evals((1.0, 4.0), (1.5, 3.977), (2.0, 3.96)), [2.0])
    assert cost.dollars is None and not cost.projected


def test_two_evaluations_project_nothing():
    (cost,) = cost_to_reach(evals((1.0, 4.0), (3.0, 2.0)), [1.0])
    assert cost.dollars is None and not cost.projected
    # A rewind: the redone evaluation replaces the lost one.
    redone = [*evals((1.0, 4.0), (3.0, 3.5)), {**evals((4.0, 2.0))[0], "step": 200}]
    assert cost_to_reach(redone, [3.0])[0].dollars == pytest.approx(1.0 + 3.0 * 0.5)


def test_a_mig_slice_counts_its_share_of_gpu_hours():
    meter = BillMeter(Rates.from_plan(plan("H100-SXM5-80GB 1g.10gb", world=2, kind=DeviceKind.MIG,
                                           dollars_per_hour=2 * 2.99 / 7)))
    (_, row) = meter.observe([START, *steps(1, 2)], now=3600.0)
    assert row["device_hours"] == pytest.approx(2 / 7)  # two 1/7 slices for an hour
    assert row["dollars"] == pytest.approx(2 * 2.99 / 7)


def test_a_replan_onto_other_devices_bills_their_price_from_then_on():
    meter = BillMeter(Rates.from_plan(plan()))  # 2 × H100 at $5.98/h together
    meter.observe([START, *steps(1, 1)], now=3600.0)
    # The job shrinks onto one A100 ($1.50/h); its rates arrive with the re-plan event, before the start.
    a100 = Rates.from_plan(plan("A100-SXM4-80GB", dollars_per_hour=1.50, world=1))
    replan = {"event": "replan", "world_size": 1, "rates": dataclasses.asdict(a100)}
    (row,) = meter.observe([replan, {**START, "step": 1, "world_size": 1}, *steps(2, 2)], now=7200.0)
    assert row["dollars"] == pytest.approx(5.98 + 1.50)  # not 5.98 / 2 for "half the H100s"
    assert row["device_hours"] == pytest.approx(2 + 1)
    assert row["mfu"] == pytest.approx(FLOPS_PER_TOKEN * 65536 / 312e12, rel=1e-3)  # A100 dense bf16 peak
    assert row["world_size"] == 1


def test_steps_at_a_changed_batch_are_billed_for_their_own_tokens():
    """An adaptive run doubles the plan's 32 samples: at the same 65,536 tokens/s each step of 64 × 1,024
    tokens took 1.0 s, not the plan's 0.5 s, and the bill row names the batch and its noise scale."""
    rows = [{"step": 1, "loss": 3.0, "tokens_per_s": 65536.0, "global_batch": 32, "noise_scale": None},
            {"step": 2, "loss": 3.0, "tokens_per_s": 65536.0, "global_batch": 64, "noise_scale": 91.5},
            {"step": 3, "loss": 3.0, "tokens_per_s": 65536.0, "global_batch": 64, "noise_scale": 97.0}]
    billed = BillMeter(Rates.from_plan(plan())).observe([START, *rows])
    assert [r["step_s"] for r in billed] == [0.5, 1.0, 1.0]
    assert [r["elapsed_s"] for r in billed] == [0.5, 1.5, 2.5]
    assert [r["tokens"] for r in billed] == [32 * 1024, 96 * 1024, 160 * 1024]
    assert billed[-1]["dollars"] == pytest.approx(5.98 * 2.5 / 3600)
    assert [(r["global_batch"], r["noise_scale"]) for r in billed] == [(32, None), (64, 91.5), (64, 97.0)]
