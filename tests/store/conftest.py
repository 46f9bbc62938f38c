"""Fixtures for the store contract suite: one test body, every backend.

``store_env`` is parametrized over the in-memory store, the Redis store on fakeredis, the
Redis store on a real ``redis-server`` (twice: as configured, and staging every value, the
path large values take: ``RedisStore.stage_from_bytes``; and a third time writing through
redis-py's pipeline, as on a redis-py the hand-sent path is not proven on:
``store/redis_hooks.py``) and on a local 3-master Redis
Cluster, and on a private PostgreSQL server, a schema per test (each started only when a
test of that backend runs). Tests say "let this much time pass" through
``StoreEnv.pass_time``: the in-memory store's clock is advanced at once; Redis stores keep
real time (Redis expires keys by its own clock), so the call polls until the time has passed.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fakeredis
import psycopg
import pytest
import redis

from checkpointq.store import CheckpointStore, InMemoryStore, RedisStore, StoreOptions, redis_hooks
from checkpointq.store.postgres import PostgresStore
from tests.support.clocks import FakeClock
from tests.support.cluster import LocalCluster
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer

BACKENDS = [
    "memory",
    "fakeredis",
    "redis",
    "redis-staged",
    "redis-pipeline",
    "cluster",
    "postgres",
]
_prefixes = itertools.count()


@dataclass
class StoreEnv:
    """A backend under test, and how to build stores on it and reach behind them."""

    backend: str
    make: Callable[[StoreOptions | None], CheckpointStore]
    clock: FakeClock | None
    raw: Any  # the redis client (or psycopg connection) behind the store, None for memory
    #: A store sharing nothing with those made before it (a prefix or a schema of its own).
    make_fresh: Callable[[StoreOptions | None], CheckpointStore] | None = None

    def store(self, **options: Any) -> CheckpointStore:
        return self.make(StoreOptions(**options) if options else None)

    def fresh(self, **options: Any) -> CheckpointStore:
        """A store on this backend that sees nothing of the others (a new prefix, a new
        schema, a new in-memory store on the same clock)."""
        make = self.make_fresh or self.make
        return make(StoreOptions(**options) if options else None)

    def pass_time(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
            return
        target = time.time() + seconds
        while time.time() < target:
            time.sleep(min(0.05, max(0.0, target - time.time())))

    def corrupt(self, store: CheckpointStore, session_id: str, value: bytes) -> None:
        """Overwrite a session's stored bytes behind the store's back, in place: the value
        keeps its expiry, so the store still takes it for the value it wrote (a write with
        a new TTL is another writer's, which the sweep leaves alone: test_mixed_writers)."""
        if isinstance(store, InMemoryStore):
            store.inject_raw(session_id, value)
        elif isinstance(store, PostgresStore):
            self.raw.execute(
                f"UPDATE {store.schema}.sessions SET value = %s WHERE session_id = %s",
                (value, session_id.encode()),
            )
        else:
            assert isinstance(store, RedisStore)
            store.client.set(store.keys.data(session_id), value, keepttl=True)


@pytest.fixture(params=BACKENDS)
def store_env(request: pytest.FixtureRequest) -> Iterator[StoreEnv]:
    backend: str = request.param
    if backend == "memory":
        clock = FakeClock()

        def make_memory(options: StoreOptions | None) -> CheckpointStore:
            return InMemoryStore(options, clock=clock)

        yield StoreEnv(backend, make_memory, clock, None, make_memory)
        return
    if backend == "postgres":
        yield from _postgres_env(request.getfixturevalue("postgres_server"))
        return
    if backend == "fakeredis":
        client: Any = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    elif backend == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        client = cluster.client()
        client.flushall()
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        client = redis_server.client()
        client.flushall()
        if backend == "redis-pipeline":
            monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
            monkeypatch.setattr(redis_hooks, "refusal", lambda: "as if unproven")
    prefix = f"t{next(_prefixes)}"

    def make_redis(options: StoreOptions | None, prefix: str = prefix) -> CheckpointStore:
        store = RedisStore(client, prefix=prefix, options=options)
        if backend == "redis-staged":
            store.stage_from_bytes = 0
        return store

    def fresh_redis(options: StoreOptions | None) -> CheckpointStore:
        return make_redis(options, f"t{next(_prefixes)}")

    yield StoreEnv(backend, make_redis, None, client, fresh_redis)
    client.close()


def _postgres_env(server: PostgresServer) -> Iterator[StoreEnv]:
    """The PostgreSQL backend: a schema per test, and one per ``fresh`` store."""
    schemas = [f"t{next(_prefixes)}"]
    made: list[PostgresStore] = []
    # A property test makes a fresh store per example: only the two newest stay open
    # (test_batch compares two), so that the connections do not pile up.
    recent: deque[PostgresStore] = deque()

    def make(options: StoreOptions | None, schema: str = "") -> PostgresStore:
        store = PostgresStore(server.url, schema=schema or schemas[0], options=options)
        made.append(store)
        return store

    def fresh(options: StoreOptions | None) -> CheckpointStore:
        schemas.append(f"t{next(_prefixes)}")
        recent.append(make(options, schemas[-1]))
        if len(recent) > 2:
            recent.popleft().close()
        return recent[-1]

    with psycopg.connect(server.url, autocommit=True) as conn:
        yield StoreEnv("postgres", make, None, conn, fresh)
        for store in made:
            store.close()
        for schema in schemas:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A private 3-master Redis Cluster (no replicas) for the whole run; started lazily, the
    first time a test asks for it. Tests isolate themselves by key prefix and by flushing."""
    cluster = LocalCluster(masters=3).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def cluster_store(redis_cluster: LocalCluster) -> Iterator[RedisStore]:
    """A Redis store on the local cluster, under a prefix of its own."""
    store = RedisStore.from_url(redis_cluster.url, prefix=f"cl{next(_prefixes)}")
    yield store
    store.close()


@pytest.fixture
def store(store_env: StoreEnv) -> CheckpointStore:
    return store_env.store()


@pytest.fixture
def real_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()
