"""Bad input on the command line: one clear line, a non-zero exit, no traceback."""

import dataclasses
import subprocess
import sys

import pytest

from orchestrator.cli import main
from tests.conftest import tiny_job
from tests.conftest import write_job as write_job_config


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def write_job(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_missing_config_file(capsys, tmp_path):
    code, out = run_cli(capsys, "fit", str(tmp_path / "missing.toml"))
    assert code == 2
    assert "error:" in out and "missing.toml: config file not found" in out
    assert "Traceback" not in out


def test_malformed_toml(capsys, tmp_path):
    code, out = run_cli(capsys, "fit", write_job(tmp_path, "name = \n"))
    assert code == 2 and "malformed TOML" in out and "line 1" in out


def test_unknown_key(capsys, tmp_path):
    code, out = run_cli(capsys, "fit", write_job(tmp_path, "[cluster]\nnum_worker = 2\n"))
    assert code == 2 and "[cluster] num_worker: unknown key" in out and "num_workers" in out


def test_negative_batch_size(capsys, tmp_path):
    code, out = run_cli(capsys, "fit", write_job(tmp_path, "[train]\nglobal_batch_size = -8\n"))
    assert code == 2 and "[train] global_batch_size: must be positive, got -8" in out


def test_empty_corpus_directory(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    job = write_job(tmp_path, f'[data]\npath = "{tmp_path / "data"}"\nprepare_from = "{tmp_path / "empty"}"\n')
    code, out = run_cli(capsys, "fit", job)
    assert code == 2 and "no files matching '*.py'" in out and str(tmp_path / "empty") in out


def test_prepare_into_an_occupied_directory(capsys, tmp_path, corpus_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    code, out = run_cli(capsys, "prepare", "--source", str(corpus_dir), "--out", str(tmp_path / "out"))
    assert code == 2 and "holds no prepared dataset" in out
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


def test_resume_with_a_checkpoint_of_another_model(capsys, tmp_path, dataset_dir):
    # A committed checkpoint of a 2-layer model, then a config for a 1-layer model resuming the run.
    from tests.checkpoint_support import trained
    from tests.engine_support import job_spec
    from workers import checkpoint as checkpoints

    two_layers = tiny_job(dataset_dir, tmp_path / "runs", model={"n_layer": 2})
    checkpoint = tmp_path / "runs" / "tiny" / "step_00000004"
    model, optimizer = trained(0, two_layers)
    checkpoints.save(checkpoint, model, optimizer,
                     checkpoints.CheckpointInfo.for_spec(job_spec(two_layers), 4, 32)).result()
    toml = "\n".join(['name = "tiny"', f'runs_dir = "{tmp_path / "runs"}"',
                      "[model]", "n_layer = 1", "n_head = 2", "n_embd = 32", "seq_len = 32",
                      "[data]", f'path = "{dataset_dir}"'])
    code, out = run_cli(capsys, "fit", write_job(tmp_path, toml), "--resume")
    assert code == 2
    assert "checkpoint is from another model (n_layer: checkpoint 2, config 1)" in out
    assert str(checkpoint) in out.replace("\n", "")


def test_resume_on_other_training_samples_is_refused_before_ray(capsys, tmp_path, dataset_dir):
    """The same tokenizer, other samples (another dataset, or this one prepared again from changed text):
    the sampler's position would point at samples that are not the next ones."""
    from tests.checkpoint_support import trained
    from tests.engine_support import job_spec
    from workers import checkpoint as checkpoints

    config = tiny_job(dataset_dir, tmp_path / "runs")
    spec = job_spec(config)
    elsewhere = dataclasses.replace(spec, data=dataclasses.replace(spec.data, fingerprint="feedfacefeedface"))
    step = tmp_path / "runs" / "tiny" / "step_00000004"
    checkpoints.save(step, *trained(0, config), checkpoints.CheckpointInfo.for_spec(elsewhere, 4, 32)).result()
    code, out = run_cli(capsys, "fit", str(write_job_config(tmp_path / "job.toml", config)), "--resume")
    assert code == 2, out
    assert "checkpoint was trained on other samples (dataset fingerprint feedfacefeedface, the dataset's is " in out
    assert "archipelago export" in out and "plan:" not in out  # refused on the driver: no cluster was planned


def test_resume_without_a_checkpoint(capsys, tmp_path, dataset_dir):
    toml = f'name = "first"\nruns_dir = "{tmp_path / "runs"}"\n[data]\npath = "{dataset_dir}"\n'
    code, out = run_cli(capsys, "fit", write_job(tmp_path, toml), "--resume")
    assert code == 2 and "no committed checkpoint to resume from — run without --resume to start this run" in out
    # A run that stopped before its first checkpoint left files: starting without --resume would be refused.
    (tmp_path / "runs" / "first").mkdir(parents=True)
    (tmp_path / "runs" / "first" / "metrics.jsonl").write_text("{}\n")
    code, out = run_cli(capsys, "fit", write_job(tmp_path, toml), "--resume")
    assert code == 2 and "no committed checkpoint to resume from — run with --overwrite instead of --resume" in out.replace("\n", "")


def test_a_real_process_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "fit", str(tmp_path / "nope.toml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout.strip().count("\n") == 0 and "config file not found" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    from core.errors import ConfigError
    with pytest.raises(ConfigError):
        main(["--debug", "fit", str(tmp_path / "nope.toml")])


def test_an_interrupted_fit_names_its_config_in_the_resume_hint(capsys, tmp_path, monkeypatch, dataset_dir):
    from orchestrator import Orchestrator

    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(Orchestrator, "fit", interrupted)
    job = write_job(tmp_path, f'[data]\npath = "{dataset_dir}"\n')
    code, out = run_cli(capsys, "fit", job)
    assert code == 130 and f"`archipelago fit {job} --resume` continues" in out.replace("\n", "")


def test_an_address_that_answers_but_is_no_ray_head_stops_within_the_connect_timeout(capfd):
    """The kernel completes TCP handshakes on a listening socket that never accepts: the port answers, and
    Ray's join would retry for minutes. The command gives up after --connect-timeout with one line."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:
        started = time.monotonic()
        code = main(["topology", "--address", f"127.0.0.1:{silent.getsockname()[1]}", "--connect-timeout", "2"])
        took = time.monotonic() - started
    out = capfd.readouterr()
    assert code == 2 and out.out.strip().count("\n") == 0 and "no gRPC handshake within 2 s" in out.out
    assert out.err == "" and 2 <= took < 10  # nothing of Ray's: its join retries print to stderr


def test_a_data_path_that_holds_no_dataset_is_named_and_nothing_is_prepared_there(capsys, tmp_path):
    typo = tmp_path / "data" / "stdlib-byts"
    job = write_job(tmp_path, f'runs_dir = "{tmp_path / "runs"}"\n[data]\npath = "{typo}"\n')
    code, out = run_cli(capsys, "fit", job)
    line = out.replace("\n", "")
    assert code == 2 and f"[data] path = '{typo}': no prepared dataset there" in line
    assert f"`archipelago prepare --source DIR --out {typo}`" in line
    assert not typo.exists() and not (tmp_path / "runs").exists()  # nothing prepared, no run started


@pytest.mark.parametrize("command", ["plan --config", "fit"])
def test_a_factory_found_wrong_after_loading_is_named_with_its_config_file(capsys, tmp_path, command):
    job = write_job(tmp_path, '[model]\nkind = "custom"\nfactory = "no_such_module_of_the_user:build"\n')
    code, out = run_cli(capsys, *command.split(), job)
    assert code == 2
    assert f"{job}: [model] factory: cannot import 'no_such_module_of_the_user'" in out
    assert "Traceback" not in out


def test_a_plan_refused_for_a_config_key_names_the_config_file(capsys, tmp_path):
    job = write_job(tmp_path, "[model]\nn_layer = 1\nn_head = 4\nn_embd = 64\nseq_len = 64\n[cluster]\nuse_gpu = true\n"
                              "[placement]\nmin_gpus = 3\nmax_gpus = 3\ntensor_parallel_size = 2\n")
    code, out = run_cli(capsys, "plan", "--config", job, "--generate", "8xH100-SXM:1")
    assert code == 2 and f"{job}: [placement] max_gpus: min_gpus = 3 to max_gpus = 3 holds no multiple" in out
