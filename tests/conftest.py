"""Fixtures shared by every test: private redis-server processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.servers import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the whole run; tests isolate themselves by key prefix or
    by flushing this private server's database with the ``redis_client`` fixture."""
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
