"""The PostgreSQL store's schema: created once, upgraded under a lock by any number of
starters at once, and a table an operator partitioned first kept and used as it is."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from checkpointq.store import postgres_schema
from checkpointq.store.postgres import PostgresStore, session_key
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration


@pytest.fixture
def schema(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"s_{request.node.name.split('[')[0][-40:].lower()}"
    postgres_server.psql(f"DROP SCHEMA IF EXISTS {name} CASCADE")
    yield name
    postgres_server.psql(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def test_stores_starting_together_upgrade_once(
    postgres_server: PostgresServer, schema: str
) -> None:
    # Given eight stores that start at once on a database without the schema
    stores = [PostgresStore(postgres_server.url, schema=schema) for _ in range(8)]
    errors: list[BaseException] = []

    def first_call(store: PostgresStore) -> None:
        try:
            store.load("anything")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for store in stores:
        store.close()
    # Then none failed, and the schema was upgraded exactly once
    assert errors == []
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT version FROM {schema}.schema_version").fetchall()
    assert rows == [(v,) for v in range(1, postgres_schema.SCHEMA_VERSION + 1)]


def test_a_table_partitioned_by_session_is_kept_and_serves_every_call(
    postgres_server: PostgresServer, schema: str
) -> None:
    # Given an operator's sessions table, hash-partitioned four ways by the row's key (the
    # columns of version 2), made before the upgrade
    columns = (
        "session_key bytea PRIMARY KEY, session_id bytea NOT NULL, value bytea, "
        "value_deadline_ms bigint, version bigint, "
        "last_run_ref text, metadata jsonb, fence_seq bigint NOT NULL, fence_deleted boolean "
        "NOT NULL, fence_request_id bytea NOT NULL DEFAULT '', fence_lapsed boolean NOT NULL "
        "DEFAULT false, fence_expires_ms bigint NOT NULL, updated_at timestamptz NOT NULL "
        "DEFAULT clock_timestamp()"
    )
    parts = "".join(
        f"CREATE TABLE {schema}.sessions_{n} PARTITION OF {schema}.sessions "
        f"FOR VALUES WITH (MODULUS 4, REMAINDER {n});"
        for n in range(4)
    )
    postgres_server.psql(
        f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.sessions ({columns}) "
        f"PARTITION BY HASH (session_key); {parts}"
    )
    store = PostgresStore(postgres_server.url, schema=schema)
    try:
        # When the store writes, reads, lists and sweeps through it
        ids = [f"p{n}" for n in range(20)]
        for n, session_id in enumerate(ids):
            assert store.save(make_checkpoint(session_id, version=n + 1)).applied
        assert store.delete("p0")
        assert not store.save(make_checkpoint("p0", version=99), seq=1).applied  # fenced out
        assert sorted(store.list()) == sorted(ids[1:])
        loaded = store.load("p7")
        assert loaded is not None and loaded.version == 8
        expired = store.expire_stale(now=time.time() + 31 * 86400, limit=100)
        # Then every partition took rows, and the sweep found the sessions of all of them
        assert sorted(expired) == sorted(ids[1:])
        counts = postgres_server.psql(
            "SELECT string_agg(n::text, ',') FROM (SELECT count(*) AS n FROM "
            f"{schema}.sessions GROUP BY tableoid) AS per_partition"
        )
        assert len(counts.split(",")) == 4
        kind = postgres_server.psql(
            f"SELECT relkind FROM pg_class WHERE oid = '{schema}.sessions'::regclass"
        )
        assert kind == "p"  # still the operator's partitioned table
    finally:
        store.close()


def test_short_ids_are_their_own_keys_and_long_ones_a_marked_digest(
    postgres_server: PostgresServer, schema: str
) -> None:
    # Given the schema, and ids at and around the 256-byte boundary
    store = PostgresStore(postgres_server.url, schema=schema)
    try:
        ids = ["s-1", "é" * 128, "x" * 256, "x" * 257, "y" * 6000]
        for session_id in ids:
            assert store.save(make_checkpoint(session_id)).applied
        # When the database computes each row's key
        with psycopg.connect(postgres_server.url, autocommit=True) as conn:
            rows = conn.execute(f"SELECT session_id, session_key FROM {schema}.sessions")
            keys = {bytes(sid).decode(): bytes(key) for sid, key in rows}
        # Then an id of up to 256 bytes is its own key (ids that sort together keep their
        # index pages together); a longer one is 0xff and its sha256, as Python computes it
        assert keys == {session_id: session_key(session_id) for session_id in ids}
        assert [keys[i] == i.encode() for i in ids] == [True, True, True, False, False]
        assert keys["y" * 6000] == b"\xff" + hashlib.sha256(b"y" * 6000).digest()
        # And bytes no UTF-8 id has (a leading 0xff, as a digest key has) are hashed too,
        # so that no id's key is another's digest key
        forged = b"\xff" + hashlib.sha256(b"y" * 6000).digest()
        key = postgres_server.psql(
            f"SELECT encode({schema}.session_key('\\x{forged.hex()}'::bytea), 'hex')"
        )
        assert bytes.fromhex(key) == b"\xff" + hashlib.sha256(forged).digest() != forged
    finally:
        store.close()
