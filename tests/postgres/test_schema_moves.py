"""A rolling schema upgrade under running workers: another checkpointq moves the schema to a
newer version whose functions this worker cannot call (a changed ``apply_group``: SQLSTATE
42883) while producers save steadily. The worker pauses with one line naming the newer
schema, dead-letters nothing, and checks the schema again; when the schema comes back (or
new workers take the queue), every request it held applies. Issue 39: 20 of 20 saves were
dead-lettered as ``retries_exhausted`` (UndefinedFunction), as the probe write still went
through and the schema was checked once per store.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.harness import hold
from tests.postgres.conftest import PgDeployment
from tests.postgres.traffic import OUTAGE, PAUSED, RESUMED, RETRIES, Run, running, settle
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: ``apply_group``'s and ``apply_each``'s argument types (store/sql/v2.sql).
_GROUP_ARGS = (
    "integer, bigint, bigint, text[], bytea[], bigint[], bytea[], bytea[], bigint[], "
    "text[], jsonb[]"
)


@pytest.fixture(scope="module")
def pg_database() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module", params=[32, 0], ids=["coalescing", "one-task-each"])
def pg_settings(request: pytest.FixtureRequest) -> dict[str, object]:
    return {**RETRIES, "coalesce_max_items": request.param, "store_probe_seconds": 0.5}


@pytest.fixture
def run(pg_live: PgDeployment) -> Iterator[Run]:
    with running(pg_live) as started:
        yield started


def test_a_schema_moved_under_running_workers_pauses_them_and_dead_letters_nothing(
    run: Run,
) -> None:
    database, schema = run.deployment.database, run.deployment.schema
    # Given producers saving steadily through a running worker
    run.traffic.start().more(100)
    # When another checkpointq upgrades the schema to a newer version, whose functions
    # take other arguments, for several retry budgets
    database.psql(
        f"BEGIN; INSERT INTO {schema}.schema_version (version) VALUES (3); "
        f"ALTER FUNCTION {schema}.apply_group({_GROUP_ARGS}) RENAME TO apply_group_v3; "
        f"ALTER FUNCTION {schema}.apply_each({_GROUP_ARGS}) RENAME TO apply_each_v3; COMMIT"
    )
    paused = run.wait_logged(PAUSED)
    hold(OUTAGE)
    # Then the worker paused once, saying why, and dead-letters nothing
    pause_lines = [line for line in run.log()[paused:].splitlines() if PAUSED in line]
    assert len(pause_lines) == 1, pause_lines
    run.wait_logged("newer than this checkpointq", after=paused)
    assert run.deployment.dead_letters().count() == 0
    # When the schema comes back (the upgrade rolled back), Then it takes messages again
    # and every request it held, and every later one, applies; none dead-lettered
    database.psql(
        f"BEGIN; DELETE FROM {schema}.schema_version WHERE version = 3; "
        f"ALTER FUNCTION {schema}.apply_group_v3({_GROUP_ARGS}) RENAME TO apply_group; "
        f"ALTER FUNCTION {schema}.apply_each_v3({_GROUP_ARGS}) RENAME TO apply_each; COMMIT"
    )
    run.wait_logged(RESUMED, after=paused)
    run.traffic.more(100)
    settle(run)
