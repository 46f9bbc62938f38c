"""Fixtures shared by every test: private redis-server processes on free loopback ports, and
the Go cross-check program."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import gostore
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the whole run; tests isolate themselves by key prefix or
    by flushing this private server's database with the ``redis_client`` fixture."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def broker_server() -> Iterator[RedisServer]:
    """A plain Redis broker for the module (tests of other brokers do not ask for it)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def store_server() -> Iterator[RedisServer]:
    """The module's store Redis, apart from the broker so that it can go down on its own
    (tests/faults overrides it with a fresh one per test, AOF on)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the private server, emptied before each test (never the shared Redis)."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def gostore_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/go/gostore, built once per run (tests/support/gostore.py); skips without Go."""
    out = tmp_path_factory.mktemp("go") / "gostore"
    return gostore.build(out, tmp_path_factory.mktemp("gopath"))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One private PostgreSQL server for the whole run (initdb on a free port, in a temp
    directory; never the machine's shared one); tests isolate themselves by schema."""
    server = PostgresServer().start()
    yield server
    server.cleanup()
