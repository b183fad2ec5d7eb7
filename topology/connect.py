"""Joining a Ray cluster within a time limit, or starting an embedded one, and leaving nothing behind.

    with ray_session("10.0.0.1:6379", connect_timeout_s=30):          # a running cluster
        ...
    with ray_session("", embedded={"num_cpus": 4, "num_gpus": 0}):    # a local cluster for this process only
        ...

`ray.init` on an address nobody answers at retries for minutes and prints a warning every five
seconds. Here the address is tried first with a plain TCP connection (a refusal or silence is told
at once, in one line), then with a gRPC handshake (a port that accepts but is no Ray head), and the
join itself runs under the same deadline; Ray's own messages during the join are kept off the
terminal unless `verbose`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import ray

from core.errors import ClusterError, ConfigError
from topology import ray_processes

CONNECT_TIMEOUT_S = 30.0
"""How long joining a running cluster may take by default ([cluster] connect_timeout_s, --connect-timeout)."""
EMBEDDED_EXIT_S = 10.0
"""How long an embedded cluster's processes get to exit after ray.shutdown() before they are killed."""
_LONGER = "--connect-timeout / [cluster] connect_timeout_s"
_FIX = ("check the address (`ray start --head` prints it), or leave --address, RAY_ADDRESS and [cluster] address "
        "unset to start an embedded cluster")


@contextlib.contextmanager
def ray_session(address: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, embedded: dict | None = None,
                verbose: bool = False, py_modules: list | None = None) -> Iterator[None]:
    """Joins the cluster at `address` ("auto", "ray://host:10001", host:port), or for "" starts an embedded
    cluster with the `ray.init` options `embedded`; shuts Ray down when the block ends, however it ends, and
    returns only once the embedded cluster's processes have exited (killed after EMBEDDED_EXIT_S).
    py_modules: code Ray ships with the job to every worker (the user's model module)."""
    check_seconds(connect_timeout_s, "--connect-timeout / [cluster] connect_timeout_s")
    options = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING,
               **({"runtime_env": {"py_modules": py_modules}} if py_modules else {})}
    before = []
    if address:
        _join(address, connect_timeout_s, options, verbose)
    else:
        before = ray_processes.descendants(os.getpid())
        with _quiet_default_token_auth():
            ray.init(address="local", include_dashboard=False, **options, **(embedded or {}))
    try:
        yield
    finally:
        # The embedded cluster's processes: those Ray started under this one during the session.
        started = [] if address else ray_processes.started_since(before, ray_processes.descendants(os.getpid()))
        cluster = [p for p in started if ray_processes.is_ray(p)]
        ray.shutdown()
        ray_processes.end(cluster, EMBEDDED_EXIT_S)


class _DefaultTokenAuthNotice(logging.Filter):
    """Ray 2.60 turns token authentication on for a new local cluster and says so in a WARNING line; an
    embedded cluster wants it on, so the line only alarms. Any other message of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


@contextlib.contextmanager
def _quiet_default_token_auth() -> Iterator[None]:
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice = _DefaultTokenAuthNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def check_seconds(seconds: float, where: str) -> None:
    """A time limit is a finite number of seconds above 0: no limit at all would let a command hang."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"must be a number of seconds above 0, got {seconds:g}", where=where,
                          fix="give a time limit in seconds, e.g. 30")


def _join(address: str, timeout_s: float, options: dict, verbose: bool) -> None:
    deadline = time.monotonic() + timeout_s
    if address != "auto":
        host_port = address.removeprefix("ray://")
        _answers(host_port, address, timeout_s)
        _speaks_grpc(host_port, address, timeout_s, deadline)
    outcome: dict = {}

    def join() -> None:
        try:
            ray.init(address=address, **options)
        except Exception as e:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = e

    with _quiet_stderr(not verbose):
        thread = threading.Thread(target=join, name="archipelago-ray-join", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise ClusterError(f"joining the Ray cluster did not finish within {timeout_s:g} s", where=f"address {address!r}",
                           fix=f"{_FIX}; or allow longer with {_LONGER}")
    if "error" in outcome:
        first_line = (str(outcome["error"]).strip().splitlines() or [type(outcome["error"]).__name__])[0]
        raise ClusterError(f"cannot join the Ray cluster ({first_line})", where=f"address {address!r}", fix=_FIX)


def _answers(host_port: str, address: str, timeout_s: float) -> None:
    """A TCP connection to the head's port opens within the time limit (ClusterError otherwise)."""
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError("not a host:port address", where=f"address {address!r}",
                           fix='write it as HOST:PORT (e.g. 10.0.0.1:6379), "ray://HOST:10001" or "auto"')
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except TimeoutError:
        raise ClusterError(f"nothing answered within {timeout_s:g} s", where=f"address {address!r}",
                           fix=f"{_FIX}; or allow longer with {_LONGER}") from None
    except OSError as e:
        raise ClusterError(f"cannot connect ({e.strerror or e})", where=f"address {address!r}", fix=_FIX) from None


def _speaks_grpc(host_port: str, address: str, timeout_s: float, deadline: float) -> None:
    """The port answers as a gRPC server (a Ray head's GCS, or a Ray Client server) before the deadline: a web
    server or a port that accepts and stays silent would leave Ray's join retrying. Skipped under RAY_USE_TLS,
    whose handshake this plain channel cannot make."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return
    channel = grpc.insecure_channel(host_port)
    try:
        grpc.channel_ready_future(channel).result(timeout=max(0.0, deadline - time.monotonic()))
    except grpc.FutureTimeoutError:
        raise ClusterError(f"something answers at the port, but no Ray head: no gRPC handshake within {timeout_s:g} s",
                           where=f"address {address!r}", fix=f"{_FIX}; or allow longer with {_LONGER}") from None
    finally:
        channel.close()


@contextlib.contextmanager
def _quiet_stderr(quiet: bool) -> Iterator[None]:
    """Ray's C++ core writes its retries straight to file descriptor 2: keep them in a temporary file while joining."""
    if not quiet:
        yield
        return
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
