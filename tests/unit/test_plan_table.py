"""The printed plan (planning/plan_table.py): its tables fit the terminal with whole cells, and say what they left out."""

import pytest
from rich.console import Console

from core.config import JobConfig
from planning.plan_table import print_plan, significant
from planning.planner import Planner
from topology import machines


@pytest.fixture(scope="module")
def plan():
    """Sixteen H100s on two nodes, so each worker has a UUID and NCCL NICs to show."""
    config = JobConfig.from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64},
                                  "cluster": {"use_gpu": True}, "placement": {"min_gpus": 16},
                                  "train": {"global_batch_size": 64, "micro_batch_size": 8}})
    return Planner(machines.cluster("8xH100-SXM:2"), config, exact_memory=False).plan()


def printed(plan, width: int) -> str:
    console = Console(record=True, width=width)
    print_plan(plan, None, console)
    return console.export_text()


def test_at_80_columns_every_header_and_device_is_whole_and_dropped_columns_are_named(plan):
    text = printed(plan, 80)
    assert "…" not in text, text
    header = next(line for line in text.splitlines() if "island or node" in line)
    assert header.split()[:1] == ["rank"] and "micro-batch" in header and "peak GiB" in header, header
    assert "share of samples" in text and "H100-SXM5-80GB" in text
    assert "(device UUID, NCCL NICs left out at 80 columns" in text, text


def test_on_a_wide_terminal_every_uuid_is_whole(plan):
    text = printed(plan, 250)
    assert all(w.device_uuid in text for w in plan.workers), text
    assert "left out" not in text


def test_small_predictions_keep_three_significant_figures(plan):
    """A tiny model's job is hours' and dollars' hundredths: two decimals printed it as 0.00."""
    text = printed(plan, 250)
    predicted = plan.predicted
    for label, value in (("job hours", predicted.job_hours), ("job $", predicted.job_dollars),
                         ("$/M tokens", predicted.dollars_per_million_tokens)):
        assert 0 < value < 0.005, (label, value)
        row = next(line for line in text.splitlines() if line.startswith(label))
        assert row.removeprefix(label).split()[0] == significant(value) != "0.00", row
    assert (significant(0.001834), significant(7.0), significant(1234.5)) == ("0.00183", "7.00", "1,234.50")
