"""A run's directory, <runs_dir>/<name>/: metrics.jsonl, report.json, and (by default) its checkpoints.

Checkpoints live in `<storage_path>/<name>/step_*`: the run directory itself by default, or under
`[checkpoint] storage` (another disk, or a pyarrow.fs URI such as s3://…) when set. `storage_path`
is also Ray's RunConfig storage_path, so the workers find the same place through Ray's storage
context. A step without `.metadata` is a save that never committed: it is never picked to resume
from, and the workers delete it when they restore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.atomic import write_text_atomically
from core.errors import CheckpointError, ConfigError
from storage.checkpoint_io import CheckpointStore, DamagedStep
from storage.fs import Location

PREVIOUS_SUFFIX = ".previous"
"""The name an earlier run is kept under while `--overwrite` replaces it: `runs/<name>.previous`."""


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

    def checkpoint_to_resume(self) -> tuple[Path | Location, list[DamagedStep]]:
        """The newest committed checkpoint whose files are as they were written, and the newer damaged ones,
        which are moved aside (`step_XXXXXXXX.damaged`) so that no worker loads them."""
        intact, damaged = self.checkpoints.newest_intact()
        if intact is not None:
            return _plain(intact), damaged
        if damaged:
            raise CheckpointError(f"every committed checkpoint is damaged; the newest, step {damaged[0].step}: "
                                  f"{damaged[0].problem}", where=str(self.checkpoints.root),
                                  fix="start over with --overwrite (the damaged steps are kept as step_*.damaged)")
        aside = (f"; {self.previous_path} holds the run an interrupted --overwrite set aside: move it back to "
                 "resume that one" if self.previous_path.exists() else "")
        start = ("run with --overwrite instead of --resume to start it again (what is there is kept until the "
                 "new run commits a checkpoint)" if self.occupied() else "run without --resume to start this run")
        raise CheckpointError("no committed checkpoint to resume from", where=str(self.path), fix=f"{start}{aside}")

    def occupied(self) -> list[str]:
        """Where an earlier run of this name left files: the run directory, and checkpoint storage elsewhere."""
        occupied = [str(p) for p in (self.path,) if p.is_dir() and any(p.iterdir())]
        # The store may be another disk or a URI; a new run there must not resume from an old run's steps.
        # When it is the run directory itself, the check above already looked.
        if self._store_apart and self.checkpoints.steps():
            occupied.append(str(self.checkpoints.root))
        return occupied

    def check_new(self, *, overwrite: bool) -> None:
        """Refuses to start a run over an earlier one unless overwrite is asked for; touches nothing."""
        occupied = self.occupied()
        if occupied and not overwrite:
            raise ConfigError("the run directory already holds a run", where=" and ".join(occupied),
                              fix="pass --resume to continue it, --overwrite to start over (Orchestrator(..., "
                                  "resume=True) or overwrite=True from Python; the old run is kept until the new one "
                                  "commits a checkpoint), or set another name in the config")

    def create(self, *, overwrite: bool) -> SetAside | None:
        """A fresh, empty run directory. With overwrite, an earlier run is moved aside (`<name>.previous`), not
        deleted: the caller discards it once the new run has committed a checkpoint, or restores it."""
        self.check_new(overwrite=overwrite)
        left_aside = any(aside.exists() for _, aside in self._aside_places())
        aside = self._set_aside() if overwrite and (self.occupied() or left_aside) else None
        self.path.mkdir(parents=True, exist_ok=True)
        return aside

    def _set_aside(self) -> SetAside:
        """Moves the earlier run aside. An aside already there is from a replacement that was stopped before it
        committed anything (then the earlier run is the one aside, and what is here goes), or after it
        committed (then what is here is the run to keep, and the aside goes)."""
        replacement_committed = bool(self.checkpoints.committed())
        for here, aside in self._aside_places():
            if not aside.exists():
                here.move_to(aside)
            elif replacement_committed:
                aside.remove()
                here.move_to(aside)
            else:
                here.remove()
        return SetAside(self._aside_places())

    def _aside_places(self) -> list[tuple[Location, Location]]:
        """(where the run is, where it is set aside) for the run directory and checkpoint storage elsewhere."""
        places = [(Location.parse(self.path), Location.parse(self.previous_path))]
        if self._store_apart:
            root = self.checkpoints.root
            places.append((root, root.parent / f"{root.name}{PREVIOUS_SUFFIX}"))
        return places

    @property
    def previous_path(self) -> Path:
        """Where --overwrite keeps the earlier run until the new one commits its first checkpoint."""
        return self.path.with_name(self.path.name + PREVIOUS_SUFFIX)

    @property
    def _store_apart(self) -> bool:
        return self.checkpoints.root != Location.parse(self.path)

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


@dataclass(frozen=True, slots=True)
class SetAside:
    """An earlier run moved out of the way of a new run of the same name (`--overwrite`)."""

    places: list[tuple[Location, Location]]
    """(where the run was, where it is now) for the run directory and checkpoint storage elsewhere."""

    def discard(self) -> None:
        """The new run committed a checkpoint: the earlier run is not needed any more."""
        for _, aside in self.places:
            aside.remove()

    def restore(self) -> None:
        """The new run stopped before it committed anything: its files go, the earlier run comes back."""
        for here, aside in self.places:
            here.remove()
            aside.move_to(here)


def _plain(where: Location) -> Path | Location:
    return where.local_path if where.is_local else where
