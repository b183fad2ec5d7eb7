"""The calibration file: link rows and compute efficiency per device model, where it is read from, and
what a bad one says."""

from __future__ import annotations

import json

import pytest

from core.config import JobConfig
from core.errors import ConfigError
from planning.calibration import Calibration
from planning.collectives import LinkCalibration, LinkClass
from planning.compute import ComputeModel
from planning.planner import Planner
from topology import machines

TINY_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128, "vocab_size": 257}
FLOPS_ONLY = ComputeModel(micro_step_overhead_s_per_layer=0.0)


def job(tmp_path, **placement) -> JobConfig:
    return JobConfig.from_dict({"name": "t", "runs_dir": str(tmp_path / "runs"), "model": TINY_MODEL,
                                "cluster": {"use_gpu": True}, "placement": placement,
                                "train": {"global_batch_size": 64, "micro_batch_size": 16}})


def test_a_calibration_file_round_trips_link_rows_and_compute_efficiency(tmp_path):
    calibration = Calibration(links={LinkClass.NVSWITCH: LinkCalibration(alpha_us=30.14, bus_gb_per_s=323.1)},
                              compute_efficiency={"H200-SXM5-141GB": 1.04, "cpu": 0.93})
    path = calibration.save(tmp_path / "calibration.json")
    loaded = Calibration.load(path)
    assert (loaded.links, loaded.compute_efficiency, loaded.path) == (calibration.links, calibration.compute_efficiency,
                                                                      str(path))
    assert json.loads(path.read_text())["compute_efficiency"] == {"H200-SXM5-141GB": 1.04, "cpu": 0.93}
    # A file benchmarks/multigpu.py wrote, with link rows only, still reads.
    assert Calibration.load("examples/topologies/h200x2-nvswitch.calibration.json").compute_efficiency == {}


@pytest.mark.parametrize("content, where, message", [
    ('{"nvswtich": {"alpha_us": 30.0}}', "", "unknown link class 'nvswtich'"),
    ('{"compute_efficiency": {"cpu": NaN}}', "compute_efficiency.cpu", "nan is not an efficiency"),
    ('{"compute_efficiency": {"cpu": Infinity}}', "compute_efficiency.cpu", "inf is not an efficiency"),
    ('{"compute_efficiency": {"cpu": "1.1"}}', "compute_efficiency.cpu", "'1.1' is not an efficiency"),
    ('{"compute_efficiency": {"cpu": 0}}', "compute_efficiency.cpu", "0 is not an efficiency"),
    ('{"compute_efficiency": {"cpu": 12.0}}', "compute_efficiency.cpu", "12.0 is not an efficiency"),
    ('{"compute_efficiency": [1.1]}', "compute_efficiency", "must be an object of device models"),
    ('{"nvswitch": {"alpha_us": NaN}}', "nvswitch.alpha_us", "alpha_us is nan, not a number"),
])
def test_a_bad_calibration_file_is_a_config_error_naming_the_entry(tmp_path, content, where, message):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as refused:
        Calibration.load(path)
    assert refused.value.where == (f"{path}: {where}" if where else str(path)) and message in refused.value.what


def test_the_planner_runs_each_model_at_its_calibrated_efficiency_and_says_so(tmp_path):
    path = Calibration(compute_efficiency={"H200-SXM5-141GB": 2.0}).save(tmp_path / "fitted.json")
    plain = Planner(machines.cluster("1xH200:1"), job(tmp_path), exact_memory=False, compute=FLOPS_ONLY).plan()
    calibrated = Planner(machines.cluster("1xH200:1"), job(tmp_path), exact_memory=False,
                         calibration=Calibration.load(path)).plan()
    flops_only = Planner(machines.cluster("1xH200:1"), job(tmp_path), exact_memory=False,
                         compute=Calibration.load(path).compute(FLOPS_ONLY)).plan()
    assert flops_only.predicted.compute_seconds == pytest.approx(plain.predicted.compute_seconds / 2)
    assert calibrated.device_bases[0].compute_efficiency == 2.0
    assert f"calibrated by {path}: H200-SXM5-141GB compute ×2" in calibrated.notes


def test_a_plan_notes_the_calibration_only_where_it_changed_a_figure_the_plan_uses(tmp_path):
    """A runs directory calibrated on the CPU demo's runs changes nothing of a GPU plan there: no note."""
    path = Calibration(links={LinkClass.LOOPBACK: LinkCalibration(alpha_us=40.0, bus_gb_per_s=1.5)},
                       compute_efficiency={"cpu": 0.5}).save(tmp_path / "runs" / "calibration.json")
    gpu = Planner(machines.cluster("1xH200:1"), job(tmp_path), exact_memory=False,
                  calibration=Calibration.for_job(job(tmp_path))).plan()
    assert not [note for note in gpu.notes if "calibrated by" in note]
    cpu_job = JobConfig.from_dict({**job(tmp_path).to_dict(),
                                   "cluster": {"use_gpu": False, "num_workers": 2, "cpus_per_worker": 1}})
    cpu = Planner(machines.cluster("1xH200:1"), cpu_job, exact_memory=False, calibration=Calibration.load(path)).plan()
    assert f"calibrated by {path}: links loopback; cpu compute ×0.5" in cpu.notes


def test_fit_and_plan_read_the_runs_directorys_calibration_and_python_callers_only_a_named_one(tmp_path):
    config = job(tmp_path)
    assert Calibration.for_job(config).path == ""
    Calibration(compute_efficiency={"cpu": 0.9}).save(tmp_path / "runs" / "calibration.json")
    assert Calibration.for_job(config).compute_efficiency == {"cpu": 0.9}
    assert Calibration.named_by(config).path == ""  # a planner built in Python (tests) is not changed by ./runs
    named = Calibration(compute_efficiency={"cpu": 1.2}).save(tmp_path / "named.json")
    assert Calibration.for_job(job(tmp_path, calibration_file=str(named))).compute_efficiency == {"cpu": 1.2}
    with pytest.raises(ConfigError, match="cannot read it"):
        Calibration.for_job(job(tmp_path, calibration_file=str(tmp_path / "missing.json")))
