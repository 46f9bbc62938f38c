"""Behind PgBouncer (Debian's, 1.18 here), in transaction and in session pooling: the worker and
the producers reach the database only through it, under steady traffic, and nothing is lost,
dead-lettered or paused for.

In transaction mode a client's next transaction may run on another server connection, and a
statement prepared on the server (psycopg prepares one at its fifth use) is then missing:
"prepared statement _pg3_0 does not exist". The store prepares nothing unless told it is
safe (``CHECKPOINTQ_PG_PREPARED_STATEMENTS``), and a connection that met such an error is
closed, never used again (issue 39: the worker paused for good, 40 of 40 sessions stuck).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import psycopg
import pytest

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.postgres import PostgresStore
from checkpointq.worker.backpressure import PROBE_STALL_SECONDS
from tests.faults.harness import hold
from tests.postgres.conftest import PgDeployment
from tests.postgres.traffic import PAUSED, RESUMED, RETRIES, Run, running, settle
from tests.support.checkpoints import make_checkpoint
from tests.support.pgbouncer import PgBouncer, version
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def pg_database() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module", params=["transaction", "session"])
def bouncer(request: pytest.FixtureRequest, pg_database: PostgresServer) -> Iterator[PgBouncer]:
    """PgBouncer in the mode: two server connections for every client in transaction mode
    (their transactions take turns), one each in session mode."""
    mode = str(request.param)
    pooler = PgBouncer(pg_database, mode=mode, pool_size=2 if mode == "transaction" else 20)
    pooler.start()
    print(f"{version()} in {mode} mode")
    yield pooler
    pooler.cleanup()


@pytest.fixture(scope="module")
def pg_settings(bouncer: PgBouncer) -> dict[str, object]:
    return {**RETRIES, "store_url": bouncer.url, "store_probe_seconds": 0.5}


@pytest.fixture
def run(pg_live: PgDeployment) -> Iterator[Run]:
    with running(pg_live) as started:
        yield started


def test_the_worker_and_producers_through_pgbouncer_lose_nothing_and_never_pause(
    run: Run, bouncer: PgBouncer
) -> None:
    # Given the worker and the producers reaching the database only through PgBouncer
    assert run.deployment.settings.store_url == bouncer.url
    # When producers save steadily, and read back (loads and outcomes go through it too),
    # long past every statement's fifth use on every connection
    run.traffic.start()
    for _ in range(6):
        run.traffic.more(100)
        last = run.traffic.sent[-1]
        run.client.load(last.session_id)
    # Then every accepted request lands, nothing is dead-lettered, the worker never paused
    # and never met a missing prepared statement or a cut message
    settle(run)
    log = run.log()
    assert PAUSED not in log, log[log.index(PAUSED) - 200 :][:600]
    for error in ("prepared statement", "insufficient data left", "ProtocolViolation"):
        assert error not in log, error


@contextmanager
def _pool_held(bouncer: PgBouncer) -> Iterator[None]:
    """Every server connection of the pool held by a client's open transaction: every other
    client's next transaction (the worker's groups, its probe, the producers' loads) queues
    in PgBouncer until the block ends, as behind a pool busy with long transactions."""
    holders: list[psycopg.Connection[tuple[object, ...]]] = []
    try:
        for _ in range(bouncer.pool_size):
            holders.append(_take_its_server_connection(bouncer))
        yield
    finally:
        for holder in holders:
            holder.close()


def _one_transaction(bouncer: PgBouncer) -> None:
    with psycopg.connect(bouncer.url, prepare_threshold=None) as conn:
        conn.execute("SELECT 1")


def test_a_pool_too_busy_to_answer_for_seconds_is_no_refusal(run: Run, bouncer: PgBouncer) -> None:
    if bouncer.mode != "transaction":
        pytest.skip("held in transaction mode, where the pool is smaller than its clients")
    # Given producers saving steadily through PgBouncer
    run.traffic.start()
    run.traffic.more(50)
    # When the pool is held for three seconds (longer than a probe's usual answer, shorter
    # than the stall), so that the worker's probe and writes queue behind it
    with ThreadPoolExecutor(max_workers=1) as witness, _pool_held(bouncer):
        waiting = witness.submit(_one_transaction, bouncer)
        hold(3.0)
        run.traffic.more(20)
        # (another client's transaction waited all along: the pool was held)
        assert not waiting.done()
    waiting.result(timeout=30)
    run.traffic.more(50)
    # Then the worker never paused for the wait: a slow answer is no refusal
    settle(run)
    log = run.log()
    assert PAUSED not in log, log[log.index(PAUSED) - 200 :][:600]


def test_a_pool_unanswered_past_the_stall_pauses_the_worker_until_it_answers(
    run: Run, bouncer: PgBouncer
) -> None:
    if bouncer.mode != "transaction":
        pytest.skip("held in transaction mode, where the pool is smaller than its clients")
    # Given producers saving steadily through PgBouncer
    run.traffic.start()
    run.traffic.more(50)
    # When the pool is held past the stall (a database that stopped answering)
    with _pool_held(bouncer):
        hold(PROBE_STALL_SECONDS + 1.0)
        # Then the worker stops taking messages, saying its probe had no answer
        paused = run.wait_logged(PAUSED, timeout=10)
        assert "no answer in" in run.log()[paused:]
    # and takes them again once the database answers, and every accepted request lands
    run.wait_logged(RESUMED, after=paused)
    run.traffic.more(50)
    settle(run)


def _take_its_server_connection(bouncer: PgBouncer) -> psycopg.Connection[tuple[object, ...]]:
    """A client in a transaction: it holds the server connection PgBouncer hands out next,
    the one the last transaction used (its idle list is last in, first out)."""
    holder = psycopg.connect(bouncer.url, autocommit=False, prepare_threshold=None)
    holder.execute("SELECT 1")
    return holder


@pytest.mark.parametrize("prepared", [False, True], ids=["default", "prepared-opt-in"])
def test_a_statement_prepared_on_another_server_connection_never_reaches_a_call_twice(
    pg_live: PgDeployment, bouncer: PgBouncer, prepared: bool
) -> None:
    if bouncer.mode != "transaction":
        pytest.skip("session pooling keeps a client on its server connection")
    store = PostgresStore(
        bouncer.url, schema=pg_live.schema, prepared_statements=prepared, durability="local"
    )
    try:
        # Given a store that saved one session six times through PgBouncer (psycopg
        # prepares a statement on the server at its fifth use, when allowed to)
        for version in range(1, 7):
            assert store.save(make_checkpoint("bouncer", version=version)).applied
        first = store._local.conn  # reaching behind the store is this test's point
        # When another client's transaction takes that server connection
        holder = _take_its_server_connection(bouncer)
        try:
            if not prepared:
                # Then by default nothing was prepared: the next save runs on another
                # server connection as well as on the first
                assert store.save(make_checkpoint("bouncer", version=7)).applied
                assert store._local.conn is first
                return
            # Then with the opt-in the next save fails, once, and its connection is closed
            with pytest.raises(StoreUnavailable, match="does not exist"):
                store.save(make_checkpoint("bouncer", version=7))
            assert first.closed
            # and the next call makes a new one and applies
            assert store.save(make_checkpoint("bouncer", version=7)).applied
            assert store._local.conn is not first
        finally:
            holder.close()
    finally:
        store.close()
