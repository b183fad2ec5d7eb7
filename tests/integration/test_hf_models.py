"""A Hugging Face model through `archipelago fit`: a 2-layer Mistral from weights transformers saved
fine-tunes for 5 steps on two gloo workers, and the first step's loss is transformers' own loss on that
step's batch; the run, cut back to its step-3 checkpoint, resumes to the same losses; MLflow tracked it;
`archipelago export` then writes the trained model, which transformers loads with the logits
archipelago's model restored from the run's checkpoint gives. (Llama and Qwen2 directories read into
the same workload are held to transformers' loss in tests/unit/test_hf_weights.py, without Ray.)"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from transformers import AutoModelForCausalLM

from core.config import JobConfig
from orchestrator import Orchestrator
from orchestrator.accounting.exporters import MLFLOW_RUN_FILE, mlflow_client
from orchestrator.cli import main
from storage.checkpoint_io import load_checkpoint
from storage.sampler import DeterministicSampler
from storage.shards import TokenDataset
from tests.hf_support import hf_loss, write_model
from tests.integration.conftest import SEQ_LEN, job
from workers.models import make_workload

pytestmark = pytest.mark.integration
STEPS, CUT = 5, 3
GLOBAL_BATCH = 8


def hf_job(small_dataset, runs, name: str, table: dict, **sections) -> JobConfig:
    """The integration job with the [model] `table` alone (the tiny job's shape keys would contradict
    config.json's) and seq_len."""
    config = job(small_dataset, runs, name, STEPS, **{"checkpoint": {"every_steps": STEPS}, **sections})
    model = JobConfig.from_dict({"model": {**table, "seq_len": SEQ_LEN}}).model
    return dataclasses.replace(config, model=model)


def first_batch(small_dataset) -> torch.Tensor:
    """The samples of step 0 (the sampler's first global batch, seed 0)."""
    data_dir, _ = small_dataset
    train = TokenDataset(data_dir, "train", SEQ_LEN)
    ids = DeterministicSampler(train.num_samples, seed=0).permute(0, np.arange(GLOBAL_BATCH))
    return torch.from_numpy(train.batch(ids))


def test_a_hugging_face_model_fine_tunes_from_its_weights(cluster, small_dataset, tmp_path):
    architecture = "mistral"
    model = write_model(tmp_path / architecture, architecture)
    config = hf_job(small_dataset, tmp_path / "runs", architecture, {"kind": "hf", "hf_dir": str(tmp_path / architecture)},
                    bill={"mlflow": True}, checkpoint={"every_steps": CUT, "keep_last": 2})
    result = Orchestrator(config).fit()
    rows = result.metrics
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert losses[1] == pytest.approx(hf_loss(model, first_batch(small_dataset)), rel=1e-5)
    assert losses[STEPS] < losses[1]
    start = next(r for r in rows if r.get("event") == "start")
    assert start["model"] == f"hf:{architecture}" and start["params"] == sum(p.numel() for p in model.parameters())
    assert start["pretrained_reader"] == "posix"  # CPU workers: [checkpoint] reader "auto" reads hf_dir by POSIX

    assert main(["export", str(tmp_path / "runs" / architecture), "--hf", str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    trained = make_workload(config.model).build()
    state = {"model": get_model_state_dict(trained)}
    load_checkpoint(state, result.checkpoint, reader="posix")
    set_model_state_dict(trained, state["model"])
    tokens = first_batch(small_dataset)[:2, :-1]
    with torch.no_grad():
        logits = exported(input_ids=tokens).logits
        torch.testing.assert_close(logits, trained(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logits, model(input_ids=tokens).logits, atol=1e-3)  # trained, not the start
    mlflow_tracked_the_run(tmp_path / "runs" / architecture)
    resumed_where_it_stopped(config, tmp_path / "runs", losses)


def resumed_where_it_stopped(config: JobConfig, runs, straight: dict[int, float]) -> None:
    """A copy of the run cut back to its step-CUT checkpoint and resumed trains the uninterrupted run's losses."""
    shutil.copytree(runs / config.name, runs / "cut")
    shutil.rmtree(runs / "cut" / f"step_{STEPS:08d}")
    resumed = Orchestrator(dataclasses.replace(config, name="cut"), resume=True).fit()
    losses = {r["step"]: r["loss"] for r in resumed.metrics if "loss" in r}
    assert sorted(losses) == list(range(CUT + 1, STEPS + 1))
    start = [r for r in resumed.metrics if r.get("event") == "start"][-1]
    assert start["pretrained_reader"] is None and start["step"] == CUT  # the checkpoint, not hf_dir, is read
    for step, loss in losses.items():
        assert loss == pytest.approx(straight[step], rel=1e-5)


def mlflow_tracked_the_run(run_dir):
    """The local MLflow store holds the job's params, the bill's per-step losses and the run's files."""
    recorded = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())
    client = mlflow_client(recorded["tracking_uri"], run_dir)
    run = client.get_run(recorded["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == str(STEPS)
    bill = [json.loads(line) for line in (run_dir / "bill.jsonl").read_text().splitlines()]
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/train")}
    assert history == {row["step"]: pytest.approx(row["loss"]) for row in bill} and len(history) == STEPS
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"plan.json", "bill.jsonl", "report.json"}
