"""The MLflow run of an archipelago run ends as the run did: a run stopped by Ctrl-C is KILLED in MLflow, with
the report it left as an artifact (no Ray: the training is replaced by rows that arrive and then a Ctrl-C)."""

import io
import json

import pytest
from rich.console import Console

from orchestrator import Orchestrator
from orchestrator.accounting.exporters import MLFLOW_RUN_FILE, MlflowExport, mlflow_client
from tests.conftest import tiny_job
from tests.engine_support import job_spec


def test_a_run_stopped_by_ctrl_c_ends_its_mlflow_run_as_killed(tmp_path, dataset_dir, monkeypatch):
    def trains_two_steps_then_ctrl_c(self, *args):
        job_spec(self.config).plan.save(self.run.plan_path)
        tracking = MlflowExport.open(self.config.to_dict(), self.run.path, tracking_uri="", resumed=False)
        rows = [{"event": "start", "step": 0, "world_size": 2, "device": "cpu", "params": 1, "flops_per_token": 1.0},
                *({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0, "consumed_samples": 8 * s} for s in (1, 2))]
        tracking.write([{"step": 1, "loss": 4.9}], [])
        self.run.append_metrics(rows)
        self._rows += rows
        raise KeyboardInterrupt
    monkeypatch.setattr(Orchestrator, "_train_on_ray", trains_two_steps_then_ctrl_c)
    config = tiny_job(dataset_dir, tmp_path / "runs", bill={"mlflow": True})
    orchestrator = Orchestrator(config, console=Console(file=io.StringIO()))
    with pytest.raises(KeyboardInterrupt):
        orchestrator.fit()
    recorded = json.loads((orchestrator.run.path / MLFLOW_RUN_FILE).read_text())
    client = mlflow_client(recorded["tracking_uri"], orchestrator.run.path)
    run = client.get_run(recorded["run_id"])
    assert run.info.status == "KILLED" and run.data.params["name"] == config.name
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"plan.json", "report.json"}
