"""Reading and writing the files archipelago keeps (topology maps, plans, tables).

Writes are atomic, so that a reader never sees half of one: write beside it, then rename over it.
Reads turn every way a path can fail to be a readable text file into the caller's typed error.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import ArchipelagoError


def write_text_atomically(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # rename is atomic on POSIX file systems
    return path


def read_text(path: str | Path, *, error: type[ArchipelagoError], fix: str) -> str:
    """The file's text; `error` (TopologyError, PlacementError, …) with `fix` when it is missing,
    a directory, unreadable, or not UTF-8 text."""
    try:
        return Path(path).read_text()
    except OSError as e:  # FileNotFoundError, IsADirectoryError, PermissionError, …
        raise error(f"cannot read it ({e.strerror or e})", where=str(path), fix=fix) from None
    except UnicodeDecodeError as e:
        raise error(f"not text: byte {e.start} is not UTF-8", where=str(path), fix=fix) from None
