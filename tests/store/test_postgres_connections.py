"""PostgresStore's connections: one that a failed call left unusable is replaced, never
reused (found by the full-disk fault test: a worker failed every call until restarted)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.postgres import PostgresStore
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration

SCHEMA = "s_connections"


@pytest.fixture
def store(postgres_server: PostgresServer) -> Iterator[PostgresStore]:
    postgres_server.psql(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    store = PostgresStore(postgres_server.url, schema=SCHEMA)
    yield store
    store.close()
    postgres_server.psql(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def test_a_connection_left_with_a_command_in_progress_is_replaced(store: PostgresStore) -> None:
    # Given a session saved, and this thread's connection left with a command whose result
    # nobody read (what a call cut short leaves behind)
    store.save(make_checkpoint("s1", version=3))
    wedged = store._local.conn  # reaching behind the store is this test's point
    wedged.pgconn.send_query(b"SELECT pg_sleep(0.2)")

    # When a write meets it, it fails as the store being unavailable
    with pytest.raises(StoreUnavailable, match="another command is already in progress"):
        store.save(make_checkpoint("s1", version=9), seq=1)

    # Then that connection is closed, and the next call makes a new one and answers
    assert wedged.closed
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 3


def test_a_read_that_lost_its_connection_answers_on_a_new_one(store: PostgresStore) -> None:
    # Given this thread's connection wedged (as a failover or a call cut short leaves it)
    store.save(make_checkpoint("s1", version=3))
    wedged = store._local.conn
    wedged.pgconn.send_query(b"SELECT pg_sleep(0.2)")
    # When a read meets it, Then it answers from a new connection, the old one closed
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 3
    assert wedged.closed and store._local.conn is not wedged
    store.save(make_checkpoint("s1", version=4))
    assert store.load("s1").version == 4  # type: ignore[union-attr]


def test_a_failed_statement_keeps_a_healthy_connection(store: PostgresStore) -> None:
    # Given this thread's connection, idle after a call
    store.save(make_checkpoint("s1"))
    healthy = store._local.conn

    # When a statement fails on the server (an error the connection survives)
    with pytest.raises(StoreUnavailable), store._connection("a bad statement") as conn:
        conn.execute("SELECT 1/0")

    # Then the connection is kept for the next call
    assert store.load("s1") is not None
    assert store._local.conn is healthy and not healthy.closed
