"""A private Redis Sentinel group for tests: a master, its replicas and three sentinels on
free loopback ports, in temp dirs, always stopped and removed afterwards.

Tests never touch the machine's shared Redis on 127.0.0.1:6379.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.support.servers import RedisServer, free_port, wait_until

#: The name the sentinels monitor the master under.
MASTER_NAME = "cq-broker"


@dataclass
class SentinelProcess:
    """One ``redis-server --sentinel`` with its own (rewritable) config file."""

    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cq-sentinel-")))
    process: subprocess.Popen[bytes] | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, master_port: int, *, down_after_ms: int, quorum: int) -> SentinelProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH (scripts/test installs it)")
        config = self.workdir / "sentinel.conf"
        config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.workdir}\n"
            f"logfile {self.workdir / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}\n"
            f"sentinel failover-timeout {MASTER_NAME} {max(3000, 3 * down_after_ms)}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        self.process = subprocess.Popen(
            [binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = self.client()
        try:
            wait_until(probe.ping, timeout=10, message=f"sentinel on port {self.port}")
        finally:
            probe.close()
        return self

    def master_port(self) -> int | None:
        """The master's port as this sentinel sees it now."""
        probe = self.client()
        try:
            address: Any = probe.sentinel_get_master_addr_by_name(MASTER_NAME)
        finally:
            probe.close()
        return int(address[1]) if address else None

    def cleanup(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class SentinelGroup:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels (quorum: a majority).

    ``start()`` returns once every replica is in sync and every sentinel knows the replicas
    and the other sentinels: only then can a failover happen.
    """

    replicas: int = 1
    sentinels: int = 3
    #: How long the master must be silent before the sentinels call it down (ms).
    down_after_ms: int = 1000
    master: RedisServer | None = None
    replica_servers: list[RedisServer] = field(default_factory=list)
    sentinel_processes: list[SentinelProcess] = field(default_factory=list)

    def start(self) -> SentinelGroup:
        try:
            self.master = RedisServer().start()
            for _ in range(self.replicas):
                replica = RedisServer(
                    extra_args=["--replicaof", "127.0.0.1", str(self.master.port)]
                )
                self.replica_servers.append(replica.start())
            quorum = self.sentinels // 2 + 1
            for _ in range(self.sentinels):
                sentinel = SentinelProcess().start(
                    self.master.port, down_after_ms=self.down_after_ms, quorum=quorum
                )
                self.sentinel_processes.append(sentinel)
            wait_until(self.is_ready, timeout=30, interval=0.1, message="sentinel group ready")
        except BaseException:
            self.cleanup()
            raise
        return self

    @property
    def broker_url(self) -> str:
        """kombu's spelling: one ``sentinel://`` URL per sentinel, joined by ``;``."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}/0" for s in self.sentinel_processes)

    def servers(self) -> list[RedisServer]:
        assert self.master is not None
        return [self.master, *self.replica_servers]

    def current_master(self) -> RedisServer:
        """The data server the sentinels currently name as master."""
        port = self.sentinel_processes[0].master_port()
        return next(server for server in self.servers() if server.port == port)

    def is_ready(self) -> bool:
        """Every running server but the master replicates it, and every sentinel knows
        the replicas and the other sentinels."""
        master = self.current_master()
        for server in self.servers():
            if server is master or server.process is None:
                continue
            probe = server.client()
            try:
                info = probe.info("replication")
            finally:
                probe.close()
            if info.get("role") != "slave" or info.get("master_link_status") != "up":
                return False
            if int(info.get("master_port", 0)) != master.port:
                return False
        for sentinel in self.sentinel_processes:
            probe = sentinel.client()
            try:
                state: Any = probe.sentinel_master(MASTER_NAME)
            finally:
                probe.close()
            if int(state["port"]) != master.port or int(state["num-slaves"]) < self.replicas:
                return False
            if int(state["num-other-sentinels"]) < self.sentinels - 1:
                return False
        return True

    def fail_master(self) -> RedisServer:
        """``kill -9`` the master; return it (``start()`` it again to rejoin as a replica)."""
        master = self.current_master()
        master.stop(kill=True)
        return master

    def promoted(self, old: RedisServer) -> bool:
        """Whether every sentinel names a master other than ``old``."""
        return all(s.master_port() not in (None, old.port) for s in self.sentinel_processes)

    def cleanup(self) -> None:
        for sentinel in self.sentinel_processes:
            sentinel.cleanup()
        self.sentinel_processes.clear()
        for server in self.servers() if self.master else []:
            server.cleanup()
        self.replica_servers.clear()
        self.master = None
