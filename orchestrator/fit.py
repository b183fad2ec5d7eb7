"""The driver: check the job, start or join Ray, run the workers under Ray Train, report.

    from orchestrator import Orchestrator, JobConfig
    result = Orchestrator(JobConfig.from_toml("examples/cpu-tiny.toml")).fit()
    print(result.report.final_val_loss, result.checkpoint)

Failures and resizes (orchestrator/coordinator.py): Ray Train restarts the worker group within the
`[elastic]` failure budgets; a PlanCoordinator actor plans each new group for the workers Ray
granted and records the events. The report is built with the plan the last group ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.train import PreemptionError, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer
from rich.console import Console

import planning
import topology
from core.adaptive_batch import BatchPolicy
from core.config import JobConfig
from core.errors import ArchipelagoError, ConfigError, DataError, FailureBudgetError
from core.plan import Plan
from core.schedule import LrSchedule
from core.spec import WorkerSpec
from core.workload import Workload
from orchestrator import coordinator
from orchestrator.accounting.exporters import finish_mlflow
from orchestrator.accounting.report import RunReport
from orchestrator.progress import MetricsSink, ProgressDisplay
from orchestrator.run_dir import RunDirectory, SetAside
from orchestrator.shipping import modules_to_ship
from planning.calibration import Calibration
from planning.memory import MemoryProfile, profile
from planning.model_size import model_facts
from planning.plan_table import significant
from storage.fs import Location
from storage.prepare import prepare_dataset
from storage.shards import TokenDataset, check_files, has_dataset
from storage.verify import verify_dataset
from topology.connect import ray_session
from topology.discover import discover_cluster
from topology.device_figures import DeviceBench
from topology.probe import probe_local_node
from workers import binding, checkpoint
from workers.loop import WorkerJob, train_loop
from workers.models import check_takes_loss_masks, make_workload, register_factory


@dataclass(frozen=True, slots=True)
class FitResult:
    metrics: list[dict]
    """Every row the workers reported in this invocation (also appended to metrics.jsonl)."""
    checkpoint: Path | Location | None
    """The latest committed checkpoint (a Location when checkpoints live in object storage)."""
    plan: Plan
    """Where the workers ran and what the planner predicted (also in <run>/plan.json)."""
    report: RunReport
    trained: bool = True
    """False when --resume found the run trained to [train] steps already: nothing ran, nothing was written,
    and `report` is the run's report.json as it was."""


@dataclass(frozen=True, slots=True)
class _Clock:
    """When this invocation of fit started: the bill, the report's wall time and its curves count from here."""

    started: float = field(default_factory=time.monotonic)
    started_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))


@dataclass(frozen=True, slots=True)
class _Dataset:
    """The prepared dataset the job trains on, as checked on the driver."""

    location: str
    """A local path or a URI."""
    tokenizer: str
    token_flags: bool
    """Its tokens carry a loss mask (fine-tuning data)."""
    fingerprint: str
    """Its training samples' identity (checkpoints record it)."""


@dataclass(frozen=True, slots=True)
class _Start:
    """Where this invocation's training starts."""

    checkpoint: Path | Location | None
    """The committed checkpoint it resumes from (None: from scratch)."""
    step: int
    lr_schedule: LrSchedule


def _job_config(config: JobConfig | str | Path | dict[str, Any]) -> JobConfig:
    """The job Orchestrator was given, as a JobConfig; anything else is refused (no attribute error from deep inside)."""
    if isinstance(config, JobConfig):
        return config
    if isinstance(config, (str, Path)):
        return JobConfig.from_toml(config)
    if isinstance(config, dict):
        return JobConfig.from_dict(config)
    raise ConfigError(f"config is a {type(config).__name__}, not a job", where="Orchestrator(config)",
                      fix='pass a JobConfig, the path of a TOML job file ("examples/cpu-tiny.toml") or a dict of its '
                          "tables")


