"""Private PostgreSQL servers for tests: initdb and pg_ctl from Debian's ``postgresql``
package, a temp directory, a free loopback port, always stopped.

Tests never touch the machine's shared PostgreSQL on 5432. PostgreSQL refuses to run as
root, so when the tests run as root the server runs as the ``postgres`` user the package
creates, in a directory handed to it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.servers import free_port, wait_until

#: Settings for a test server: small, quick to start, durable (fsync stays on, so that the
#: benchmarks measure commits as a deployment pays them).
_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{sockets}'
max_connections = {max_connections}
shared_buffers = 64MB
fsync = on
synchronous_commit = on
logging_collector = off
log_min_messages = warning
wal_level = replica
max_wal_senders = 4
hot_standby = on
"""


def postgres_bin() -> Path | None:
    """The directory of Debian's PostgreSQL server programs (the newest), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def require_postgres() -> Path:
    """The server programs' directory, or skip the test saying what to install."""
    found = postgres_bin()
    if found is None:
        pytest.skip("PostgreSQL's server programs are missing (apt-get install postgresql)")
    return found


def as_server_user() -> list[str]:
    """The prefix that runs a command as the user PostgreSQL runs as (not root)."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


@dataclass
class PostgresServer:
    """One PostgreSQL server; ``start()`` may be called again after ``stop()``.

    ``standby_of``: make this server a streaming replica of another (``pg_basebackup``), for
    tests that promote it after a failover.
    """

    port: int = field(default_factory=free_port)
    max_connections: int = 50
    standby_of: PostgresServer | None = None
    #: A standby's physical replication slot on its primary (``pg_basebackup -C -S``): the
    #: primary then knows the standby, and keeps its WAL, while it is down.
    slot: str | None = None
    #: More environment for the server's processes (tests/history moves its clock with
    #: LD_PRELOAD): pg_ctl hands its own environment to the postmaster, and runuser passes
    #: it on to pg_ctl.
    env: dict[str, str] = field(default_factory=dict)
    directory: Path = field(init=False)
    _bin: Path = field(init=False)
    #: A standby's own ``primary_conninfo`` while ``disconnect`` replaced it.
    _conninfo: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._bin = require_postgres()
        self.directory = Path(tempfile.mkdtemp(prefix="checkpointq-pg-"))
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)
        self.data = self.directory / "data"
        self._init()

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*as_server_user(), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=check,
            cwd=self.directory,
            env={**os.environ, **self.env} if self.env else None,
        )

    def _init(self) -> None:
        if self.standby_of is None:
            self._run(
                str(self._bin / "initdb"),
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            )
        else:
            slot = ["-C", "-S", self.slot] if self.slot else []
            self._run(
                str(self._bin / "pg_basebackup"),
                "-d",
                self.standby_of.url,
                "-D",
                str(self.data),
                "-R",
                "-X",
                "stream",
                *slot,
            )
        conf = _CONF.format(
            port=self.port, sockets=self.directory, max_connections=self.max_connections
        )
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as handle:
            handle.write(conf)
        # Replication from loopback for a standby made of this server (trust, as the rest).
        with open(self.data / "pg_hba.conf", "a", encoding="utf-8") as handle:
            handle.write("host replication all 127.0.0.1/32 trust\n")

    def start(self) -> PostgresServer:
        self._run(
            str(self._bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.directory / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        wait_until(self.ready, timeout=30, message=f"PostgreSQL on port {self.port}")
        return self

    def ready(self) -> bool:
        result = self._run(
            str(self._bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), check=False
        )
        return result.returncode == 0

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (clean), or ``immediate`` (as a crash: recovery on start)."""
        self._run(
            str(self._bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False
        )

    def disconnect(self) -> None:
        """A standby stops receiving WAL (its primary is unreachable to it): it lags from
        now on, until ``reconnect``."""
        if self._conninfo is None:
            self._conninfo = self.psql("SHOW primary_conninfo")
        self._set_conninfo("host=127.0.0.1 port=1")

    def reconnect(self) -> None:
        """A standby ``disconnect`` cut off streams again (nothing for any other)."""
        if self._conninfo is not None:
            self._set_conninfo(self._conninfo)
            self._conninfo = None

    def _set_conninfo(self, conninfo: str) -> None:
        quoted = conninfo.replace("'", "''")
        self.psql(f"ALTER SYSTEM SET primary_conninfo = '{quoted}'")
        self.psql("SELECT pg_reload_conf()")

    def promote(self) -> None:
        """Promote a standby: it takes writes from now on."""
        self._run(str(self._bin / "pg_ctl"), "-D", str(self.data), "-w", "promote")

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` as the superuser; its output, unaligned, without headers."""
        result = self._run(
            str(self._bin / "psql"),
            "-X",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            self.dsn(database),
            "-c",
            sql,
        )
        return result.stdout.strip()

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        self.psql(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def log(self) -> str:
        path = self.directory / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cleanup(self) -> None:
        self.stop(mode="immediate")
        shutil.rmtree(self.directory, ignore_errors=True)
