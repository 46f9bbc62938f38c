"""A rolling upgrade seen from an old worker: the schema turns newer than it knows before its
processes connect. Their requests wait in the broker, never dead-lettered, and land once the
schema is one they speak again."""

from __future__ import annotations

import pytest

from tests.postgres.conftest import PgDeployment
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=[32, 0], ids=["coalescing", "one-task-each"])
def pg_settings(request: pytest.FixtureRequest) -> dict[str, object]:
    """A worker that coalesces groups, and one that runs each request as its own task; short
    retries, so that they run out while the schema is wrong."""
    return {
        "coalesce_max_items": request.param,
        "store_probe_seconds": 0.5,
        "retry_max": 2,
    }


def test_a_newer_schema_holds_requests_without_dead_letters(pg_deployment: PgDeployment) -> None:
    worker = pg_deployment.worker
    # Given a running worker whose pool processes have not connected yet, When another
    # checkpointq records a newer schema version
    wait_until(
        lambda: (
            "schema_version"
            in pg_deployment.database.psql(
                f"SELECT to_regclass('{pg_deployment.schema}.schema_version')"
            )
        ),
        timeout=30,
        message="the worker's probe to create the schema",
    )
    pg_deployment.database.psql(
        f"INSERT INTO {pg_deployment.schema}.schema_version (version) VALUES (99)"
    )
    with pg_deployment.checkpoint_client() as client:
        handles = [client.save(make_checkpoint(f"newer-{n}", version=n + 1)) for n in range(4)]
        # Then the worker says why it cannot write, and dead-letters nothing
        wait_until(
            lambda: "newer than this checkpointq" in worker.log(),
            timeout=30,
            message="the worker to name the newer schema",
        )
        assert pg_deployment.dead_letters().list(count=10).entries == []
        # When the schema is one it speaks again, Then every save lands, none dead-lettered
        pg_deployment.database.psql(
            f"DELETE FROM {pg_deployment.schema}.schema_version WHERE version = 99"
        )
        for handle in handles:
            assert client.wait_durable(handle, timeout=60).outcome == "applied"
    assert pg_deployment.dead_letters().list(count=10).entries == []
