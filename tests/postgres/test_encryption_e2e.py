"""End to end on PostgreSQL with encryption at rest: the rows, their queryable copies and
every file of the database server (tables, TOAST, WAL) hold no byte of the conversation
once a CHECKPOINT has written them out. Given / When / Then."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from checkpointq.store.encryption import generate_key, is_sealed
from checkpointq.tasks.producer.outcomes import APPLIED
from tests.postgres.conftest import PgDeployment
from tests.support.checkpoints import secret_checkpoint
from tests.support.redis_contents import everything_in

pytestmark = pytest.mark.integration

#: Unique to this run: other tests write to the same server, some in clear.
SECRET = f"pg-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def pg_settings() -> dict[str, object]:
    return {"encryption_keys": f"k1:{generate_key()}"}


def _files_holding(root: Path, needle: bytes) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle in path.read_bytes():
                    found.append(str(path.relative_to(root)))
            except OSError:
                continue
    return found


def test_no_byte_of_the_conversation_is_in_the_rows_or_the_servers_files(
    pg_live: PgDeployment,
) -> None:
    # Given encrypted saves applied through the queue
    with pg_live.checkpoint_client() as client:
        handles = [
            client.save(secret_checkpoint(f"pg-enc-{n}", SECRET, version=n)) for n in (1, 2, 3)
        ]
        for handle in handles:
            assert client.wait_durable(handle, timeout=20).outcome == APPLIED
        # Then each loads back as sent
        for n in (1, 2, 3):
            assert client.load(f"pg-enc-{n}") == secret_checkpoint(f"pg-enc-{n}", SECRET, version=n)
    # And each row holds a sealed value, its version, and nothing else of the conversation
    with pg_live.sql() as conn:
        rows = conn.execute(
            f"SELECT value, version, last_run_ref, metadata FROM {pg_live.schema}.sessions "
            "ORDER BY version"
        ).fetchall()
        conn.execute("CHECKPOINT")
    assert [(isinstance(r[0], bytes) and is_sealed(r[0]), *r[1:]) for r in rows] == [
        (True, n, None, None) for n in (1, 2, 3)
    ]
    # And no file of the server (tables, TOAST, WAL) holds it, nor the broker
    assert _files_holding(pg_live.database.data, SECRET.encode()) == []
    assert SECRET.encode() not in everything_in(pg_live.broker_client())
