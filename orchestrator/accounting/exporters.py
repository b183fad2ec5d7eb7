"""Where the live bill goes besides the progress line: JSON lines, TensorBoard events, Prometheus, MLflow.

    BillJsonl(run_dir / "bill.jsonl").write(bill_rows)          # what `archipelago report` reads
    TensorBoardExport(run_dir / "tensorboard").write(bill_rows, alerts)
    PrometheusExport(run="cpu-tiny").write(bill_rows, alerts)    # needs ray.init(): Ray's metrics agent serves it
    MlflowExport.open(config, run_dir).write(bill_rows, alerts)  # [bill] mlflow: params, per-step metrics
    finish_mlflow(run_dir)                                       # after the report: bill, report, plan as artifacts

MLflow: the tracking URI is [bill] mlflow_uri, or a local file store at <runs_dir>/mlruns. MLflow 3.7+
keeps file stores in maintenance mode and refuses them unless MLFLOW_ALLOW_FILE_STORE is set, which
the local default sets for this process (`mlflow migrate-filestore` moves such a store into SQLite;
give mlflow_uri = "sqlite:///…" or a server's http(s) URI to use one). One MLflow run per archipelago
run: a resumed run continues it (its id is kept in <run>/mlflow.json). The metrics are the
TensorBoard scalars under the same names, the params the job config flattened ("train.lr").

Prometheus metrics go through Ray's metrics API (ray.util.metrics), so they appear on every
node's metrics export port beside Ray's own, prefixed "ray_": ray_archipelago_dollars{run="…"}.
Ray's agent drops a gauge series not set again within two export intervals (20 s by default), and
a log window can take longer than that, so the last values are set again every few seconds until
the run ends.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

from orchestrator.accounting.alerts import Alert

SCALARS = {  # bill-row key → TensorBoard tag
    "loss": "loss/train", "val_loss": "loss/validation", "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu", "dollars": "bill/dollars", "tokens_per_dollar": "bill/tokens_per_dollar",
    "dollars_per_step": "bill/dollars_per_step", "device_hours": "bill/device_hours",
    "step_s": "time/step_s", "exposed_comm_share": "time/exposed_comm_share",
    "data_wait_share": "time/data_wait_share",
}
GAUGES = {  # bill-row key → (Prometheus name, description)
    "step": ("archipelago_step", "Last optimizer step reported"),
    "loss": ("archipelago_loss", "Training loss of the last step"),
    "val_loss": ("archipelago_val_loss", "Last validation loss"),
    "tokens_per_s": ("archipelago_tokens_per_second", "Training throughput, all workers together"),
    "mfu": ("archipelago_mfu", "Model FLOPs utilisation (share of the devices' peak)"),
    "dollars": ("archipelago_dollars", "Dollars spent by the run so far"),
    "tokens_per_dollar": ("archipelago_tokens_per_dollar", "Tokens trained per dollar so far"),
    "exposed_comm_share": ("archipelago_exposed_comm_share", "Share of the step spent waiting for communication"),
}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class BillJsonl:
    def __init__(self, path: Path):
        self.path = Path(path)

    def last_row(self) -> dict | None:
        """The last bill row of an earlier invocation (what a resumed run carries on from)."""
        if not self.path.is_file():
            return None
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None

    def write(self, bill_rows: list[dict]) -> None:
        with self.path.open("a") as f:
            for row in bill_rows:
                f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TensorBoardExport:
    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(logdir))

    def write(self, bill_rows: list[dict], alerts: list[Alert]) -> None:
        for row in bill_rows:
            for key, tag in SCALARS.items():
                if _finite(row.get(key)):
                    self.writer.add_scalar(tag, row[key], global_step=row["step"])
        for alert in alerts:
            self.writer.add_text(f"alerts/{alert.kind}", alert.message, global_step=alert.step)

    def close(self) -> None:
        self.writer.close()


MLFLOW_RUN_FILE = "mlflow.json"
MLFLOW_EXPERIMENT = "archipelago"
ARTIFACTS = ("plan.json", "bill.jsonl", "report.json", "report.html")
"""The run directory's files logged to MLflow when the run ends (those that exist)."""