class Orchestrator:
    def __init__(self, config: JobConfig | str | Path | dict[str, Any], *, model: Callable[[dict], Any] | None = None,
                 address: str = "", connect_timeout_s: float | None = None, resume: bool = False, overwrite: bool = False,
                 console: Console | None = None, verbose: bool = False):
        """config: a JobConfig, a TOML file's path (read as `archipelago fit` reads it) or a dict of its tables.
        model: the user's model factory, as [model] factory names one (kind = "custom"): a function of
        the [model] table returning an nn.Module (token ids to logits) or a workload. address and
        connect_timeout_s: as --address and --connect-timeout say (None: [cluster] connect_timeout_s)."""
        if resume and overwrite:  # the command line's parser refuses --resume with --overwrite in its own words
            raise ConfigError("resume=True and overwrite=True contradict each other", where="Orchestrator(...)",
                              fix="pass resume=True to continue the run, or overwrite=True to start it over")
        config = _job_config(config)
        if model is not None:
            factory = dataclasses.replace(config.model, kind="custom", factory=register_factory(model))
            config = dataclasses.replace(config, model=factory)
        self.config = config
        self.address = address or config.cluster.address or os.environ.get("RAY_ADDRESS", "")
        self.connect_timeout_s = config.cluster.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        self.resume = resume
        self.overwrite = overwrite
        self.console = console or Console()
        self.verbose = verbose
        self.run = RunDirectory(config.runs_dir, config.name, config.checkpoint.storage)
        self._clock = _Clock()
        self._rows: list[dict] = []
        """Every row this invocation received."""
        self._tokenizer = ""
        """The dataset's tokenizer identity (the report records it)."""
        self._aside: SetAside | None = None
        """The earlier run --overwrite moved aside, until this run commits a checkpoint."""

    @property
    def workload(self) -> Workload:
        """The model the job trains, built (and checked) once: make_workload caches it per [model] table."""
        return make_workload(self.config.model)

    def fit(self) -> FitResult:
        """Trains the job; on any way out before the end (an error, Ctrl-C) the earlier run an --overwrite set
        aside comes back if this one committed nothing, and a run that trained writes report.json."""
        self._clock, self._rows = _Clock(), []
        _ = self.workload  # a factory's errors, before anything starts
        dataset = self._dataset()
        if dataset.token_flags:
            check_takes_loss_masks(self.workload)
        self._tokenizer = dataset.tokenizer
        resume_from = self._resume_point(dataset)
        if resume_from is not None and self._finished(resume_from[1]):
            return self._already_trained(*resume_from)
        start = self._open_run(resume_from)
        try:
            plan = self._train_on_ray(dataset, start)
        except BaseException as e:
            self._stopped("interrupted" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "failed")
            raise
        self._committed()
        report = self._save_report("completed", plan)
        finish_mlflow(self.run.path)
        return FitResult(self._rows, self.run.latest_checkpoint(), plan, report)

    def _train_on_ray(self, dataset: _Dataset, start: _Start) -> Plan:
        """Plans the job on the cluster and trains it; returns the plan the last worker group ran."""
        if not (self.address or ray.is_initialized()):
            # An embedded cluster runs on this machine: measure its devices (once; cached) while it is
            # quiet, before Ray's processes start. The probe then reads the figures from the cache.
            probe_local_node(bench=DeviceBench.from_environment())
        with self._ray():
            cluster = discover_cluster()
            memory = profile(self.config, device_type="cuda" if self.config.cluster.use_gpu else "cpu")
            calibration = Calibration.for_job(self.config)  # [placement] calibration_file, or <runs_dir>'s
            plan = self._plan(cluster, memory, calibration)
            if not self.resume:  # a report from the start, so that a run killed at any point can be reported
                self._save_report("running", plan)
            facts = model_facts(self.workload, self.config.model.seq_len)
            spec = WorkerSpec.for_plan(self.config, plan, workload=self.workload, flops_per_token=facts.flops_per_token,
                                       data_location=dataset.location, tokenizer=dataset.tokenizer,
                                       token_flags=dataset.token_flags, data_fingerprint=dataset.fingerprint,
                                       lr_schedule=start.lr_schedule)
            sink = MetricsSink.options(scheduling_strategy=coordinator.on_this_node()).remote()  # outlives worker nodes
            plan_coordinator = coordinator.start_coordinator(self.config, spec, cluster, str(self.run.plan_path),
                                                             sink, memory, calibration)
            try:
                job = WorkerJob(uses_gpus=plan.uses_gpus, metrics_sink=sink, coordinator=plan_coordinator,
                                resume_from=str(start.checkpoint) if start.checkpoint else None)
                self._train(job, plan, sink, start.step)
                return ray.get(plan_coordinator.current_plan.remote())  # the last group's: it may have been re-planned
            finally:
                ray.kill(plan_coordinator)

    def _already_trained(self, latest: Path | Location, info: checkpoint.CheckpointInfo) -> FitResult:
        """--resume of a run whose latest checkpoint is at or past [train] steps: said, and nothing touched."""
        steps = self.config.train.steps
        batch = self.config.train.global_batch_size
        trained = (f"{info.consumed_samples:,} samples, and an adaptive batch trains [train] steps × global_batch_size "
                   f"= {steps} × {batch}" if self.config.train.batch_size == "adaptive" else f"[train] steps = {steps}")
        self.console.print(f"run {self.config.name!r} is trained to step {info.step} ({latest}) and {trained}: "
                           "nothing to train. Raise [train] steps to train further; "
                           f"`archipelago report {self.run.path}` shows the run.", markup=False, highlight=False)
        return FitResult([], latest, Plan.load(self.run.plan_path), RunReport.load(self.run.path), trained=False)

    def _committed(self) -> None:
        """This run has a committed checkpoint: an earlier run it replaces is not needed any more."""
        if self._aside is not None:
            self._aside.discard()
            self._aside = None

    def _stopped(self, status: str) -> None:
        """fit is leaving before the end. A replacement that committed nothing gives the earlier run back;
        otherwise a run that trained a step this time says how far it got in report.json. Its MLflow run ends
        as killed or failed."""
        if self._aside is not None and not self.run.committed_checkpoints():
            self._end_mlflow(status)
            self._aside.restore()
            self._aside = None
            self.console.print(f"the earlier run is back in {self.run.path}: this one stopped before it committed "
                               "a checkpoint", markup=False, highlight=False)
            return
        self._committed()
        if self._trained_to_the_end():  # what stopped fit came after the last step's checkpoint: nothing is missing
            status = "completed"
        if any("loss" in row for row in self._rows) and self.run.plan_path.is_file():
            self._save_report(status, Plan.load(self.run.plan_path))
        self._end_mlflow(status)

    def _trained_to_the_end(self) -> bool:
        """Whether the newest committed checkpoint is the last step's (asked while leaving on an error: a
        checkpoint it cannot read answers no, and the error that is leaving stays the one raised)."""
        latest = self.run.latest_checkpoint()
        try:
            info = checkpoint.read_info(latest) if latest is not None else None
        except ArchipelagoError:
            return False
        return info is not None and self._finished(info)

    def _finished(self, info: checkpoint.CheckpointInfo) -> bool:
        """Whether the checkpoint `info` describes has trained what [train] asks (the workers' own rule)."""
        return BatchPolicy.for_train(self.config.train).finished(info.step, info.consumed_samples, self.config.train.steps)

    def _end_mlflow(self, status: str) -> None:
        # The error that stopped the run is the one to raise: a tracking server that is down too only gets a line.
        try:
            finish_mlflow(self.run.path, status="KILLED" if status == "interrupted" else "FAILED")
        except Exception as e:  # noqa: BLE001 - whatever the MLflow client raises
            self.console.print(f"MLflow: could not end the run's tracking ({e})", markup=False, highlight=False)

    def _save_report(self, status: str, plan: Plan) -> RunReport:
        latest = self.run.latest_checkpoint()
        report = RunReport.from_rows(
            self._rows, plan=plan, name=self.config.name, status=status, run_dir=str(self.run.path),
            started_at=self._clock.started_at, wall_seconds=time.monotonic() - self._clock.started,
            checkpoint_path=str(latest) if latest else None,
            checkpoint_step=checkpoint.read_info(latest).step if latest else None,
            metrics_path=str(self.run.metrics_path), config=self.config.to_dict(), tokenizer=self._tokenizer)
        report.save(self.run.report_path)
        return report

    def _plan(self, cluster: topology.ClusterTopology, memory: MemoryProfile, calibration: Calibration) -> Plan:
        """Plans the job on the cluster Ray gives us; the plan is saved beside the metrics.

        CPU jobs are planned on the worker slots Ray can schedule (each node's Ray CPUs, not its cores:
        several Ray nodes may share a machine); an elastic one on as many as are there now, between
        [elastic] min_workers and [cluster] num_workers: it grows later."""
        config = self.config
        if not config.cluster.use_gpu:
            cluster, slots = coordinator.ray_cpu_slots(cluster, config.cluster.cpus_per_worker)
            if config.elastic.min_workers:
                config = coordinator.config_for_world(config, max(config.elastic.min_workers,
                                                              min(slots, config.cluster.num_workers)))
        plan = planning.make_plan(cluster, config, memory=memory, calibration=calibration)
        plan.save(self.run.plan_path)
        predicted = plan.predicted
        self.console.print(f"plan: {plan.world_size} × {plan.workers[0].device_model} workers, "
                           f"{plan.data_parallel.value}, micro-batches {list(plan.replica_micro_batch_sizes())} "
                           f"× {plan.grad_accum_steps} accumulation; predicted {predicted.step_seconds * 1000:,.1f} ms a step, "
                           f"{predicted.tokens_per_second:,.0f} tokens/s, ${significant(predicted.dollars_per_million_tokens)} "
                           f"per million tokens "
                           f"({self.run.plan_path})", markup=False)
        for note in plan.notes:
            self.console.print(f"  plan note: {note}", markup=False)
        return plan

    def _resume_point(self, dataset: _Dataset) -> tuple[Path | Location, checkpoint.CheckpointInfo] | None:
        """For --resume, the checkpoint to continue from and its info, checked against the job; None for a new
        run, whose place is checked (an earlier run there needs --overwrite). Touches nothing."""
        if not self.resume:
            self.run.check_new(overwrite=self.overwrite)
            return None
        latest, damaged = self.run.checkpoint_to_resume()
        for step in damaged:
            self.console.print(f"step {step.step} is damaged ({step.problem}); moved it to {step.moved_to} and "
                               "resuming from the committed step before it", markup=False, highlight=False)
        info = checkpoint.read_info(latest)
        checkpoint.check_compatible(info, identity=self.workload.identity(), seed=self.config.train.seed,
                                    tokenizer=dataset.tokenizer, global_batch_size=self.config.train.global_batch_size,
                                    directory=latest, dataset=dataset.fingerprint)
        return latest, info

    def _open_run(self, resume_from: tuple[Path | Location, checkpoint.CheckpointInfo] | None) -> _Start:
        """Makes the run's directory (an earlier run moved aside with --overwrite), or rewinds a resumed run's
        metrics to its checkpoint and continues its learning-rate schedule to [train] steps."""
        train = self.config.train
        if resume_from is None:
            self._aside = self.run.create(overwrite=self.overwrite)
            if self._aside is not None:
                self.console.print(f"the earlier run is set aside in {self.run.previous_path} until this one commits "
                                   "its first checkpoint", markup=False, highlight=False)
            return _Start(None, 0, LrSchedule.for_train(train))
        latest, info = resume_from
        # A checkpoint that predates recorded schedules was trained under the config's, as far as can be known.
        recorded = info.lr_schedule or LrSchedule.for_train(train)
        schedule = recorded.resumed(train, at_step=info.step, where=str(latest))
        self.run.rewind_metrics(info.step)
        self.console.print(f"resuming from {latest}", markup=False)
        if schedule != recorded:
            self.console.print(f"  [train] steps {recorded.end_step} → {train.steps}: the learning rate goes on from "
                               f"{schedule.lr_at(info.step):.3g} at step {info.step} to min_lr {train.min_lr:g} at step "
                               f"{train.steps}", markup=False, highlight=False)
        return _Start(latest, info.step, schedule)

    def _dataset(self) -> _Dataset:
        """The prepared dataset (preparing it first when the config says where from), checked against the job."""
        data = self.config.data
        location = Location.parse(data.path, error=DataError)
        if not has_dataset(location) and not data.prepare_from:
            raise DataError("no prepared dataset there (no manifest.parquet)", where=f"[data] path = {str(location)!r}",
                            fix=f"check the path, or prepare it: `archipelago prepare --source DIR --out {location}` "
                                "(or set [data] prepare_from to prepare it on the first run)")
        if not has_dataset(location):
            if not location.is_local:
                raise DataError("prepare writes local datasets only", where=str(location),
                                fix="prepare into a local directory, then copy it to object storage")
            self.console.print(f"preparing {location} from {data.prepare_from!r} (first run only)", markup=False)
            summary = prepare_dataset(data.prepare_from, location.local_path, pattern=data.pattern or None,
                                      source_format=data.source_format, text_column=data.text_column,
                                      val_percent=data.val_percent, shard_tokens=data.shard_tokens,
                                      tokenizer=data.tokenizer, workers=data.prepare_workers,
                                      seq_len=self.config.model.seq_len)
            self.console.print(f"prepared {summary.tokens['train']:,} train and {summary.tokens['val']:,} "
                               f"validation tokens in {summary.shards} shards ({summary.workers} processes){summary.truncation_note}",
                               markup=False)
        train = TokenDataset(location, "train", self.config.model.seq_len)  # reads the manifest, once
        val = TokenDataset(location, "val", self.config.model.seq_len, manifest=train.manifest)
        check_files(location, train.shards + val.shards)
        if data.verify_checksums:
            report = verify_dataset(location, manifest=train.manifest, threads=data.reader_threads)
            if not report.ok:
                bad = report.problems[0]
                raise DataError(f"{len(report.problems)} bad shard(s); first: {bad.problem}", where=bad.shard,
                                fix=f"run `archipelago verify {location}` for the list, then prepare the dataset again")
        model, train_cfg = self.config.model, self.config.train
        if train.vocab_size > model.vocab_size:
            raise DataError(f"the dataset's tokenizer {train.tokenizer!r} has {train.vocab_size} tokens, "
                            f"the model only {model.vocab_size}", where=f"{location} / [model] vocab_size",
                            fix=f"set [model] vocab_size to at least {train.vocab_size}")
        if train.num_samples < train_cfg.global_batch_size:
            raise DataError(f"{train.num_samples} training samples of {model.seq_len + 1} tokens, fewer than one "
                            f"global batch ({train_cfg.global_batch_size})", where=str(location),
                            fix="add text to the corpus or lower [train] global_batch_size / [model] seq_len")
        if val.num_samples < 1:
            raise DataError(f"the validation split is shorter than one sample of {model.seq_len + 1} tokens",
                            where=str(location), fix="raise [data] val_percent and prepare again")
        packed = train.manifest.packed_seq_len
        if packed and packed != model.seq_len:
            raise DataError(f"the dataset packs conversations into samples of {packed} tokens, the job's are "
                            f"{model.seq_len}", where=f"{location} / [model] seq_len",
                            fix=f"set [model] seq_len = {packed}, or prepare the data again with --seq-len {model.seq_len}")
        return _Dataset(str(location), train.tokenizer, train.manifest.token_flags, train.manifest.train_fingerprint)

    @contextlib.contextmanager
    def _ray(self) -> Iterator[None]:
        """Joins the cluster at `address`, or starts an embedded one that lives as long as this fit; the
        module of a custom model's factory goes with the job when it is not installed (shipping.py)."""
        if ray.is_initialized():
            yield
            return
        cluster = self.config.cluster
        embedded = {"num_cpus": max(os.cpu_count() or 1, cluster.num_workers * cluster.cpus_per_worker),
                    "num_gpus": None if cluster.use_gpu else 0}
        with ray_session(self.address, connect_timeout_s=self.connect_timeout_s, embedded=embedded,
                         verbose=self.verbose, py_modules=modules_to_ship(self.workload)):
            yield

    def _train(self, job: WorkerJob, plan: Plan, sink, first_step: int) -> None:
        """Runs the workers under Ray Train, scheduled and joined as the first `plan` says; their rows go to
        metrics.jsonl, the display and `self._rows`."""
        cfg = self.config
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"job": job},
            torch_config=TorchConfig(backend=plan.backend),
            scaling_config=scaling_config(plan, cfg),
            run_config=RunConfig(name=cfg.name, storage_path=self.run.storage_path,
                                 failure_config=coordinator.failure_config(cfg),
                                 callbacks=[coordinator.failure_recorder(job.coordinator)]),
        )
        outcome: dict = {}
        thread = threading.Thread(target=_fit_into, args=(trainer, outcome), daemon=True)
        with ProgressDisplay.for_run(self.console, plan, cfg, self.run.path, first_step,
                                     started=self._clock.started) as display, _environ(_controller_settings(cfg)):
            thread.start()
            rows_before, ask_at = len(self._rows), time.monotonic() + coordinator.PLACEMENT_NOTE_S
            try:
                with _sigterm_as_interrupt():
                    while thread.is_alive():
                        thread.join(timeout=0.5)
                        self._collect(sink, display)
                        if ask_at is not None and time.monotonic() > ask_at:  # nothing heard yet: held back?
                            heard = len(self._rows) > rows_before
                            note = None if heard else _placement_wait_note(cfg)
                            if note:
                                self.console.print(note, markup=False)
                            ask_at = None if heard or note else ask_at + coordinator.PLACEMENT_NOTE_S
            except BaseException:  # Ctrl-C or SIGTERM: the workers stop before Ray does, what they sent is kept
                _stop_workers(job.coordinator, thread)
                with contextlib.suppress(Exception):
                    self._collect(sink, display)
                raise
            self._collect(sink, display)
        if "error" in outcome:
            error = outcome["error"]
            user_error = _user_error(error)
            if user_error is None and isinstance(error, TrainingFailedError):
                raise self._budget_error(error, job.coordinator) from error
            raise user_error or error

    def _budget_error(self, error: TrainingFailedError, coordinator) -> FailureBudgetError:
        """Ray Train gave up: which failures used the budget, and the checkpoint that is left."""
        preempted = isinstance(error, PreemptionError)
        failures = [f for f in ray.get(coordinator.failures.remote()) if f.preempted == preempted]
        key = "max_preemption_failures" if preempted else "max_failures"
        limit = getattr(self.config.elastic, key)
        what = "preemption(s)" if preempted else "worker failure(s)"
        listed = "; ".join(f.describe() for f in failures) or str(error).splitlines()[0]
        latest = self.run.latest_checkpoint()
        kept = (f"the last committed checkpoint, step {checkpoint.read_info(latest).step} ({latest}), is intact"
                if latest else "no checkpoint was committed")
        return FailureBudgetError(f"training stopped after {len(failures) or 1} {what}, more than [elastic] {key} = "
                                  f"{limit} allows: {listed}", where=f"[elastic] {key}",
                                  fix=f"{kept}: fix the cause and run again with --resume, or raise {key}")

    def _collect(self, sink, display: ProgressDisplay) -> None:
        new = ray.get(sink.drain.remote())
        if not new:
            return
        self.run.append_metrics(new)
        display.update(new)
        self._rows.extend(new)
        if any(row.get("event") == "checkpoint" for row in new):
            self._committed()
            # Kept current at every commit: a driver killed without warning leaves the report of its last checkpoint.
            self._save_report("running", Plan.load(self.run.plan_path))


