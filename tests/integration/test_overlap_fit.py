"""fit() with the next-forward overlap on two gloo workers: the run's losses, validation and
checkpoints are plain DDP's, though each step's update lands in the next step's forward (the loop
settles it before metrics, validation and checkpoints)."""

import pytest

from orchestrator import Orchestrator
from tests.integration.conftest import SEQ_LEN, job

pytestmark = pytest.mark.integration

STEPS = 7


def rows_by_step(result, key):
    return {r["step"]: r[key] for r in result.metrics if key in r}


def test_fit_with_the_overlap_trains_as_plain_ddp(cluster, small_dataset, tmp_path):
    # Checkpoints at steps 2, 4 and 6 fall between the metrics windows' ends (3, 6, 7): each must settle too.
    common = dict(train={"grad_clip": 0.0, "log_every": 3, "eval_every": 3}, checkpoint={"every_steps": 2})
    plain = Orchestrator(job(small_dataset, tmp_path, "plain", STEPS, parallel={"bucket_mb": 0.01}, **common)).fit()
    overlapped = Orchestrator(job(small_dataset, tmp_path, "overlap", STEPS,
                                  parallel={"bucket_mb": 0.01, "overlap": "next_forward",
                                            "overlap_backward_share": 0.3}, **common)).fit()
    assert rows_by_step(overlapped, "loss") == rows_by_step(plain, "loss")  # bit for bit, every step
    assert rows_by_step(overlapped, "val_loss") == rows_by_step(plain, "val_loss")
    assert sorted(rows_by_step(overlapped, "val_loss")) == [3, 6, 7]
    for step, norm in rows_by_step(plain, "grad_norm").items():
        assert rows_by_step(overlapped, "grad_norm")[step] == pytest.approx(norm, rel=1e-5)
    # The forward of the last step waited for the wire (a gloo wait takes some time) and not longer
    # than the step took: seconds, not milliseconds.
    step_seconds = 8 * SEQ_LEN / rows_by_step(overlapped, "tokens_per_s")[STEPS]
    assert 0 < rows_by_step(overlapped, "exposed_comm_s")[STEPS] < step_seconds
    assert overlapped.checkpoint.name == f"step_{STEPS:08d}"
