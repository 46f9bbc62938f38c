"""What the PostgreSQL store calls a refusal to write, on a private server that refuses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.postgres import PostgresStore
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


def test_a_session_the_server_ended_is_no_refusal(
    server: PostgresServer, store: PostgresStore
) -> None:
    # Given a store whose session the server ended (pg_terminate_backend)
    store.save(checkpoint_from_wire({"sessionId": "s", "version": 1}))
    _terminate_store_sessions(server)
    # Then the write that meets it fails, without the store calling it a refusal ...
    with pytest.raises(StoreUnavailable):
        store.save(checkpoint_from_wire({"sessionId": "s", "version": 2}))
    # ... and a probe that meets it judges the database on a new session: it takes writes
    store.ping()
    _terminate_store_sessions(server)
    assert store.write_refusal() is None
