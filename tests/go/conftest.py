"""The Go cross-check: ``tests/go/gostore`` (built once per run by the ``gostore_binary``
fixture of tests/conftest.py; see tests/support/gostore.py) does what the Go checkpoint
package's ``RedisStore`` does beside our store on a private redis-server; ``tests/go/publishcall``
prints the script calls of the Go client (clients/go). Without Go the tests skip, saying why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import gostore
from tests.support.gostore import GoStore
from tests.support.servers import RedisServer


@pytest.fixture
def real_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def go_store(gostore_binary: Path, redis_server: RedisServer, real_redis: redis.Redis) -> GoStore:
    return GoStore(gostore_binary, redis_server.port)


@pytest.fixture(scope="session")
def publishcall_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/go/publishcall, built once per run (tests/support/gostore.py); skips without Go."""
    out = tmp_path_factory.mktemp("go") / "publishcall"
    return gostore.build(out, tmp_path_factory.mktemp("gopath"), "publishcall")
