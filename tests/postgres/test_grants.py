"""The grants docs/operations.md#postgresql lists are exactly enough: a role holding those and
nothing more runs the worker and the producers, every save applies, nothing is paused for or
dead-lettered. Without ``USAGE`` on the schema (issue 39: the docs left it out), the worker
pauses saying "permission denied" and dead-letters nothing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointq.store.postgres import PostgresStore
from tests.postgres.conftest import PgDeployment
from tests.postgres.traffic import PAUSED
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration

OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"
MARKER = "<!-- the grants: tests/postgres/test_grants.py runs this block -->"
ROLE = "checkpointq_worker"
SCHEMA = "granted"


def documented_grants() -> list[str]:
    """The statements of the SQL block under the marker in docs/operations.md."""
    text = OPERATIONS.read_text()
    after = text[text.index(MARKER) + len(MARKER) :]
    block = re.search(r"```sql\n(.*?)```", after, re.DOTALL)
    assert block is not None, "no sql block under the grants marker"
    statements = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert statements and all(s.startswith("GRANT ") for s in statements), statements
    return statements


@pytest.fixture(scope="module")
def pg_database() -> Iterator[PostgresServer]:
    """A server whose schema the superuser made (``db upgrade``), and a role that holds the
    documented grants on it, and nothing else."""
    server = PostgresServer().start()
    owner = PostgresStore(server.url, schema=SCHEMA)
    owner.ping()  # creates the schema, as `checkpointq db upgrade` would
    owner.close()
    server.psql(f"CREATE ROLE {ROLE} LOGIN")
    for statement in documented_grants():
        server.psql(statement.replace("SCHEMA checkpointq", f"SCHEMA {SCHEMA}"))
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def pg_settings(pg_database: PostgresServer) -> dict[str, object]:
    url = f"postgresql://{ROLE}@127.0.0.1:{pg_database.port}/postgres"
    return {"store_url": url, "pg_schema": SCHEMA, "store_probe_seconds": 0.5}


def test_the_documented_grants_are_enough_for_workers_and_producers(
    pg_deployment: PgDeployment,
) -> None:
    worker = pg_deployment.worker
    mark = len(worker.log())
    # Given a worker and a producer connecting as a role with exactly the documented grants
    with pg_deployment.checkpoint_client() as client:
        # When they save, Then every save applies and loads back through that role
        handles = [client.save(make_checkpoint(f"g-{n}", version=n + 1)) for n in range(20)]
        for handle in handles:
            assert client.wait_durable(handle, timeout=30).outcome == "applied"
        loaded = client.load("g-7")
        assert loaded is not None and loaded.version == 8
        assert sorted(client.list()) == sorted(f"g-{n}" for n in range(20))
    assert pg_deployment.dead_letters().count() == 0
    assert PAUSED not in worker.log()[mark:], worker.log()[mark:]


def test_without_usage_on_the_schema_the_store_says_permission_denied(
    pg_database: PostgresServer,
) -> None:
    # Given the role without USAGE on the schema (the grant the docs once left out)
    pg_database.psql(f"REVOKE USAGE ON SCHEMA {SCHEMA} FROM {ROLE}")
    store = PostgresStore(
        f"postgresql://{ROLE}@127.0.0.1:{pg_database.port}/postgres", schema=SCHEMA
    )
    try:
        # Then a write probe names the refusal (the worker pauses on it, never dead-letters)
        refusal = store.write_refusal()
        assert refusal is not None and "permission denied" in refusal, refusal
    finally:
        store.close()
        pg_database.psql(f"GRANT USAGE ON SCHEMA {SCHEMA} TO {ROLE}")
