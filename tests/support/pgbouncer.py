"""A private PgBouncer for tests: Debian's ``pgbouncer`` (scripts/setup-env installs it), in
front of a private PostgreSQL server, on a free loopback port, always stopped.

PgBouncer refuses to run as root, so when the tests run as root it runs as the
``postgres`` user the PostgreSQL package creates (as the server does), with its files in a
directory handed to that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.postgres import PostgresServer, as_server_user
from tests.support.servers import end_process, free_port, wait_until

_CONF = """
[databases]
* = host=127.0.0.1 port={server_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory}/users.txt
pool_mode = {mode}
default_pool_size = {pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 200
server_check_delay = 1
ignore_startup_parameters = extra_float_digits
logfile = {directory}/pgbouncer.log
pidfile =
"""


def pgbouncer_bin() -> str | None:
    return shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )


def require_pgbouncer() -> str:
    """The ``pgbouncer`` program, or skip saying what to install (setup-env installs it
    where it can: as root, with apt)."""
    found = pgbouncer_bin()
    if found is None:
        pytest.skip("pgbouncer is missing (apt-get install pgbouncer; scripts/setup-env does)")
    return found


def version() -> str:
    """``pgbouncer --version``'s first line (e.g. ``PgBouncer 1.18.0``)."""
    out = subprocess.run([require_pgbouncer(), "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0].strip() if out.stdout else "unknown"


@dataclass
class PgBouncer:
    """PgBouncer in ``mode`` (``transaction`` or ``session``) in front of ``server``, with
    ``pool_size`` server connections per user and database: fewer than the clients in
    transaction mode, so that their transactions take turns on them."""

    server: PostgresServer
    mode: str = "transaction"
    pool_size: int = 2
    port: int = field(default_factory=free_port)
    directory: Path = field(init=False)
    process: subprocess.Popen[bytes] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._bin = require_pgbouncer()
        self.directory = Path(tempfile.mkdtemp(prefix="checkpointq-pgbouncer-"))
        conf = _CONF.format(
            server_port=self.server.port,
            port=self.port,
            directory=self.directory,
            mode=self.mode,
            pool_size=self.pool_size,
        )
        (self.directory / "pgbouncer.ini").write_text(conf)
        (self.directory / "users.txt").write_text('"postgres" ""\n')
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            for path in (self.directory, *self.directory.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> PgBouncer:
        self.process = subprocess.Popen(
            [*as_server_user(), self._bin, str(self.directory / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._listening, timeout=20, message=f"pgbouncer on port {self.port}")
        return self

    def _listening(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited {self.process.returncode}: {self.log()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            end_process(self.process)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
