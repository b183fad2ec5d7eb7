"""`archipelago plan`: the table beside the naive plan, --json, --png, and one-line errors."""

import json

import pytest

from core.plan import Plan
from orchestrator.cli import main

JOB = """
name = "tiny-gpu"
[model]
n_layer = 4
n_head = 4
n_embd = 128
seq_len = 128
[train]
global_batch_size = 64
micro_batch_size = 16
[cluster]
use_gpu = true
"""


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return str(path)


def test_plan_prints_the_table_beside_the_naive_plan_and_saves_it(capsys, tmp_path, job_file):
    code, out = run(capsys, "plan", "--generate", "8xL40S:1,8xH100-SXM:1", "--config", job_file,
                    "--json", str(tmp_path / "plan.json"), "--png", str(tmp_path / "plan.png"))
    assert code == 0, out
    assert "plan 'tiny-gpu' (fastest)" in out and "naive (Ray PACK, uniform)" in out and "naive / planned" in out
    assert "$/M tokens" in out and "exposed comm s" in out
    plan = Plan.load(tmp_path / "plan.json")
    sizes = plan.replica_micro_batch_sizes()
    stated = f"global batch {plan.global_batch_size} = ({' + '.join(map(str, sizes))}) × {plan.grad_accum_steps} accumulation"
    assert stated in out.replace("\n", " ") and sum(sizes) * plan.grad_accum_steps == plan.global_batch_size
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "archipelago.plan"
    assert plan.job_name == "tiny-gpu" and plan.uses_gpus
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_reads_a_topology_file(capsys, job_file, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run(capsys, "plan", "--topology", "examples/topologies/h200-single.json", "--config", job_file)
    assert code == 0, out
    assert "H200-SXM5-141GB" in out and "GPU-be34df87-2cb1-b3bd-0e56-01eb59effb51" in out and "1 worker," in out


def test_a_placement_error_is_one_line_and_exit_2(capsys, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB + "[placement]\ntensor_parallel_size = 2\n")
    code, out = run(capsys, "plan", "--topology", "examples/topologies/h200-single.json", "--config", str(path))
    assert code == 2 and "Traceback" not in out
    assert f"error: {path}: [placement] tensor_parallel_size: tensor_parallel_size 2 needs an NVLink island" in out


def test_plan_and_fit_refuse_what_the_workers_could_not_run_with_the_same_line(capsys, tmp_path, monkeypatch):
    """The next-forward overlap with fp16's loss scaling: refused by the rules before any Ray call."""
    path = tmp_path / "overlap.toml"
    train = "micro_batch_size = 16\nprecision = \"fp16\"\ngrad_clip = 0.0\n"
    path.write_text(JOB.replace("micro_batch_size = 16\n", train) + '[parallel]\noverlap = "next_forward"\n')
    import ray
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started before the refusal"))
    plan_code, plan_out = run(capsys, "plan", "--generate", "8xH100-SXM:1", "--config", str(path))
    fit_code, fit_out = run(capsys, "fit", str(path))
    assert plan_code == fit_code == 2 and plan_out == fit_out
    assert "[parallel] overlap" in plan_out and "loss scaling" in plan_out and plan_out.count("\n") == 1


def test_a_plan_on_several_gpu_models_prints_each_models_share_and_where_its_figures_come_from(capsys, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "job.toml"
    path.write_text(JOB.replace("global_batch_size = 64", "global_batch_size = 256")
                    + '[placement]\nmin_gpus = 16\n[devices."L40S"]\nbf16_tflops = 300.0\nmemory_gib = 45.0\nprice = 1.0\n')
    code, out = run(capsys, "plan", "--generate", "8xL40S:1,8xH100-SXM:1", "--config", str(path), "--json",
                    str(tmp_path / "plan.json"))
    assert code == 0, out
    plan = Plan.load(tmp_path / "plan.json")
    rows = {}
    for model, source in (("H100-SXM5-80GB", "catalog"), ("L40S", "declared")):
        workers = [w for w in plan.workers if w.device_model == model]
        share = sum(w.micro_batch_size for w in workers) * plan.grad_accum_steps / plan.global_batch_size
        line = next(line for line in out.splitlines() if line.strip().startswith(model) and source in line)
        rows[model] = line.split()
        assert rows[model][1:3] == [str(len(workers)), source] and rows[model][5] == f"{share:.1%}"
    assert rows["L40S"][3] == "300" and rows["H100-SXM5-80GB"][3] == "989.4"
    assert float(rows["L40S"][5][:-1]) + float(rows["H100-SXM5-80GB"][5][:-1]) == pytest.approx(100, abs=0.11)


def test_without_enough_whole_gpus_for_ray_pack_the_naive_plan_says_so_not_that_no_micro_batch_fits(capsys, tmp_path):
    """Ray's PACK order takes whole GPUs; the plan's two workers include a MIG slice, and there is one whole GPU."""
    path = tmp_path / "job.toml"
    path.write_text(JOB + "[placement]\nmin_gpus = 2\n")
    code, out = run(capsys, "plan", "--generate", "1xH100-MIG7:1,1xH200:1", "--config", str(path))
    assert code == 0, out
    assert "naive plan: Ray's PACK order takes whole GPUs only, and the cluster has 1 for the plan's 2 workers" in \
        out.replace("\n", " ").replace("  ", " "), out
    assert "no single micro-batch" not in out
