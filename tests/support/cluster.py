"""A private Redis Cluster for tests: redis-server nodes on free loopback ports, joined with
``redis-cli --cluster create``, always stopped and removed afterwards.

Tests never touch the machine's shared Redis on 127.0.0.1:6379.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from redis.cluster import RedisCluster

from tests.support.servers import RedisServer, free_port, wait_until


@dataclass(frozen=True)
class ClusterNodeInfo:
    """One line of ``CLUSTER NODES``, reduced to what tests need."""

    node_id: str
    port: int
    is_master: bool
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    def owns(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


@dataclass
class LocalCluster:
    """``masters`` masters, each with ``replicas`` replicas; ``start()`` blocks until every
    node agrees the cluster is up (and every replica is in sync)."""

    masters: int = 3
    replicas: int = 0
    #: How long a silent master stays up before its replicas may take over (ms).
    node_timeout_ms: int = 5000
    nodes: list[RedisServer] = field(default_factory=list)

    def start(self) -> LocalCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not on PATH (scripts/test installs it)")
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                node = RedisServer(
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        # The bus port defaults to port + 10000, which may not exist or be
                        # free; pick one explicitly.
                        "--cluster-port",
                        str(free_port()),
                        "--cluster-node-timeout",
                        str(self.node_timeout_ms),
                        # Let a replica take over however long its link was down: the tests
                        # want to see promotion, not the data-age safety check.
                        "--cluster-replica-validity-factor",
                        "0",
                    ]
                )
                self.nodes.append(node.start())
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{node.port}" for node in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            wait_until(self.is_healthy, timeout=60, interval=0.1, message="cluster_state:ok")
        except BaseException:
            self.cleanup()
            raise
        return self

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node as a seed."""
        seeds = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://{seeds}/0"

    def client(self, **kwargs: Any) -> RedisCluster:
        live = next(node for node in self.nodes if node.process is not None)
        return RedisCluster(
            host="127.0.0.1", port=live.port, socket_timeout=5, socket_connect_timeout=5, **kwargs
        )

    def live_nodes(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None]

    def topology(self) -> list[ClusterNodeInfo]:
        """The cluster as a live node sees it (failed nodes included, flagged as they are)."""
        probe = self.live_nodes()[0].client()
        try:
            nodes: dict[str, dict[str, Any]] = probe.cluster("NODES")
        finally:
            probe.close()
        return [_node_info(address, node) for address, node in nodes.items()]

    def masters_info(self) -> list[ClusterNodeInfo]:
        return [info for info in self.topology() if info.is_master and info.slots]

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def is_healthy(self) -> bool:
        """Every live node says ``cluster_state:ok`` and every live replica is in sync."""
        expected = len(self.live_nodes())
        for node in self.live_nodes():
            probe = node.client()
            try:
                info: dict[str, str] = probe.cluster("INFO")
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                    return False
                if int(info.get("cluster_known_nodes", 0)) < expected:
                    return False
                replication = probe.info("replication")
                if replication.get("role") == "slave" and (
                    replication.get("master_link_status") != "up"
                ):
                    return False
            finally:
                probe.close()
        return True

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        self.nodes.clear()


def _node_info(address: str, node: dict[str, Any]) -> ClusterNodeInfo:
    flags = str(node["flags"]).split(",")
    slots = tuple((int(spec[0]), int(spec[-1])) for spec in node.get("slots", []))
    return ClusterNodeInfo(
        node_id=str(node["node_id"]),
        port=int(address.split("@", 1)[0].rsplit(":", 1)[1]),
        is_master="master" in flags and "fail" not in flags,
        master_id=None if node["master_id"] == "-" else str(node["master_id"]),
        slots=slots,
    )
