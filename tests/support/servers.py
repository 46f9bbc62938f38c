"""Private redis-server processes for tests: free loopback ports, temp dirs, always stopped.

Tests never touch the machine's shared Redis on 127.0.0.1:6379.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

#: Where test servers listen: below the kernel's ephemeral range (32768-60999 here), so no
#: client socket takes a stopped server's port, and split between pytest-xdist's workers, so
#: a server one worker stops and restarts (a fault test) never finds another's in its place.
#: ``CHECKPOINTQ_TEST_PORT_SLOT`` shifts this run's slots, so that test runs from two
#: checkouts at once (gw0 of each) keep apart too.
PORTS_FROM, PORTS_PER_WORKER, WORKER_SLOTS = 10_000, 2_000, 10
_next_port = itertools.count(random.randrange(PORTS_PER_WORKER))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, in this worker's range.

    Ports are handed out in turn (not at random), so a port is reused as late as possible.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    slot = (worker + int(os.environ.get("CHECKPOINTQ_TEST_PORT_SLOT", "0"))) % WORKER_SLOTS
    first = PORTS_FROM + slot * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_next_port) % PORTS_PER_WORKER
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")


def command_calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran ``command`` (lower case) since its statistics were
    reset, scripts' calls included (INFO commandstats)."""
    stats: dict[str, Any] = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0))


def wait_until(
    predicate: object, timeout: float = 10.0, interval: float = 0.02, message: str = "condition"
) -> None:
    """Poll ``predicate`` until it returns truthy, or fail after ``timeout`` seconds."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:  # remembered, reported on timeout
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}") from last_error


def end_process(process: subprocess.Popen[Any], *, kill: bool = False) -> None:
    """Ask a server process to stop (SIGTERM, or SIGKILL with ``kill``) and wait for it;
    kill it if it has not exited after 10 s."""
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@dataclass
class RedisServer:
    """One redis-server process; ``start()`` may be called again after ``stop()``."""

    port: int = field(default_factory=free_port)
    appendonly: bool = False
    password: str | None = None
    extra_args: list[str] = field(default_factory=list)
    #: More environment for the server process (tests/history moves its clock).
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cq-redis-")))
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5
        )

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH (scripts/test installs it)")
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--logfile",
            str(self.workdir / "redis.log"),
            *(["--requirepass", self.password] if self.password else []),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        probe = self.client()
        try:
            wait_until(probe.ping, timeout=10, message=f"redis-server on port {self.port}")
        finally:
            probe.close()
        return self

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None:
            return
        end_process(self.process, kill=kill)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class SilentListener:
    """A TCP server on a free loopback port that accepts connections and never answers:
    the broker whose every wait must be bounded. Counts the connections it accepted."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.port: int = self._socket.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self._socket.close()
        for conn in self._held:
            conn.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> SilentListener:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