class MlflowExport:
    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    @classmethod
    def open(cls, config: dict, run_dir: Path, *, tracking_uri: str, resumed: bool) -> MlflowExport:
        """The MLflow run of `run_dir` (its job `config` as params), continued when resumed."""
        client = mlflow_client(tracking_uri, run_dir)
        kept = Path(run_dir) / MLFLOW_RUN_FILE
        if resumed and kept.is_file():
            return cls(client, json.loads(kept.read_text())["run_id"])
        experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(MLFLOW_EXPERIMENT)
        run = client.create_run(experiment_id, run_name=Path(run_dir).name, tags={"archipelago.run_dir": str(run_dir)})
        kept.write_text(json.dumps({"tracking_uri": tracking_uri, "run_id": run.info.run_id}))
        from mlflow.entities import Param

        params = [Param(key, str(value)[:500]) for key, value in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(run.info.run_id, params=params[start:start + 100])
        return cls(client, run.info.run_id)

    def write(self, bill_rows: list[dict], alerts: list[Alert]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(row[key]), now, int(row["step"])) for row in bill_rows
                   for key, tag in SCALARS.items() if _finite(row.get(key))]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])
        for alert in alerts:
            self.client.set_tag(self.run_id, f"alert.{alert.kind}.step_{alert.step}", alert.message[:5000])

    def close(self) -> None:
        """The run stays open for finish_mlflow, which adds the report."""


def mlflow_client(tracking_uri: str, run_dir: Path):
    """An MlflowClient of `tracking_uri`, or of the file store beside the run directory when it is ""."""
    from mlflow.tracking import MlflowClient

    if not tracking_uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracking_uri = (Path(run_dir).resolve().parent / "mlruns").as_uri()
    return MlflowClient(tracking_uri=tracking_uri)


def finish_mlflow(run_dir: Path, status: str = "FINISHED") -> None:
    """Logs the run directory's plan, bill and report to its MLflow run and ends it (no-op without one)."""
    kept = Path(run_dir) / MLFLOW_RUN_FILE
    if not kept.is_file():
        return
    recorded = json.loads(kept.read_text())
    client = mlflow_client(recorded["tracking_uri"], run_dir)
    for name in ARTIFACTS:
        if (Path(run_dir) / name).is_file():
            client.log_artifact(recorded["run_id"], str(Path(run_dir) / name))
    client.set_terminated(recorded["run_id"], status=status)


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class PrometheusExport:
    def __init__(self, run: str, *, refresh_s: float = 5.0):
        from ray.util.metrics import Counter, Gauge

        self.tags = {"run": run}
        self.gauges = {key: Gauge(name, description=text, tag_keys=("run",)) for key, (name, text) in GAUGES.items()}
        self.alerts = Counter("archipelago_alerts", description="Alerts fired, by kind", tag_keys=("run", "kind"))
        self.values: dict[str, float] = {}
        """The last value set per gauge: what a scrape shows once Ray's agent has exported it."""
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._refresher = threading.Thread(target=self._refresh, args=(refresh_s,), daemon=True,
                                           name="archipelago-prometheus")
        self._refresher.start()

    def write(self, bill_rows: list[dict], alerts: list[Alert]) -> None:
        with self._lock:
            for row in bill_rows:
                self.values.update({key: float(row[key]) for key in self.gauges if _finite(row.get(key))})
            self._set_all()
        for alert in alerts:
            self.alerts.inc(1.0, tags={**self.tags, "kind": alert.kind})

    def _set_all(self) -> None:
        for key, value in self.values.items():
            self.gauges[key].set(value, tags=self.tags)

    def _refresh(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            with self._lock:
                self._set_all()

    def close(self) -> None:
        self._closed.set()
        self._refresher.join()
