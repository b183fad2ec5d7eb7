"""A run's directory, <runs_dir>/<name>/: metrics.jsonl, report.json, and (by default) its checkpoints.

Checkpoints live in `<storage_path>/<name>/step_*`: the run directory itself by default, or under
`[checkpoint] storage` (another disk, or a pyarrow.fs URI such as s3://…) when set. `storage_path`
is also Ray's RunConfig storage_path, so the workers find the same place through Ray's storage
context. A step without `.metadata` is a save that never committed: it is never picked to resume
from, and the workers delete it when they restore.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from core.atomic import write_text_atomically
from core.errors import CheckpointError, ConfigError
from storage.checkpoint_io import CheckpointStore
from storage.fs import Location


class RunDirectory:
    def __init__(self, runs_dir: str | Path, name: str, checkpoint_storage: str = ""):
        self.path = Path(runs_dir).resolve() / name
        self.name = name
        root = Location.parse(checkpoint_storage, error=ConfigError) if checkpoint_storage else Location.parse(self.path.parent)
        self.checkpoints = CheckpointStore(root / name)

    @property
    def storage_path(self) -> str:
        """The RunConfig storage_path: checkpoints (ours, and Ray's bookkeeping) go into <storage_path>/<name>/."""
        return str(self.checkpoints.root.parent)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def report_path(self) -> Path:
        return self.path / "report.json"

    @property
    def plan_path(self) -> Path:
        return self.path / "plan.json"

    def committed_checkpoints(self) -> list[Path | Location]:
        """Committed checkpoints, oldest first (Paths on local disk); half-written ones are left out."""
        return [_plain(where) for _, where in self.checkpoints.committed()]

    def latest_checkpoint(self) -> Path | Location | None:
        found = self.committed_checkpoints()
        return found[-1] if found else None

    def checkpoint_to_resume(self) -> Path | Location:
        latest = self.latest_checkpoint()
        if latest is None:
            raise CheckpointError("no committed checkpoint to resume from", where=str(self.path),
                                  fix="run without --resume to start this run")
        return latest

    def create(self, *, overwrite: bool) -> None:
        """A fresh, empty run directory; an earlier run's files go only when overwrite is asked for."""
        occupied = [str(p) for p in (self.path,) if p.is_dir() and any(p.iterdir())]
        # The store may be another disk or a URI; a new run there must not resume from an old run's steps.
        # When it is the run directory itself, the check above already looked.
        if self.checkpoints.root != Location.parse(self.path) and self.checkpoints.steps():
            occupied.append(str(self.checkpoints.root))
        if occupied:
            if not overwrite:
                raise ConfigError("the run directory already holds a run", where=" and ".join(occupied),
                                  fix="pass --resume to continue it, --overwrite to delete it and start over, "
                                      "or set another name in the config")
            shutil.rmtree(self.path, ignore_errors=True)
            self.checkpoints.root.remove()
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def job_path(self) -> Path:
        """The job's config as fit ran it (JSON): what `archipelago export` rebuilds the model from."""
        return self.path / "job.json"

    def save_job(self, config: dict) -> None:
        write_text_atomically(self.job_path, json.dumps(config, indent=2))

    def append_metrics(self, rows: list[dict]) -> None:
        with self.metrics_path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    def rewind_metrics(self, step: int) -> None:
        """Steps after the checkpoint were not committed and will be trained again: their rows go."""
        if not self.metrics_path.is_file():
            return
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if r.get("step", 0) <= step]
        write_text_atomically(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))


def _plain(where: Location) -> Path | Location:
    return where.local_path if where.is_local else where
