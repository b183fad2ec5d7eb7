"""The driver's live bill: the meter, the alerts and the exports, fed with each batch of metrics rows.

    bill = LiveBill.open(plan, config, run_dir, resumed=first_step > 0, started=time.monotonic())
    bill_rows, alerts = bill.update(rows)       # appends to <run>/bill.jsonl, TensorBoard, Prometheus, MLflow
    bill.close()

The clock counts from the start of the invocation of fit (the instant the report's bill counts
from: dataset checks, Ray's start and planning are billed too); a resumed run carries the dollars,
device-hours and clock of its earlier invocations from bill.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path

from core.config import JobConfig
from core.plan import Plan
from orchestrator.accounting.alerts import Alert, AlertMonitor
from orchestrator.accounting.bill import BillMeter, Rates
from orchestrator.accounting.exporters import BillJsonl, MlflowExport, PrometheusExport, TensorBoardExport

BILL_FILE = "bill.jsonl"
TENSORBOARD_DIR = "tensorboard"


class LiveBill:
    def __init__(self, meter: BillMeter, monitor: AlertMonitor, jsonl: BillJsonl,
                 tensorboard: TensorBoardExport | None, prometheus: PrometheusExport | None,
                 mlflow: MlflowExport | None, started: float):
        """started: the time.monotonic() the clock counts from."""
        self.meter = meter
        self.monitor = monitor
        self.jsonl = jsonl
        self.tensorboard = tensorboard
        self.prometheus = prometheus
        self.mlflow = mlflow
        self.started = started

    @classmethod
    def open(cls, plan: Plan, config: JobConfig, run_dir: Path, *, resumed: bool, started: float) -> LiveBill:
        """started: when this invocation of fit began (time.monotonic()), the instant the report's bill counts from."""
        jsonl = BillJsonl(Path(run_dir) / BILL_FILE)
        meter = BillMeter(Rates.from_plan(plan), carried=jsonl.last_row() if resumed else None)
        monitor = AlertMonitor(config.bill.alerts, gpu=plan.uses_gpus)
        tensorboard = TensorBoardExport(Path(run_dir) / TENSORBOARD_DIR) if config.bill.tensorboard else None
        prometheus = PrometheusExport(config.name) if config.bill.prometheus else None
        mlflow = (MlflowExport.open(config.to_dict(), Path(run_dir), tracking_uri=config.bill.mlflow_uri, resumed=resumed)
                  if config.bill.mlflow else None)
        return cls(meter, monitor, jsonl, tensorboard, prometheus, mlflow, started)

    def update(self, rows: list[dict]) -> tuple[list[dict], list[Alert]]:
        bill_rows = self.meter.observe(rows, now=time.monotonic() - self.started)
        alerts = self.monitor.observe(bill_rows)
        if bill_rows:
            self.jsonl.write(bill_rows)
        for sink in (self.tensorboard, self.prometheus, self.mlflow):
            if sink is not None:
                sink.write(bill_rows, alerts)
        return bill_rows, alerts

    def close(self) -> None:
        for sink in (self.tensorboard, self.prometheus, self.mlflow):
            if sink is not None:
                sink.close()
