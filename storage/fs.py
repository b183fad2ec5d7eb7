"""Where bytes live: a local path or a pyarrow.fs URI (s3://, gs://, hdfs://), behind one small type.

    Location.parse("data/stdlib-bytes")                       # local disk
    Location.parse("s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http")

Datasets and checkpoints are addressed by a `Location`, so the same code reads a local dataset,
a dataset in S3, a checkpoint on NFS or one in GCS. Query parameters of a URI (S3 endpoint,
region, scheme) are kept when a location is joined, so a child prints and parses back as itself.
Storage that cannot be reached (an endpoint that refuses, bad credentials) raises the typed error
the location was parsed with — DataError for a dataset, CheckpointError for checkpoints — not an
OSError traceback.
"""

from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from core.errors import ArchipelagoError

GCS_RETRY_LIMIT_S = 30.0
"""How long a gs:// request retries when the URI's retry_limit_seconds does not say: pyarrow's own limit
is 15 minutes, spent in silence when the network or the credentials are missing."""


@dataclass(frozen=True)
class Location:
    fs: pafs.FileSystem = field(compare=False)
    path: str
    """The path inside `fs` (absolute for the local filesystem, "bucket/key" for object stores)."""
    scheme: str = ""
    """"" for local paths, else the URI scheme ("s3", "gs", "hdfs", ...)."""
    query: str = ""
    """The URI's query string, kept so that joined locations parse back to the same filesystem."""
    error: type[ArchipelagoError] = field(default=ArchipelagoError, compare=False, repr=False)
    """What a failure to reach the storage raises: the type the location was parsed with (DataError
    for a dataset, CheckpointError for checkpoints), kept by every location joined from this one."""

    @classmethod
    def parse(cls, where: str | Path | Location, *, error: type[ArchipelagoError] | None = None) -> Location:
        """A location for a path or URI; `error` is the type of the errors it raises (a Location passed
        in keeps its own unless `error` is given)."""
        if isinstance(where, Location):
            return where if error in (None, where.error) else dataclasses.replace(where, error=error)
        error = error or ArchipelagoError
        text = str(where)
        if "://" not in text or text.startswith("file://"):
            local = Path(text.removeprefix("file://")).expanduser().resolve()
            return cls(pafs.LocalFileSystem(), local.as_posix(), error=error)
        scheme, rest = text.split("://", 1)
        _, _, query = rest.partition("?")
        authority, _, after = rest.partition("/")
        if "@" in authority.partition("?")[0]:
            # Never echo them: the message is printed, and the URI is what plan.json and report.json hold.
            raise error("the URI holds credentials (user:secret@ before the bucket or host), which would be "
                        "printed in plan.json, report.json, the progress output and Ray's logs",
                        where=f"{scheme}://***@{authority.rsplit('@', 1)[1]}/{after}".rstrip("/"),
                        fix="remove them from the URI and give them in the environment (AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY for s3://) or the cloud's own credential files")
        uri = text
        if scheme in ("gs", "gcs") and "retry_limit_seconds" not in query:
            uri += ("&" if query else "?") + f"retry_limit_seconds={GCS_RETRY_LIMIT_S:g}"
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
            raise error(f"cannot open {scheme}:// storage ({e})", where=text,
                        fix="check the URI, its query parameters and the credentials in the environment") from None
        return cls(fs, path.rstrip("/"), scheme, query, error)

    @classmethod
    def of(cls, fs: pafs.FileSystem, path: str) -> Location:
        """A location for a (filesystem, path) pair, such as the run storage Ray's train context gives a worker."""
        if isinstance(fs, pafs.LocalFileSystem):
            return cls(fs, Path(path).resolve().as_posix())
        return cls(fs, path.rstrip("/"), fs.type_name)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def local_path(self) -> Path:
        if not self.is_local:
            raise ValueError(f"{self} is not on the local filesystem")
        return Path(self.path)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Location:
        return dataclasses.replace(self, path=posixpath.dirname(self.path))

    def __truediv__(self, part: str) -> Location:
        return dataclasses.replace(self, path=posixpath.join(self.path, part))

    def __str__(self) -> str:
        if not self.scheme:
            return self.path
        return f"{self.scheme}://{self.path}" + (f"?{self.query}" if self.query else "")

    def info(self) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(self.path)
        except OSError as e:
            raise self._unreachable(e) from None

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def children(self) -> list[Location]:
        """Direct children, sorted by name; empty when the directory does not exist."""
        if not self.is_dir():
            return []
        return sorted((dataclasses.replace(self, path=i.path) for i in self.listing()), key=lambda c: c.path)

    def listing(self) -> list[pafs.FileInfo]:
        """What the directory holds (name, type, size of each entry) in one listing; empty when it does not exist."""
        try:
            return self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except OSError as e:
            raise self._unreachable(e) from None

    def _unreachable(self, e: OSError) -> ArchipelagoError:
        # An endpoint that refuses, a network that is down and rejected credentials all arrive as OSError.
        return self.error(f"cannot reach storage ({e})", where=str(self),
                          fix="check the endpoint, network and credentials")

    def read_bytes(self) -> bytes:
        with self.fs.open_input_file(self.path) as f:
            return f.read()

    def mkdir(self) -> None:
        self.fs.create_dir(self.path, recursive=True)

    def move_to(self, target: Location) -> None:
        """Moves this file or directory to `target` on the same storage (a missing one is fine): a rename on
        local disk; file by file on object stores, which have no directories to rename."""
        info = self.info()
        if info.type == pafs.FileType.NotFound:
            return
        try:
            if self.is_local or info.type == pafs.FileType.File:
                self.fs.move(self.path, target.path)
                return
            for item in self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True)):
                if item.type == pafs.FileType.File:
                    self.fs.move(item.path, target.path + item.path[len(self.path):])
        except OSError as e:
            raise self.error(f"cannot move it to {target} ({e})", where=str(self),
                             fix="check the storage's permissions and free space") from None
        self.remove()

    def remove(self) -> None:
        """Deletes a file or a whole directory; a missing one is fine."""
        kind = self.info().type
        if kind == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif kind == pafs.FileType.File:
            self.fs.delete_file(self.path)
