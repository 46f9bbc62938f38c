"""The PostgreSQL store's fault rows (issue 32): the database stopped or restarting, a
read-only standby, connections killed or none to be had, a full disk. Each runs under
steady producer traffic through ``CheckpointClient`` and ends with the same check: every
session's final state is the last request accepted for it (loaded through the client and
straight from the store), nothing dead-lettered, the worker never restarted.

The module's server is its own (they stop, fill and refuse it); the retry budget is short
(``RETRIES``), so that every outage here outlasts it: requests whose retries run out go
back to the queue, and backpressure holds the rest in the broker.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from tests.faults.harness import hold
from tests.postgres.conftest import PgDeployment
from tests.postgres.traffic import (
    BUDGET,
    OUTAGE,
    PAUSED,
    RESUMED,
    RETRIES,
    Failover,
    Run,
    failover_deployment,
    running,
    settle,
)
from tests.support.postgres import PostgresServer
from tests.support.servers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def pg_database() -> Iterator[PostgresServer]:
    """A server of this module's own, with few connection slots (cheap to exhaust)."""
    server = PostgresServer(max_connections=20).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def pg_settings() -> dict[str, object]:
    return dict(RETRIES)


@pytest.fixture
def run(pg_live: PgDeployment) -> Iterator[Run]:
    with running(pg_live) as started:
        yield started


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_database_stopped_beyond_the_retry_budget_loses_and_dead_letters_nothing(
    run: Run, mode: str
) -> None:
    # Given producers saving steadily through the client
    database = run.deployment.database
    run.traffic.start().more(100)
    # When the database stops (cleanly, or as a crash) for several retry budgets
    database.stop(mode=mode)
    stopped = time.monotonic()
    paused = run.wait_logged(PAUSED)
    hold(OUTAGE - (time.monotonic() - stopped))
    outage = time.monotonic() - stopped
    database.start()
    # Then the same worker takes messages again once it answers, and every accepted request
    # (those published during the outage too) lands; none is dead-lettered
    run.wait_logged(RESUMED, after=paused)
    run.traffic.more(100)
    settle(run)
    assert outage > BUDGET * 4
    why = run.log()[paused:].splitlines()[0]
    assert any(word in why for word in ("unreachable", "shutting down", "recovering")), why


def test_a_database_turned_read_only_pauses_the_worker_until_it_takes_writes(run: Run) -> None:
    database = run.deployment.database
    run.traffic.start().more(100)
    # When every transaction becomes read-only (as on a standby) for several retry budgets
    database.psql("ALTER SYSTEM SET default_transaction_read_only = on")
    database.psql("SELECT pg_reload_conf()")
    paused = run.wait_logged(PAUSED)
    hold(OUTAGE)
    database.psql("ALTER SYSTEM RESET default_transaction_read_only")
    database.psql("SELECT pg_reload_conf()")
    # Then the worker says why it paused, resumes by itself, and nothing is lost
    run.wait_logged(RESUMED, after=paused)
    run.traffic.more(100)
    settle(run)
    assert "read-only" in run.log()[paused:].splitlines()[0]


#: The worker's sessions, or those of its pool processes only (the probe's session runs
#: nothing but the probe write).
_WORKER = "application_name = 'checkpointq'"
_POOL = f"{_WORKER} AND query NOT LIKE '%write_probe%'"


def _backends(conn: psycopg.Connection[tuple[object, ...]], which: str = _WORKER) -> int:
    row = conn.execute(f"SELECT count(*) FROM pg_stat_activity WHERE {which}").fetchone()
    assert row is not None
    return int(str(row[0]))


def _terminate(conn: psycopg.Connection[tuple[object, ...]], which: str = _WORKER) -> int:
    rows = conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE {which} AND pid <> pg_backend_pid()"
    ).fetchall()
    return sum(1 for (killed,) in rows if killed)


def test_the_worker_connections_killed_again_and_again_lose_nothing(run: Run) -> None:
    run.traffic.start().more(100)
    killed = 0
    # When the worker's sessions are terminated every few tenths of a second for a while
    with run.deployment.sql() as conn:
        deadline = time.monotonic() + OUTAGE
        while time.monotonic() < deadline:
            killed += _terminate(conn)
            hold(0.2)
    # Then each request is retried on a new connection; nothing lost, nothing dead-lettered,
    # and the worker never paused: its probe's lost session is no refusal of the database
    run.traffic.more(100)
    settle(run)
    assert killed >= 10, f"only {killed} connections were terminated"
    assert PAUSED not in run.log()


