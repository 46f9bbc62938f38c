"""``CHECKPOINTQ_PG_DURABILITY=replicated``: a write counts as durable once a standby has it.

A worker settles a request (removes its pending record, acknowledges its message) once its
write is durable; a producer's ``wait_durable`` reports it then. With ``local``, durable is
the primary's commit: an asynchronous standby promoted before it received the last commits
loses them, and the requests are settled already, so nothing brings them back. With
``replicated`` the store waits after each commit until at least one standby has flushed the
WAL up to it, and a write that no standby flushed in time is not settled: its message stays
on the broker and is applied again (a fenced write: idempotent), on the new primary too.

Which standbys count: every physical replication slot (``pg_replication_slots``, readable
by every role; a slot's ``restart_lsn`` is its standby's flush position) and every physical
walsender (``pg_stat_replication.flush_lsn``, readable with ``pg_read_all_stats``). A slot
whose standby is down still counts, and holds writes until it catches up: that is how a
standby that is down holds requests on the broker. A primary with neither has no standby to
wait for, and a write is durable at its commit, as with ``local``. A synchronous standby
(``synchronous_standby_names``) has flushed before the commit returns: no wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

#: The durability modes (``CHECKPOINTQ_PG_DURABILITY``).
LOCAL, REPLICATED = "local", "replicated"
MODES = (LOCAL, REPLICATED)

#: The standbys' best flush position, and what is known of them. Logical walsenders
#: (change data capture) are not standbys: they are left out by their slots' type.
STATUS_SQL = """
SELECT
    pg_current_wal_lsn()::text,
    (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical'),
    (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical' AND active),
    (SELECT max(restart_lsn)::text FROM pg_replication_slots WHERE slot_type = 'physical'),
    (SELECT count(*) FROM pg_stat_replication AS r WHERE NOT EXISTS (
        SELECT 1 FROM pg_replication_slots AS s
        WHERE s.active_pid = r.pid AND s.slot_type = 'logical')),
    (SELECT max(flush_lsn)::text FROM pg_stat_replication AS r WHERE NOT EXISTS (
        SELECT 1 FROM pg_replication_slots AS s
        WHERE s.active_pid = r.pid AND s.slot_type = 'logical')),
    (SELECT count(state) FROM pg_stat_replication AS r WHERE NOT EXISTS (
        SELECT 1 FROM pg_replication_slots AS s
        WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))
"""

#: Sleeps between two polls of the standbys' position: short at first (a standby on the
#: same network flushes within a round trip or two), then no more than 20 ms.
_FIRST_SLEEP, _MAX_SLEEP = 0.0005, 0.02


@dataclass(frozen=True, slots=True)
class Standbys:
    """What one status read saw: the primary's WAL position and the standbys'."""

    lsn: int
    slots: int
    active_slots: int
    slot_flush: int | None
    walsenders: int
    walsender_flush: int | None
    #: Walsenders whose details this role sees (``state`` is hidden with the rest without
    #: ``pg_read_all_stats``): one seen with no flush position yet has just connected.
    walsenders_seen: int = 0

    @property
    def expected(self) -> bool:
        """Whether any standby is there to wait for (a slot, or one streaming now)."""
        return self.slots > 0 or self.walsenders > 0

    @property
    def flushed(self) -> int | None:
        """The furthest position a standby is known to have flushed."""
        known = [p for p in (self.slot_flush, self.walsender_flush) if p is not None]
        return max(known) if known else None

    def blind(self) -> bool:
        """Walsenders stream, no slot says how far, and this role may not see their
        positions (``pg_stat_replication`` hides them without ``pg_read_all_stats``). One
        whose details show but no flush position yet has just connected: not blind, the
        write waits for it."""
        return (
            self.slots == 0
            and self.walsenders > 0
            and self.walsender_flush is None
            and self.walsenders_seen == 0
        )

    def why_not(self, target: int) -> str:
        """Why no standby is known to have flushed ``target``, in one line."""
        if self.blind():
            return (
                "standbys stream, but this role cannot see how far (GRANT pg_read_all_stats, "
                "or give the standbys replication slots; or CHECKPOINTQ_PG_DURABILITY=local)"
            )
        behind = "none flushed yet" if self.flushed is None else f"{target - self.flushed} bytes"
        if self.slots and not self.active_slots and not self.walsenders:
            return f"no standby connected ({self.slots} replication slot(s) inactive; {behind})"
        return f"no standby has flushed the commit ({behind} behind)"


def parse_lsn(text: str | None) -> int | None:
    """``'16/B374D848'`` as a byte position."""
    if text is None:
        return None
    high, _, low = str(text).partition("/")
    return (int(high, 16) << 32) + int(low, 16)


def status(conn: Any) -> Standbys:
    row = conn.execute(STATUS_SQL).fetchone()
    return Standbys(
        lsn=parse_lsn(row[0]) or 0,
        slots=int(row[1]),
        active_slots=int(row[2]),
        slot_flush=parse_lsn(row[3]),
        walsenders=int(row[4]),
        walsender_flush=parse_lsn(row[5]),
        walsenders_seen=int(row[6]),
    )


class Waiter:
    """``wait_flushed`` for one store: a primary found without any standby is not asked
    again for ``NO_STANDBY_RECHECK`` seconds, so that a write there costs no extra round
    trip (a standby that appears meanwhile counts from the next check on)."""

    #: Seconds a primary seen without standbys is taken to have none.
    NO_STANDBY_RECHECK = 1.0

    def __init__(self) -> None:
        self._none_until = 0.0

    def wait(self, conn: Any, timeout: float) -> str | None:
        if time.monotonic() < self._none_until:
            return None
        seen = status(conn)
        if not seen.expected:
            self._none_until = time.monotonic() + self.NO_STANDBY_RECHECK
            return None
        return wait_flushed(conn, timeout, seen)


def wait_flushed(conn: Any, timeout: float, seen: Standbys | None = None) -> str | None:
    """Wait until a standby has flushed the WAL written so far on ``conn``'s primary (so,
    every commit this connection made); None once one has (or there is no standby), else
    why not after ``timeout`` seconds. ``seen``: a status read just now."""
    seen = seen or status(conn)
    target = seen.lsn
    deadline = time.monotonic() + timeout
    sleep = _FIRST_SLEEP
    while True:
        if not seen.expected:
            return None
        flushed = seen.flushed
        if flushed is not None and flushed >= target:
            return None
        if seen.blind() or time.monotonic() >= deadline:
            return seen.why_not(target)
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP)
        seen = status(conn)


def standby_refusal(conn: Any) -> str | None:
    """Why writes cannot become durable now, without waiting: standbys are expected and
    none is connected, or this role cannot see them; None otherwise (lag alone is no
    refusal: writes wait for it, each within its timeout)."""
    seen = status(conn)
    if seen.blind():
        return seen.why_not(seen.lsn)
    if seen.slots and not seen.active_slots and not seen.walsenders:
        return seen.why_not(seen.lsn)
    return None
