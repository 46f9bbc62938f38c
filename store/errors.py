"""One exception tree for checkpointq.

Callers branch on three questions: is the input wrong (never retry), is the store
unreachable (retry later), or is what we stored unreadable (needs an operator)?
"""

from __future__ import annotations


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
