"""Writing files so that a reader never sees half of one: write beside it, then rename over it."""

from __future__ import annotations

from pathlib import Path


def write_text_atomically(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # rename is atomic on POSIX file systems
    return path
