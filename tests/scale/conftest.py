"""Scale-out fixtures: RabbitMQ vhosts, Sentinel groups, fleets of workers, broker probes.

Every server is private to the run: Redis and Sentinel processes on free loopback ports,
and on the machine's RabbitMQ a vhost of our own, created for the session and deleted after
(other vhosts' queues are never looked at).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
import redis

from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.rabbitmq import RabbitVhost, rabbitmq_available
from tests.support.sentinel import SentinelGroup
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import QUEUE, TEST_WORKER_SETTINGS

#: Worker settings shared by the scale tests: the shortest visibility timeout the settings
#: allow (a message held by a dead broker connection comes back soon).
WORKER_SETTINGS: dict[str, object] = {**TEST_WORKER_SETTINGS, "visibility_timeout": 10}


class BrokerProbe(Protocol):
    """Counts the messages a broker still holds for the queue: ready plus unacknowledged."""

    def pending(self) -> int: ...


@dataclass
class RedisQueueProbe:
    """A Redis broker: the queue list plus kombu's ``unacked`` hash (held by workers, and
    retries waiting for their countdown)."""

    client_factory: Any  # () -> redis.Redis on the current broker master

    def pending(self) -> int:
        client = self.client_factory()
        try:
            return int(client.llen(QUEUE)) + int(client.hlen("unacked"))
        finally:
            client.close()


@dataclass
class Fleet:
    """``CeleryProcess`` workers (and perhaps a beat) sharing one set of settings."""

    settings: Settings
    env: dict[str, str]
    processes: list[CeleryProcess] = field(default_factory=list)

    @classmethod
    def of(cls, **values: object) -> Fleet:
        values = {**WORKER_SETTINGS, **values}
        return cls(Settings(**values), checkpointq_env(**values))  # type: ignore[arg-type]

    def start_workers(self, count: int = 1) -> Fleet:
        for _ in range(count):
            self.processes.append(CeleryProcess("worker", self.env).start(timeout=60))
        return self

    def start_beat(self) -> Fleet:
        self.processes.append(CeleryProcess("beat", self.env).start(timeout=60))
        return self

    def logs(self) -> str:
        return "\n".join(f"--- {p.role} {i} ---\n{p.log()}" for i, p in enumerate(self.processes))

    def stop(self) -> None:
        codes = [process.stop() for process in self.processes]
        print(f"--- fleet exit codes {codes} ---\n{self.logs()}")


#: What a worker logs when its store gate pauses it, and when it consumes again
#: (worker/backpressure.py).
PAUSED = "store refusing writes"
RESUMED = "taking messages from"


@contextlib.contextmanager
def store_out_of_memory(store: redis.Redis, fleet: Fleet) -> Iterator[None]:
    """The store out of memory (eviction off: it answers reads, refuses writes) until the
    block ends, entered once the fleet's workers have logged that they paused; an operator
    raises the limit at the end."""
    pauses = fleet.logs().count(PAUSED)
    store.config_set("maxmemory-policy", "noeviction")
    store.config_set("maxmemory", int(store.info("memory")["used_memory"]) // 2)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            store.set("out-of-memory-probe", b"x")
        wait_until(
            lambda: fleet.logs().count(PAUSED) > pauses, timeout=30, message="workers to pause"
        )
        yield
    finally:
        store.config_set("maxmemory", 0)


def wait_drained(probe: BrokerProbe, timeout: float = 30.0) -> None:
    """Until the broker holds nothing for the queue, ready or unacknowledged."""
    wait_until(
        lambda: probe.pending() == 0,
        timeout=timeout,
        interval=0.1,
        message="the workers to drain the queue",
    )


@pytest.fixture(scope="session")
def rabbit_vhost() -> Iterator[RabbitVhost]:
    if not rabbitmq_available():
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 (or no rabbitmqctl)")
    vhost = RabbitVhost().create()
    try:
        yield vhost
    finally:
        vhost.delete()


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    """A master, a replica and three sentinels (quorum 2) for the module: the master is
    called down after 1 s of silence."""
    group = SentinelGroup(replicas=1, sentinels=3, down_after_ms=1000).start()
    yield group
    group.cleanup()


@pytest.fixture
def store_client(store_server: RedisServer) -> Iterator[redis.Redis]:
    """The module's store Redis, emptied before the test."""
    client = store_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def client(fleet: Fleet, store_client: redis.Redis) -> Iterator[CheckpointClient]:
    """A producer for the module's ``fleet``, on a store emptied before the test."""
    with CheckpointClient.from_settings(fleet.settings) as client:
        yield client
