"""One exception tree for checkpointq.

Callers branch on three questions: is the input wrong (never retry), is the store
unreachable (retry later), or is what we stored unreadable (needs an operator)?
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Root of every error checkpointq raises on purpose."""


class InvalidInput(CheckpointError, ValueError):
    """A request that can never succeed as sent; retrying it is pointless."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InvalidCheckpoint(InvalidInput):
    """The checkpoint document does not follow the wire format."""


class InvalidSessionId(InvalidInput):
    """The session id is not a string, is empty, or has no UTF-8 form (a lone surrogate)."""


class CheckpointTooLarge(InvalidInput):
    """Even the newest message alone does not fit the stored-size budget."""


class RefusedByStore(InvalidInput):
    """The store refuses this one request's data (a value PostgreSQL cannot hold): its
    words say why. The store takes every other request: never retried."""


class StoreNotConfigured(CheckpointError, ValueError):
    """No store URL: neither a store URL nor a plain Redis broker URL is configured."""


class StoreUnavailable(CheckpointError):
    """The backing store could not be reached or answered with a transient error."""

    #: Why, when the store answered that it refuses writes now (a full disk, no connection
    #: slot left, read-only), in plain words; None when it could not be reached at all.
    #: Kept through pickling, so that a pool process's failure tells the worker's gate.
    refusal: str | None = None


class CorruptCheckpoint(CheckpointError):
    """A stored value exists but cannot be decoded; one session is affected, not the store."""

    def __init__(self, session_id: str, reason: str) -> None:
        self.session_id = session_id
        self.reason = reason
        super().__init__(f"stored checkpoint for session {session_id!r} is unreadable: {reason}")


class SessionBusy(StoreUnavailable):
    """One session's row is held by another client (a row lock, or a statement that ran
    past ``statement_timeout``): that session waits and retries on its own; every other
    session applies, and the store is not said to refuse writes."""

    def __init__(self, session_id: str, holder: str, *, by_worker: bool = False) -> None:
        self.session_id = session_id
        #: Who holds the row, as far as the store may see (pid, user, query, for how long).
        self.holder = holder
        #: Held by another checkpointq worker's statement (itself waiting on a row further
        #: on): a moment's contention, over once that statement ends.
        self.by_worker = by_worker
        super().__init__(f"session {session_id!r} waits on a row lock held by {holder}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in a pool process and handed to the main one: rebuilt from its fields.
        return (_session_busy, (self.session_id, self.holder, self.by_worker))


def _session_busy(session_id: str, holder: str, by_worker: bool) -> SessionBusy:
    return SessionBusy(session_id, holder, by_worker=by_worker)


class NotDurableYet(StoreUnavailable):
    """The store applied the write, but it is not durable as configured yet (no standby
    flushed it in time, ``CHECKPOINTQ_PG_DURABILITY=replicated``): applying it again later
    is safe, and it must not be settled, nor dead-lettered, meanwhile."""