def _hog_every_slot(server: PostgresServer) -> list[psycopg.Connection[tuple[object, ...]]]:
    """Connections holding every free slot of ``server`` (until it refuses one more)."""
    hogs: list[psycopg.Connection[tuple[object, ...]]] = []
    while True:
        try:
            hogs.append(psycopg.connect(server.url, autocommit=True, connect_timeout=5))
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc):
                raise
            return hogs


def test_no_connection_slot_left_pauses_the_worker_until_one_frees(run: Run) -> None:
    database = run.deployment.database
    run.traffic.start().more(100)
    hogs: list[psycopg.Connection[tuple[object, ...]]] = []
    try:
        # When other clients take every slot and the pool processes' connections are cut
        # (so that they must make new ones), while the probe keeps its own: its writes go
        # through, and only the real writes meet the limit
        with run.deployment.sql() as admin:
            hogs += _hog_every_slot(database)

            def starved() -> bool:
                _terminate(admin, _POOL)
                hogs.extend(_hog_every_slot(database))
                return _backends(admin, _POOL) == 0

            wait_until(starved, timeout=20, message="the worker to hold no connection")
            paused = run.wait_logged(PAUSED)
            hold(OUTAGE)
    finally:
        for hog in hogs:
            hog.close()
    # Then it resumes once slots free, and nothing is lost
    run.wait_logged(RESUMED, after=paused)
    run.traffic.more(100)
    settle(run)
    why = run.log()[paused:].splitlines()[0]
    assert "too many connections" in why, why


@contextmanager
def small_tablespace(server: PostgresServer, megabytes: int) -> Iterator[Path]:
    """A tablespace ``small`` on a tmpfs of ``megabytes`` mounted for the test (root only);
    dropped and unmounted after. Yields the mount point."""
    mount = Path(tempfile.mkdtemp(prefix="checkpointq-pg-small-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0700", "tmpfs", str(mount)],
        check=True,
    )
    try:
        shutil.chown(mount, "postgres", "postgres")
        server.psql(f"CREATE TABLESPACE small LOCATION '{mount}'")
        try:
            yield mount
        finally:
            server.psql("DROP TABLESPACE IF EXISTS small")
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()


def fill(directory: Path) -> Path:
    """A ballast file taking every free byte of ``directory``'s file system."""
    ballast = directory / "ballast"
    chunk = b"\0" * (1 << 16)
    with ballast.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return ballast


def test_a_full_disk_under_the_sessions_table_loses_nothing_and_heals(run: Run) -> None:
    deployment = run.deployment
    database = deployment.database
    with small_tablespace(database, 16) as mount:
        # Given the sessions table on a small file system of its own, and producers adding
        # new sessions (so that the table must grow)
        database.psql(f"ALTER TABLE {deployment.schema}.sessions SET TABLESPACE small")
        try:
            run.traffic.sessions, run.traffic.content_size = 5000, 600
            run.traffic.start().more(100)
            # When that file system fills up
            ballast = fill(mount)
            refused = run.wait_logged("disk full")
            hold(OUTAGE)
            # Then once space is freed the same worker applies every request, nothing
            # dead-lettered
            ballast.unlink()
            run.traffic.more(200)
            settle(run)
            paused = run.log()[refused:].index(PAUSED)
            why = run.log()[refused:][paused:].splitlines()[0]
            assert "disk full" in why, why
            assert RESUMED in run.log()[refused:][paused:]
        finally:
            database.psql(f"ALTER TABLE {deployment.schema}.sessions SET TABLESPACE pg_default")


@pytest.fixture
def failover() -> Iterator[Failover]:
    """A deployment whose worker reaches its primary through a proxy, with a streaming
    standby beside it."""
    with failover_deployment({}) as world:
        yield world


def test_a_failover_to_a_read_only_standby_pauses_until_it_is_promoted(
    failover: Failover,
) -> None:
    run, primary, standby, proxy = failover.run, failover.primary, failover.standby, failover.proxy
    run.traffic.start().more(100)
    # When the primary stops and the worker's address moves to the standby, which serves
    # reads but refuses every write, for several retry budgets
    primary.stop()
    proxy.retarget(standby.port)
    proxy.drop_all()
    paused = run.wait_logged(PAUSED)
    # (the worker says so: at once, or once the stopping primary's refusals give way)
    wait_until(lambda: "read-only" in run.log()[paused:], timeout=30, message="read-only")
    hold(OUTAGE)
    # Then once the standby is promoted the same worker takes messages again, and every
    # request accepted before, during and after the failover is in the new primary
    standby.promote()
    run.wait_logged(RESUMED, after=paused)
    run.traffic.more(100)
    run.deployment.database = standby
    settle(run)
