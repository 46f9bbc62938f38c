"""End to end on PostgreSQL: producers enqueue on Redis, a real Celery worker applies each
group in one transaction, and loads merge the pending records with the rows."""

from __future__ import annotations

import pytest

from checkpointq.tasks.errors import RequestRefused
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from tests.postgres.conftest import PgDeployment
from tests.support.checkpoints import make_checkpoint

pytestmark = pytest.mark.integration


def test_save_through_the_queue_lands_in_a_row_and_loads_back(pg_live: PgDeployment) -> None:
    # Given a client of a deployment whose store is PostgreSQL
    with pg_live.checkpoint_client() as client:
        # When it saves a checkpoint and waits for it
        handle = client.save(make_checkpoint("pg-save", version=7, last_run_ref="run-7"))
        fence = client.wait_durable(handle, timeout=15)
        # Then the request is durable, loads back, and is listed
        assert handle.seq is not None and fence.seq >= handle.seq and not fence.deleted
        loaded = client.load("pg-save")
        assert loaded is not None and loaded.version == 7
        assert client.list() == ["pg-save"]
    # And the row carries the queryable copy beside the Go-format value
    with pg_live.sql() as conn:
        row = conn.execute(
            f"SELECT version, last_run_ref, value IS NOT NULL FROM {pg_live.schema}.sessions "
            "WHERE session_id = %s",
            (b"pg-save",),
        ).fetchone()
    assert row == (7, "run-7", True)


def test_a_delete_through_the_queue_leaves_a_tombstone_row(pg_live: PgDeployment) -> None:
    with pg_live.checkpoint_client() as client:
        client.wait_durable(client.save(make_checkpoint("pg-del", version=1)), timeout=15)
        # When the session is deleted through the queue
        fence = client.wait_durable(client.delete("pg-del"), timeout=15)
        # Then it is gone for loads and lists, and its row holds the tombstone
        assert fence.deleted
        assert client.load("pg-del") is None
        assert client.list() == []
    with pg_live.sql() as conn:
        row = conn.execute(
            f"SELECT value, fence_deleted FROM {pg_live.schema}.sessions WHERE session_id = %s",
            (b"pg-del",),
        ).fetchone()
    assert row == (None, True)


def test_a_load_merges_a_save_still_queued_with_the_rows(pg_live: PgDeployment) -> None:
    # Given a producer publishing to a queue no worker consumes (its saves stay queued)
    held = CheckpointClient.from_settings(
        pg_live.settings.model_copy(update={"queue": "nobody-consumes"})
    )
    with pg_live.checkpoint_client() as client, held:
        client.wait_durable(client.save(make_checkpoint("pg-merge", version=1)), timeout=15)
        # When a newer save of the session waits in the queue
        held.save(make_checkpoint("pg-merge", version=2))
        # Then every load answers it, though the row still holds version 1
        loaded = client.load("pg-merge")
        assert loaded is not None and loaded.version == 2
        store = pg_live.store()
        row = store.load("pg-merge")
        store.close()
        assert row is not None and row.version == 1
        # And a delete still queued hides the session from loads and lists
        held.delete("pg-merge")
        assert client.load("pg-merge") is None
        assert "pg-merge" not in client.list()


def test_wait_durable_raises_the_reason_of_a_request_the_worker_refused(
    pg_live: PgDeployment,
) -> None:
    # Given a producer whose clock runs 6.5 minutes ahead, told a limit above the workers' 5
    # (so the broker takes what a worker refuses)
    assert pg_live.settings.broker_url is not None
    with CheckpointClient(
        pg_live.settings.broker_url,
        pg_live.store(),
        queue=pg_live.settings.queue,
        clock=SeqClock(lambda: wall_clock_us() + 390_000_000),
        max_seq_ahead_seconds=1200,
    ) as client:
        handle = client.save(make_checkpoint("pg-refused", version=1))
        # When it waits, Then it learns the request was dead-lettered, why, and where: the
        # refusal lives on the broker beside a database
        with pytest.raises(RequestRefused) as refused:
            client.wait_durable(handle, timeout=20)
    assert refused.value.kind == "invalid_input" and "ahead" in refused.value.reason
    letter = pg_live.dead_letters().get(refused.value.entry)
    assert letter is not None and letter.task_id == handle.task_id
