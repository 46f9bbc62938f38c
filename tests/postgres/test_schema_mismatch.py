"""A deployment whose database lacks the schema (auto-upgrade off, `db upgrade` forgotten):
requests wait in the broker, the worker pauses saying why, and `db upgrade` heals it with
nothing lost and nothing dead-lettered."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from checkpointq.worker.cli import cli
from tests.postgres.conftest import PgDeployment
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=[32, 0], ids=["coalescing", "one-task-each"])
def pg_settings(request: pytest.FixtureRequest) -> dict[str, object]:
    """A worker that coalesces groups, and one that runs each request as its own task."""
    return {
        "pg_auto_upgrade": False,
        "store_probe_seconds": 0.5,
        "coalesce_max_items": request.param,
    }


def test_a_missing_schema_holds_requests_until_db_upgrade_runs(
    pg_deployment: PgDeployment,
) -> None:
    worker = pg_deployment.worker
    with pg_deployment.checkpoint_client() as client:
        # Given a worker on a database without the schema, When a save is sent
        handle = client.save(make_checkpoint("schema-wait", version=4))
        # Then the worker pauses, naming the command to run, and dead-letters nothing
        wait_until(
            lambda: "checkpointq db upgrade" in worker.log(),
            timeout=30,
            message="the worker to say the schema is missing",
        )
        assert "store refusing writes" in worker.log()
        assert pg_deployment.dead_letters().list(count=10).entries == []
        # When an operator runs `checkpointq db upgrade`
        upgraded = CliRunner().invoke(
            cli,
            ["db", "upgrade"],
            env={
                "CHECKPOINTQ_STORE_URL": pg_deployment.database.url,
                "CHECKPOINTQ_PG_SCHEMA": pg_deployment.schema,
            },
        )
        assert upgraded.exit_code == 0, upgraded.output
        # Then the worker takes messages again and the save lands, once
        outcome = client.wait_durable(handle, timeout=60)
        assert outcome.outcome == "applied"
        loaded = client.load("schema-wait")
        assert loaded is not None and loaded.version == 4
    assert pg_deployment.dead_letters().list(count=10).entries == []
