"""A run's directory, <runs_dir>/<name>/: metrics.jsonl, report.json, and Ray's checkpoint folders.

Ray Train keeps its own bookkeeping here too (the checkpoint manager snapshot), which is how a
restarted run with the same name finds its checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from orchestrator.errors import CheckpointError, ConfigError
from workers import checkpoint


class RunDirectory:
    def __init__(self, runs_dir: str | Path, name: str):
        self.path = Path(runs_dir).resolve() / name
        self.name = name

    @property
    def storage_path(self) -> str:
        """The RunConfig storage_path: Ray writes checkpoints into <storage_path>/<name>/."""
        return str(self.path.parent)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def report_path(self) -> Path:
        return self.path / "report.json"

    def committed_checkpoints(self) -> list[Path]:
        """Committed checkpoints, oldest first; half-written ones (no .metadata yet) are left out."""
        if not self.path.is_dir():
            return []
        return sorted(p for p in self.path.glob("step_*") if checkpoint.is_committed(p))

    def latest_checkpoint(self) -> Path | None:
        found = self.committed_checkpoints()
        return found[-1] if found else None

    def checkpoint_to_resume(self) -> Path:
        latest = self.latest_checkpoint()
        if latest is None:
            raise CheckpointError("no committed checkpoint to resume from", where=str(self.path),
                                  fix="run without --resume to start this run")
        return latest

    def create(self, *, overwrite: bool) -> None:
        """A fresh, empty run directory; an earlier run's files go only when overwrite is asked for."""
        if self.path.is_dir() and any(self.path.iterdir()):
            if not overwrite:
                raise ConfigError("the run directory already holds a run", where=str(self.path),
                                  fix="pass --resume to continue it, --overwrite to delete it and start over, "
                                      "or set another name in the config")
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

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
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
