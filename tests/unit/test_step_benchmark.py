"""benchmarks/step.py's judgement of whether a row trained: a step time is only worth printing for one that did."""

import pytest

from tests.benchmark_support import load_benchmark


@pytest.fixture(scope="module")
def step():
    return load_benchmark("step")


def test_a_row_that_diverged_is_flagged_against_the_best_row(step):
    # The 1.3B rows of one call on an H200: the autocast engine's loss fell from 11.3 but ended at 9.99.
    diverged = {"loss_fell": True, "loss_last5": 9.988}
    assert "LOSS FAR ABOVE THE BEST ROW'S (9.988 against 3.045" in step.training_warning(diverged, 3.045)


def test_rows_that_train_on_other_schedules_are_not_flagged(step):
    # 124M over 20 steps: the engine warms its learning rate up, the plain loop does not (4.602 vs 3.805).
    assert step.training_warning({"loss_fell": True, "loss_last5": 4.602}, 3.805) == ""
    assert step.training_warning({}, None) == ""


def test_a_loss_that_did_not_fall_is_flagged_first(step):
    assert "LOSS DID NOT FALL" in step.training_warning({"loss_fell": False, "loss_last5": 3.0}, 3.0)


def test_kernels_fall_into_the_groups_the_profile_prints(step):
    # Names from the Llama-3.2-3B profile on an H200 (2026-12-05): its rotary kernels compute 1/theta^i, and were
    # counted as float8 scaling (4.7 ms a step in bf16 rows) while "reciprocal" alone marked that group.
    rotary = "triton_poi_fused__to_copy_add_arange_cos_div_gt_lt_mul_neg_pow_reciprocal_rsub_select_sin_slice_backward_sub_t"
    assert step.kernel_group(rotary) == "rotary embedding"
    assert step.kernel_group("triton_red_fused_abs_amax_clamp_reciprocal_0") == "float8 scaling"
    assert step.kernel_group("triton_poi_fused_mul_silu_silu_backward_stack_view_4") == "elementwise/fused (Inductor)"
    assert step.kernel_group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
