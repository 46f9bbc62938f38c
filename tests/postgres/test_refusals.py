"""How the PostgreSQL store names a refusal, on a private server it meets them on: a
connection refused for want of a slot, a session the server ended, a probe's lost session."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.postgres import PostgresStore, describe
from checkpointq.store.serde import checkpoint_from_wire
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    server = PostgresServer(max_connections=6).start()
    yield server
    server.cleanup()


@pytest.fixture
def store(server: PostgresServer) -> Iterator[PostgresStore]:
    store = PostgresStore(server.url, schema="refusals")
    yield store
    store.close()


def _terminate_store_sessions(server: PostgresServer) -> None:
    server.psql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = 'checkpointq'"
    )


def test_no_connection_slot_is_a_refusal_though_libpq_gives_no_sqlstate(
    server: PostgresServer, store: PostgresStore
) -> None:
    store.ping()  # the schema is made
    store.close()
    hogs: list[psycopg.Connection[tuple[object, ...]]] = []
    try:
        # Given every slot taken by other clients
        while True:
            try:
                hogs.append(psycopg.connect(server.url, autocommit=True))
            except psycopg.OperationalError as exc:
                refused = exc
                break
        # Then the error names the refusal, and a write that meets it says so too
        assert refused.sqlstate is None
        assert describe(refused).startswith("too many connections: ")
        fresh = PostgresStore(server.url, schema="refusals")
        with pytest.raises(StoreUnavailable) as caught:
            fresh.save(checkpoint_from_wire({"sessionId": "s", "version": 1}))
        assert caught.value.refusal is not None
        assert caught.value.refusal.startswith("too many connections")
        assert fresh.write_refusal() is not None
        fresh.close()
    finally:
        for hog in hogs:
            hog.close()


def test_a_session_the_server_ended_is_no_refusal(
    server: PostgresServer, store: PostgresStore
) -> None:
    # Given a store whose session the server ended (pg_terminate_backend)
    store.save(checkpoint_from_wire({"sessionId": "s", "version": 1}))
    _terminate_store_sessions(server)
    # Then the write that meets it fails, without calling it a refusal ...
    with pytest.raises(StoreUnavailable) as caught:
        store.save(checkpoint_from_wire({"sessionId": "s", "version": 2}))
    assert caught.value.refusal is None
    # ... and a probe that meets it judges the database on a new session: it takes writes
    store.ping()
    _terminate_store_sessions(server)
    assert store.write_refusal() is None
