"""The command line on a PostgreSQL store: the schema's own commands (`db upgrade`, `db
version`), and show, ls, sweep, dlq, stats and health as on Redis."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner, Result

from checkpointq.store import postgres_schema
from checkpointq.store.postgres import PostgresStore
from checkpointq.worker.cli import cli
from tests.postgres.conftest import PgDeployment
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.postgres import PostgresServer
from tests.support.servers import wait_until
from tests.support.workers import QUEUE

pytestmark = pytest.mark.integration


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory (no .env) and no inherited CHECKPOINTQ_* variables."""
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("CHECKPOINTQ_")]:
        monkeypatch.delenv(name)
    return tmp_path


def run(env: dict[str, str], *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def deployment_env(deployment: PgDeployment) -> dict[str, str]:
    return {
        "CHECKPOINTQ_BROKER_URL": deployment.broker.url,
        "CHECKPOINTQ_STORE_URL": deployment.database.url,
        "CHECKPOINTQ_PG_SCHEMA": deployment.schema,
        "CHECKPOINTQ_QUEUE": deployment.settings.queue,
    }


def test_db_upgrade_creates_the_schema_once_and_says_so(
    workdir: Path, postgres_server: PostgresServer
) -> None:
    env = {"CHECKPOINTQ_STORE_URL": postgres_server.url, "CHECKPOINTQ_PG_SCHEMA": "cli_up"}
    try:
        # Given a database without the schema: `db version` says it is missing
        missing = run(env, "db", "version", "--json")
        assert missing.exit_code == 0, missing.output
        assert json.loads(missing.output)["state"] == "missing"
        # When `db upgrade` runs twice
        first = run(env, "db", "upgrade")
        second = run(env, "db", "upgrade", "--json")
        # Then the first applies every version and the second finds nothing to do
        assert first.exit_code == 0 and "upgraded to version" in first.output, first.output
        assert json.loads(second.output)["applied"] == []
        assert json.loads(run(env, "db", "version", "--json").output) == {
            "schema": "cli_up",
            "version": postgres_schema.SCHEMA_VERSION,
            "expected": postgres_schema.SCHEMA_VERSION,
            "state": "current",
        }
    finally:
        postgres_server.psql("DROP SCHEMA IF EXISTS cli_up CASCADE")


def test_db_upgrade_on_a_redis_store_is_one_clear_line(workdir: Path) -> None:
    result = CliRunner().invoke(
        cli, ["db", "upgrade"], env={"CHECKPOINTQ_STORE_URL": "redis://127.0.0.1:1/0"}
    )
    assert result.exit_code == 1
    assert "the store is not PostgreSQL" in result.output


def test_a_store_told_not_to_upgrade_names_the_command_and_refuses_a_newer_schema(
    postgres_server: PostgresServer,
) -> None:
    # Given a store that must not create its schema
    store = PostgresStore(postgres_server.url, schema="cli_manual", auto_upgrade=False)
    try:
        # Then its first call says what to run
        with pytest.raises(postgres_schema.SchemaMismatch, match="checkpointq db upgrade"):
            store.load("x")
        # And once a newer checkpointq upgraded the schema past this one, it refuses to
        # write to it (reads are still served: producers keep loading in a rolling upgrade)
        with psycopg.connect(postgres_server.url, autocommit=True) as conn:
            postgres_schema.upgrade(conn, "cli_manual")
            conn.execute("INSERT INTO cli_manual.schema_version (version) VALUES (99)")
        newer = PostgresStore(postgres_server.url, schema="cli_manual")
        try:
            assert newer.load("x") is None
            with pytest.raises(postgres_schema.SchemaMismatch, match="newer than this"):
                newer.save(make_checkpoint("x"))
        finally:
            newer.close()
    finally:
        store.close()
        postgres_server.psql("DROP SCHEMA IF EXISTS cli_manual CASCADE")


def test_show_ls_stats_and_sweep_read_the_database(workdir: Path, pg_live: PgDeployment) -> None:
    env = deployment_env(pg_live)
    with pg_live.checkpoint_client() as client:
        for n in range(3):
            client.wait_durable(client.save(make_checkpoint(f"cli-{n}", version=n + 1)), 15)
    # show: the checkpoint, as producers load it
    shown = run(env, "show", "cli-1", "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["version"] == 2
    # ls: every live session, and a page at a time with a cursor
    assert run(env, "ls").output.split() == ["cli-0", "cli-1", "cli-2"]
    # (pages follow the rows' keys: each id once, in no promised order)
    page = json.loads(run(env, "ls", "--page-size", "2", "--json").output)
    assert len(page["sessions"]) == 2 and page["cursor"]
    rest = json.loads(
        run(env, "ls", "--page-size", "2", "--cursor", page["cursor"], "--json").output
    )
    assert len(rest["sessions"]) == 1 and rest["cursor"] is None
    assert sorted(page["sessions"] + rest["sessions"]) == ["cli-0", "cli-1", "cli-2"]
    # stats: the sessions the database holds
    stats = run(env, "stats", "--json")
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["live_sessions"] == 3
    # sweep: a session past its deadline (moved there behind the store's back) is expired
    with pg_live.sql() as conn:
        conn.execute(
            f"UPDATE {pg_live.schema}.sessions SET value_deadline_ms = %s WHERE session_id = %s",
            (int(time.time() * 1000) - 1, b"cli-0"),
        )
    swept = run(env, "sweep", "--json")
    assert json.loads(swept.output) == {"outcome": "swept", "expired": 1}
    assert run(env, "ls").output.split() == ["cli-1", "cli-2"]


def test_dead_letters_live_on_the_broker_beside_the_database(
    workdir: Path, pg_live: PgDeployment
) -> None:
    env = deployment_env(pg_live)
    # Given a request the worker refuses for its body (an unknown field type)
    broker = pg_live.broker_client()
    broker.lpush(QUEUE, protocol2("checkpoint.save", [{"sessionId": 5}], {"seq": 1_000}))
    letters = pg_live.dead_letters()
    wait_until(lambda: letters.list(count=10).entries, timeout=20, message="the dead letter")
    # Then `dlq ls` shows it, from the broker's Redis
    listed = run(env, "dlq", "ls", "--json")
    assert listed.exit_code == 0, listed.output
    entries = json.loads(listed.output)["entries"]
    assert len(entries) == 1 and "sessionId" in json.dumps(entries[0])


def test_health_checks_the_database_with_a_write(workdir: Path, pg_live: PgDeployment) -> None:
    env = deployment_env(pg_live)
    result = run(env, "health", "--json")
    report = json.loads(result.output)
    store = report["checks"]["store"]
    assert store["ok"] and "accepts writes" in store["detail"], report
    assert result.exit_code == 0, report