def scaling_config(plan: Plan, cfg: JobConfig) -> ScalingConfig:
    """Where Ray Train starts the plan's workers: on the plan's nodes, the group holding the plan's NVLink
    islands (binding.scaling_config_kwargs; each worker then checks the GPU Ray gave it). An elastic CPU
    job may also grow to [cluster] num_workers."""
    scaling = binding.scaling_config_kwargs(plan, elastic_min_workers=cfg.elastic.min_workers or None)
    if cfg.elastic.min_workers and not cfg.cluster.use_gpu:
        scaling["num_workers"] = (cfg.elastic.min_workers, cfg.cluster.num_workers)
    return ScalingConfig(**scaling, elastic_resize_monitor_interval_s=cfg.elastic.resize_check_s)


def _placement_wait_note(cfg: JobConfig) -> str | None:
    """The note for placement groups Ray holds pending (Ray Train places a worker group as one); None if none is."""
    try:
        table = ray.util.placement_group_table()
    except Exception:  # noqa: BLE001 - only a hint: a failed query must not stop the run
        return None
    bundles = [b for group in table.values() if group.get("state") == "PENDING" for b in group["bundles"].values()]
    if not bundles:
        return None
    return coordinator.placement_wait_note(bundles, ray.available_resources(), ray.cluster_resources(),
                                           use_gpu=cfg.cluster.use_gpu)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler stopping the job, `kill`) ends fit as Ctrl-C does: the workers stopped, their rows
    kept, the report written and the --resume line printed. Without it Ray's core worker aborts the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_workers(plan_coordinator, thread: threading.Thread, timeout_s: float = 60.0) -> None:
    """Asks Ray Train's controller to abort the worker group and waits for trainer.fit() to return: workers that
    trained on would commit checkpoints whose rows never reach metrics.jsonl, and the fit thread would call into
    Ray after the driver shut it down (the core worker then kills the process)."""
    try:
        controller = ray.get(plan_coordinator.train_controller.remote(), timeout=10)
        if controller is not None:
            ray.get(controller.abort.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - abort ends the controller's actor: its reply is an actor error
        pass
    thread.join(timeout=timeout_s)


def _fit_into(trainer: TorchTrainer, outcome: dict) -> None:
    try:
        outcome["result"] = trainer.fit()
    except Exception as e:  # handed to the driver thread, which re-raises it
        outcome["error"] = e


def _user_error(error: BaseException) -> ArchipelagoError | None:
    """Finds an ArchipelagoError a worker raised inside Ray's wrappers, so the user sees it as is."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ArchipelagoError):
            return e
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None), getattr(e, "controller_failure", None)])
        stack.extend(getattr(e, "worker_failures", {}).values())
    return None


def _controller_settings(config: JobConfig) -> dict[str, str]:
    """Ray Train settings its controller reads from environment variables only; the trainer copies them
    from the driver's environment into the controller's when the run starts."""
    return {"RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(config.elastic.health_check_timeout_s)}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
