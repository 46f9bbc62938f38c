"""A session's row held by another client (``SELECT ... FOR UPDATE`` in an analytics or
erasure transaction) stalls that session only. Every other session applies within about the
group's lock timeout while it is held; the held one waits and retries on its own; the worker
never pauses, logs who holds the row, and ``health`` names it instead of "restart it"; once
the row is released, its requests land. With a ``statement_timeout`` on the role, a timeout
is not taken for "the store refuses writes" either (issue 39: the other 39 sessions waited
41 s; with the timeout, the worker paused again and again).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from checkpointq.worker.ops import health
from tests.postgres.conftest import PgDeployment
from tests.postgres.traffic import PAUSED, RETRIES, Run, running, settle
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer
from tests.support.servers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: How long the other client holds the row: several lock timeouts and retry budgets.
HOLD = 8.0
#: How soon a save of another session must be durable while the row is held (the group's
#: lock timeout is 1 s, then the group runs item by item): a bound that a worker whose
#: group waits for the lock cannot meet.
OTHERS_WITHIN = 4.0
HELD = "s-0007"


@pytest.fixture(scope="module")
def pg_database() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def pg_settings() -> dict[str, object]:
    return {**RETRIES, "store_probe_seconds": 0.5}


@pytest.fixture(params=[None, "2s", "300ms"], ids=["no-timeout", "timeout-2s", "timeout-300ms"])
def run(request: pytest.FixtureRequest, pg_live: PgDeployment) -> Iterator[Run]:
    """A run whose database role has the ``statement_timeout`` of the parameter (none, one
    above the lock timeout, one below it: then the statement is cancelled first)."""
    timeout = request.param
    database = pg_live.database
    if timeout is not None:
        database.psql(f"ALTER ROLE postgres SET statement_timeout = '{timeout}'")
        # the worker's connections made before keep the old setting: cut them
        database.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'checkpointq'"
        )
    try:
        with running(pg_live) as started:
            yield started
    finally:
        if timeout is not None:
            database.psql("ALTER ROLE postgres RESET statement_timeout")


def _hold_row(deployment: PgDeployment, session_id: str) -> psycopg.Connection[tuple[object, ...]]:
    """Another client's transaction holding ``session_id``'s row (``FOR UPDATE``)."""
    holder = psycopg.connect(deployment.database.url, application_name="erasure-job")
    holder.execute("SET statement_timeout = 0")
    row = holder.execute(
        f"SELECT session_id FROM {deployment.schema}.sessions "
        f"WHERE session_key = {deployment.schema}.session_key(%s) FOR UPDATE",
        (session_id.encode(),),
    ).fetchone()
    assert row is not None, "the session's row is not there yet"
    return holder


def test_a_held_row_stalls_only_its_own_session(run: Run) -> None:
    deployment = run.deployment
    # Given producers saving 40 sessions steadily, every one of them stored
    run.traffic.start().more(200)
    store = deployment.store()
    try:
        wait_until(lambda: store.load(HELD) is not None, timeout=30, message="the row")
    finally:
        store.close()
    # When another client holds one session's row for several lock timeouts
    holder = _hold_row(deployment, HELD)
    held_by = holder.info.backend_pid
    held_at = time.monotonic()
    try:
        # Then a save of any other session is durable within seconds, while it is held
        waited: list[float] = []
        while time.monotonic() - held_at < HOLD:
            started = time.monotonic()
            handle = run.client.save(make_checkpoint("other", version=len(waited) + 1))
            run.client.wait_durable(handle, timeout=OTHERS_WITHIN)
            waited.append(time.monotonic() - started)
        # and the worker says which session waits and who holds it, and keeps going
        run.wait_logged(f"session '{HELD}' waits on a row lock held by pid {held_by}")
        assert "erasure-job" in run.log()
        # and health names it instead of calling the worker stuck
        report = health.check(deployment.settings)
        worker = next(c for c in report.checks if c.name == "worker")
        assert worker.ok, worker.detail
        assert f"session {HELD} waits on a row lock held by pid {held_by}" in worker.detail
        assert "restart it" not in worker.detail
    finally:
        holder.rollback()
        holder.close()
    # Then once released, every accepted request lands (the held session's too), nothing
    # was dead-lettered, and the worker never paused
    settle(run)
    assert PAUSED not in run.log(), run.log()
    print(f"other sessions durable in {max(waited):.2f}s at most ({len(waited)} saves)")
    assert len(waited) >= 3
