"""What the integration modules share: one Ray cluster, and one uninterrupted run on it.

Starting Ray and each fit's processes costs tens of CPU-seconds (mostly Python interpreters importing
torch and Ray Train); on two cores that, not training, is where a test's time goes. So:

- `cluster`: one ray.cluster_utils.Cluster on loopback for the whole package — a head and one worker
  node, 1 CPU each (two gloo CPU workers). test_elastic removes and adds worker nodes, and
  test_topology_discover adds a GPU node for its module.
- `s3_server`: a moto S3 server on loopback (test_checkpoint_s3, test_secrets), which can fail chosen
  uploads.
- `straight`: one uninterrupted fit of `job()` over the first epoch of a small dataset and a few more
  steps. test_fit checks its checkpoints and report, test_report its bill (a thread scrapes the
  Prometheus gauge the driver sets while it trains), and the runs that test_elastic and
  test_driver_kill kill and resume are compared with it, step by step.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from core.config import JobConfig
from orchestrator import FitResult, Orchestrator
from storage.fs import Location
from storage.prepare import prepare_dataset
from storage.shards import TokenDataset
from tests.conftest import CORPUS_SOURCE, tiny_job

SMALL_FILES = ["parser.py", "errors.py", "base64mime.py", "iterators.py", "encoders.py", "__init__.py"]
SEQ_LEN = 64
BILL_TARGETS = [5.0, 3.8, 1.0]
"""Validation losses the straight run's bill prices: reached early, maybe reached, never reached."""


@pytest.fixture(scope="package")
def small_dataset(tmp_path_factory) -> tuple[Path, int]:
    """A dataset of a few hundred samples, so a run of a few dozen steps covers whole epochs; and its sample count."""
    corpus = tmp_path_factory.mktemp("small-corpus")
    for name in SMALL_FILES:
        shutil.copy(CORPUS_SOURCE / name, corpus / name)
    out = tmp_path_factory.mktemp("small-data") / "bytes"
    prepare_dataset(str(corpus), out, val_percent=20.0, shard_tokens=16 * 1024, workers=1)
    return out, TokenDataset(out, "train", SEQ_LEN).num_samples


def job(small_dataset, runs_dir: Path, name: str, steps: int, **sections) -> JobConfig:
    """tiny_job on the small dataset, every step's loss reported, the sample ledger kept."""
    data_dir, _ = small_dataset
    return tiny_job(data_dir, runs_dir, name=name, model={"seq_len": SEQ_LEN, **sections.pop("model", {})},
                    train={"steps": steps, "log_every": 1, **sections.pop("train", {})},
                    elastic={"sample_ledger": True, **sections.pop("elastic", {})}, **sections)


def epoch_steps(small_dataset) -> int:
    """Steps that cover the first epoch and a few more (global batch 8)."""
    return math.ceil(small_dataset[1] / 8) + 6


@pytest.fixture(scope="package")
def cluster():
    # Ray's agent exports metrics twice a second, not every 10 s (test_report scrapes them); read at start-up.
    os.environ["RAY_metrics_report_interval_ms"] = "500"
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    finally:
        os.environ.pop("RAY_metrics_report_interval_ms", None)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class Scraper(threading.Thread):
    """Scrapes gauge `name` of `run` from the metrics port twice a second; `seen` is every value it found."""

    def __init__(self, port: int, name: str, run: str):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.pattern = re.compile(rf'^{name}{{[^}}]*run="{run}"[^}}]*}} (\S+)$', re.MULTILINE)
        self.seen: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            found = self.pattern.search(urllib.request.urlopen(self.url, timeout=5).read().decode())
            if found and (not self.seen or self.seen[-1] != float(found.group(1))):
                self.seen.append(float(found.group(1)))


@dataclass(frozen=True)
class StraightRun:
    dir: Path
    config: JobConfig
    result: FitResult
    scraped_dollars: list[float]
    """Every value of the Prometheus gauge ray_archipelago_dollars a scrape saw during the run."""

    @property
    def steps(self) -> int:
        return self.config.train.steps


@pytest.fixture(scope="package")
def straight(cluster, small_dataset, tmp_path_factory) -> StraightRun:
    runs = tmp_path_factory.mktemp("runs")
    config = job(small_dataset, runs, "straight", epoch_steps(small_dataset), bill={"targets": BILL_TARGETS})
    # The driver's gauge is exported by its node's agent: a driver joins the head when nodes share a host.
    scraper = Scraper(cluster.head_node.metrics_export_port, "ray_archipelago_dollars", "straight")
    scraper.start()
    try:
        result = Orchestrator(config).fit()
        time.sleep(2.0)  # Ray's agent exports every second (RAY_metrics_report_interval_ms, floored at 1 s)
    finally:
        scraper.stop.set()
        scraper.join()
    return StraightRun(runs / "straight", config, result, scraper.seen)


class FailingUploads:
    """WSGI middleware before moto: the next `count` uploads (PUT or POST) to a key ending in `name` get
    HTTP 500 InternalError, which the S3 client retries (3 attempts in all, pyarrow's default)."""

    ERROR = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b'<Message>injected by the test</Message><RequestId>0</RequestId></Error>')

    def __init__(self, app):
        self.app = app
        self.name, self.count = "", 0
        self.refused: list[str] = []
        self.lock = threading.Lock()

    def fail(self, name: str, count: int) -> None:
        with self.lock:
            self.name, self.count, self.refused = name, count, []

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        with self.lock:
            refuse = self.count > 0 and environ["REQUEST_METHOD"] in ("PUT", "POST") and path.endswith(self.name)
            if refuse:
                self.count -= 1
                self.refused.append(f"{environ['REQUEST_METHOD']} {path}")
        if not refuse:
            return self.app(environ, start_response)
        start_response("500 Internal Server Error", [("Content-Type", "application/xml"),
                                                     ("Content-Length", str(len(self.ERROR)))])
        return [self.ERROR]


@pytest.fixture(scope="package")
def s3_server():
    """(the root of bucket archipelago-test, its FailingUploads); AWS_* credentials set to dummies meanwhile."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            env.setenv(key, value)
        faults = FailingUploads(DomainDispatcherApplication(create_backend_app))
        server = make_server("127.0.0.1", 0, faults, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        host, port = server.server_address[:2]
        root = Location.parse(f"s3://archipelago-test?endpoint_override={host}:{port}&scheme=http"
                              "&allow_bucket_creation=true&region=us-east-1")
        root.fs.create_dir("archipelago-test")
        try:
            yield root, faults
        finally:
            server.shutdown()
            thread.join()
