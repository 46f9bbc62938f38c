"""How the PostgreSQL store names a refusal, on a private server it meets them on: a
connection refused for want of a slot, a session the server ended, a probe's lost session
(ended with a message, or cut without one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
import pytest

from checkpointq.store import postgres
from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.postgres import PostgresStore, describe
from checkpointq.store.serde import checkpoint_from_wire
from tests.postgres.proxy import Proxy
from tests.support.postgres import PostgresServer
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration

T = TypeVar("T")


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


def _after_new_sessions(
    store: PostgresStore, times: int, act: Callable[[psycopg.Connection[Any]], T]
) -> list[T]:
    """Call ``act`` on each of the store's next ``times`` new sessions as soon as it is
    made; what each call returned."""
    done: list[T] = []
    connect = store._connect

    def connect_then_act(write: bool) -> psycopg.Connection[Any]:
        conn = connect(write)
        if len(done) < times:
            done.append(act(conn))
        return conn

    store._connect = connect_then_act  # type: ignore[method-assign]
    return done


def _ending_new_sessions(server: PostgresServer, store: PostgresStore, times: int) -> list[int]:
    """Make the server end each of the store's next ``times`` new sessions as soon as it
    is made (an administrator's sweep that keeps catching the probe); the pids it ended."""

    def end(conn: psycopg.Connection[Any]) -> int:
        pid = conn.info.backend_pid
        server.psql(f"SELECT pg_terminate_backend({pid})")
        gone = f"SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
        wait_until(lambda: server.psql(gone) == "0", message=f"backend {pid} to end")
        return pid

    return _after_new_sessions(store, times, end)


@pytest.fixture
def probe(server: PostgresServer, store: PostgresStore) -> Iterator[PostgresStore]:
    """A store that has made no session yet, on a schema that exists."""
    store.ping()
    store.close()
    fresh = PostgresStore(server.url, schema="refusals")
    yield fresh
    fresh.close()


def test_a_probe_whose_new_sessions_are_ended_tries_again_before_calling_it_a_refusal(
    server: PostgresServer, probe: PostgresStore
) -> None:
    # Given a sweep that ends the probe's next two new sessions as soon as they are made
    ended = _ending_new_sessions(server, probe, times=2)
    # Then the probe judges the database on a third: it takes writes
    assert probe.write_refusal() is None
    assert len(ended) == 2


def test_a_probe_whose_every_new_session_is_ended_says_so(
    server: PostgresServer, probe: PostgresStore
) -> None:
    # Given a sweep that ends every session the probe makes, as fast as it makes them
    ended = _ending_new_sessions(server, probe, times=100)
    # Then after a few tries the probe answers that it could not write, and why
    why = probe.write_refusal()
    assert why is not None and "terminating connection" in why, why
    assert len(ended) == postgres._PROBE_ATTEMPTS


@pytest.fixture
def cut_probe(
    server: PostgresServer, store: PostgresStore
) -> Iterator[tuple[PostgresStore, Proxy]]:
    """A store that has made no session yet, reaching the server through a proxy that can
    cut its connections without a word (a reset, as when the server's end went away and
    took its message with it)."""
    store.ping()
    store.close()
    proxy = Proxy(server.port)
    fresh = PostgresStore(proxy.url(), schema="refusals")
    yield fresh, proxy
    fresh.close()
    proxy.close()


def _cutting_new_sessions(store: PostgresStore, proxy: Proxy, times: int) -> list[int]:
    """Cut each of the store's next ``times`` new sessions as soon as it is made; the
    count of connections cut each time."""
    return _after_new_sessions(store, times, lambda _conn: proxy.drop_all())


def test_a_probe_whose_new_sessions_are_cut_without_a_word_tries_again(
    cut_probe: tuple[PostgresStore, Proxy],
) -> None:
    probe, proxy = cut_probe
    # Given the probe's next two new sessions cut as soon as they are made: the write that
    # meets each fails with no SQLSTATE ("server closed the connection unexpectedly")
    cut = _cutting_new_sessions(probe, proxy, times=2)
    # Then the probe judges the database on a third: it takes writes
    assert probe.write_refusal() is None
    assert cut == [1, 1]


def test_a_probe_whose_every_new_session_is_cut_says_so(
    cut_probe: tuple[PostgresStore, Proxy],
) -> None:
    probe, proxy = cut_probe
    # Given every session the probe makes cut as soon as it is made
    cut = _cutting_new_sessions(probe, proxy, times=100)
    # Then after a few tries the probe answers that it could not write
    why = probe.write_refusal()
    assert why is not None and why.startswith("unreachable"), why
    assert len(cut) == postgres._PROBE_ATTEMPTS
