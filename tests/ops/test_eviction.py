"""A broker or store whose maxmemory-policy may evict keys: the worker warns at start-up and
``checkpointq health`` warns too, without failing (Given/When/Then, real redis-servers)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import closing

import pytest

from checkpointq.worker.ops import eviction
from checkpointq.worker.settings import Settings
from tests.ops.conftest import System, start_system
from tests.support.cluster import LocalCluster
from tests.support.servers import RedisServer, free_port, wait_until

VOLATILE = ["--maxmemory-policy", "volatile-lru", "--maxmemory", "64mb"]


@pytest.fixture
def evicting() -> Iterator[System]:
    """A broker and a store that evict keys with a TTL once they hold 64 MB."""
    live = start_system(VOLATILE)
    try:
        yield live
    finally:
        live.close()


def _configure(server: RedisServer, policy: str) -> None:
    with closing(server.client()) as client:
        client.config_set("maxmemory-policy", policy)


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "maxmemory-policy" in line]


def test_a_worker_warns_once_per_redis_that_may_evict_and_health_warns_without_failing(
    evicting: System,
) -> None:
    # Given a broker and a store under volatile-lru, and no worker yet
    broker, store = evicting.broker.url, evicting.store.url

    # When health runs before any worker: it fails for the missing worker alone
    early = evicting.cli("health")

    # Then the failure is still one line on stderr, and the warnings are on stdout
    assert early.returncode == 1
    assert len(early.stderr.strip().splitlines()) == 1, early.stderr
    assert "no worker heartbeat" in early.stderr and "maxmemory" not in early.stderr
    assert [line.split(" has ")[0] for line in early.stdout.splitlines()] == [
        f"warning: broker {broker}",
        f"warning: store {store}",
    ]

    # When a worker starts
    worker = evicting.start_worker()
    wait_until(lambda: evicting.cli("health").returncode == 0, timeout=30, message="healthy")

    # Then its log names each Redis once, at WARNING, with what it may drop and the fix
    lines = _warnings(worker.log())
    assert len(lines) == 2, worker.log()
    for line in lines:
        assert "WARNING" in line and "volatile-lru and maxmemory 64.0 MiB" in line
        assert "fix: set maxmemory-policy noeviction" in line
    broker_line, store_line = (
        line[line.index(f"{role} redis://") :]
        for role, line in zip(("broker", "store"), lines, strict=True)
    )
    assert broker_line.startswith(f"broker {broker} has maxmemory-policy")
    assert "pending records and staged saves' values" in broker_line
    assert store_line.startswith(f"store {store} has maxmemory-policy")
    assert "checkpoints, fences and tombstones" in store_line

    # And health passes (exit 0), printing the same warnings after its status line
    healthy = evicting.cli("health")
    assert healthy.returncode == 0, healthy.stderr
    status, *warned = healthy.stdout.splitlines()
    assert status.startswith("healthy: ")
    assert warned == [f"warning: {broker_line}", f"warning: {store_line}"]
    report = json.loads(evicting.cli("health", "--json").stdout)
    assert report["ok"] is True
    assert [(w["redis"], w["policy"], w["maxmemory"]) for w in report["warnings"]] == [
        ("broker", "volatile-lru", 64 * 1024 * 1024),
        ("store", "volatile-lru", 64 * 1024 * 1024),
    ]
    assert report["warnings"][0]["where"] == broker


def test_noeviction_servers_give_no_warning(system: System) -> None:
    # Given a broker and a store under Redis's default policy, noeviction, and a worker
    worker = system.start_worker()
    wait_until(lambda: system.cli("health").returncode == 0, timeout=30, message="healthy")

    # When health runs
    healthy = system.cli("health")
    report = json.loads(system.cli("health", "--json").stdout)

    # Then nobody warns: not the worker's log, not health's text, not its JSON
    assert _warnings(worker.log()) == []
    assert len(healthy.stdout.splitlines()) == 1 and "warning" not in healthy.stdout
    assert report["warnings"] == []


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = RedisServer().start()
    try:
        yield started
    finally:
        started.cleanup()


def test_one_redis_as_broker_and_store_is_one_warning_naming_both(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Given one Redis, broker and store, that evicts any key but has no limit yet
    _configure(server, "allkeys-lru")
    settings = Settings(broker_url=server.url)

    # When the worker's start-up check runs
    with caplog.at_level(logging.WARNING, logger=eviction.__name__):
        eviction.log_startup_warnings(settings)

    # Then one line names both roles, says nothing is evicted yet, and what a limit risks
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith(f"broker and store {server.url} has maxmemory-policy allkeys-lru")
    assert "maxmemory 0 (no limit: nothing is evicted yet): once a limit is set" in line
    assert "queued and unacknowledged requests" in line and "the session index" in line


def test_the_policy_is_read_with_config_get_when_info_is_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a Redis that refuses INFO (as some managed services do), and one that refuses both
    no_info = RedisServer(extra_args=[*VOLATILE, "--rename-command", "INFO", ""]).start()
    mute = RedisServer(
        extra_args=[*VOLATILE, "--rename-command", "INFO", "", "--rename-command", "CONFIG", ""]
    ).start()
    try:
        # When their policies are read
        with (
            closing(no_info.client()) as first,
            closing(mute.client()) as second,
            caplog.at_level(logging.DEBUG, logger=eviction.__name__),
        ):
            read = eviction.read_policy(first)
            unread = eviction.warnings_for(("store",), mute.url, second)

        # Then CONFIG GET answers for the first; the second is passed over, said at DEBUG
        assert read == eviction.MemoryPolicy("volatile-lru", 64 * 1024 * 1024)
        assert unread == []
        debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
        assert f"maxmemory-policy of store {mute.url} unknown: not checked" in debug
    finally:
        no_info.cleanup()
        mute.cleanup()


def test_each_primary_of_a_cluster_store_is_read() -> None:
    # Given a three-node cluster whose nodes evict keys with a TTL
    cluster = LocalCluster(masters=3).start()
    try:
        for node in cluster.nodes:
            _configure(node, "volatile-ttl")

        # When the store's policy is read through the cluster client
        with closing(cluster.client()) as client:
            found = eviction.warnings_for(("store",), cluster.url, client)

        # Then each primary gets its own warning, naming the node
        assert sorted(w.where for w in found) == sorted(
            f"{cluster.url} (node 127.0.0.1:{node.port})" for node in cluster.nodes
        )
        assert {w.memory.policy for w in found} == {"volatile-ttl"}
    finally:
        cluster.cleanup()


def test_a_store_that_does_not_answer_is_passed_over_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an evicting broker, and a store nothing listens for
    broker = RedisServer(extra_args=VOLATILE).start()
    store_url = f"redis://127.0.0.1:{free_port()}/0"
    try:
        settings = Settings(broker_url=broker.url, store_url=store_url)

        # When the worker's start-up check runs
        with caplog.at_level(logging.DEBUG, logger=eviction.__name__):
            eviction.log_startup_warnings(settings)

        # Then the broker is warned of, and the store only noted at DEBUG
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert [line.split(" has ")[0] for line in warned] == [f"broker {broker.url}"]
        debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
        assert f"maxmemory-policy of store {store_url} unknown: not checked" in debug
    finally:
        broker.cleanup()
