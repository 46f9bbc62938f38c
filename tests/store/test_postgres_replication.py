"""How the PostgreSQL store reads its standbys' progress (``store/postgres_replication.py``):
a role that may not see it, and a standby that has just connected, are told apart."""

from __future__ import annotations

from typing import Any

from checkpointq.store import postgres_replication


class _Status:
    """A connection whose status read answers ``row`` (``STATUS_SQL``'s columns)."""

    def __init__(self, row: tuple[Any, ...]) -> None:
        self.row = row

    def execute(self, sql: str) -> Any:
        assert sql == postgres_replication.STATUS_SQL
        return self

    def fetchone(self) -> tuple[Any, ...]:
        return self.row


#: lsn, physical slots, active ones, their restart_lsn, walsenders, their best flush_lsn,
#: walsenders whose details this role sees.
_STREAMING_NO_FLUSH_YET = ("0/3000060", 0, 0, None, 1, None, 1)
_HIDDEN_FROM_THIS_ROLE = ("0/3000060", 0, 0, None, 1, None, 0)


def test_a_standby_that_has_just_connected_is_no_refusal() -> None:
    # Given a standby streaming that has not reported a flush yet (its walsender's state
    # shows: this role sees the details, there are none yet)
    conn = _Status(_STREAMING_NO_FLUSH_YET)
    # Then writes wait for it rather than pause the worker
    assert not postgres_replication.status(conn).blind()
    assert postgres_replication.standby_refusal(conn) is None


def test_a_role_that_cannot_see_the_standbys_is_told_how_to_fix_it() -> None:
    conn = _Status(_HIDDEN_FROM_THIS_ROLE)
    refusal = postgres_replication.standby_refusal(conn)
    assert refusal is not None and "cannot see how far" in refusal
    assert "pg_read_all_stats" in refusal
