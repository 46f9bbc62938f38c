"""Errors of the task layer, under the store's one root (``store.CheckpointError``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from redis import exceptions as redis_errors

from checkpointq.store.errors import CheckpointError, InvalidInput, StoreUnavailable

if TYPE_CHECKING:
    from checkpointq.tasks.producer.requests import Handle


class BrokerUnavailable(CheckpointError):
    """The broker could not be reached: to publish a request (after retries), or by a probe."""


class PendingRecordMissing(BrokerUnavailable):
    """A load found that a request of the session is still queued (the broker's pending
    index holds it) but its pending record is gone (deleted by hand, evicted): the store
    alone could be older than an accepted write, so the load refuses rather than serve it
    (issue 44: a missing record is not an applied one)."""


class ReplicationTimeout(CheckpointError):
    """``CHECKPOINTQ_BROKER_DURABILITY=replicated``: the broker's primary accepted the request
    (it is queued, its pending record written, and it may still apply), but fewer replicas
    than asked acknowledged it within the timeout (``WAIT``), so a failover now could lose it.
    Retrying is harmless (every request is fenced): save again, or ``wait_durable(handle)``
    for this one. ``handle`` is the request's (None until the client fills it in)."""

    def __init__(self, message: str, *, acked: int, replicas: int, timeout_ms: int) -> None:
        super().__init__(message)
        self.acked, self.replicas, self.timeout_ms = acked, replicas, timeout_ms
        #: The request's handle (``producer.requests.Handle``), for ``wait_durable``.
        self.handle: Handle | None = None


class SeqRefused(InvalidInput):
    """The broker refused a request at publish: this producer's clock runs ahead of the
    broker's, or the request's ``seq`` is too far ahead or already past its deadline. Nothing
    was published; fix the clock (NTP), or the ``after=`` fence passed in."""


class NotReplayable(CheckpointError):
    """A dead letter cannot be replayed: its task or arguments could never be decoded."""


class RequestRefused(CheckpointError):
    """A worker dead-lettered the request a producer waits for: it will never apply."""

    def __init__(self, description: str, kind: str, reason: str, entry: str) -> None:
        super().__init__(f"{description} was refused ({kind}): {reason}; dead letter {entry}")
        self.kind, self.reason, self.entry = kind, reason, entry


class StoreMismatch(CheckpointError):
    """This producer reads another store than the workers on its broker write to: its loads
    would miss every applied write (``checkpointq.tasks.store_identity``)."""


class NotFound(CheckpointError):
    """No dead letter has that id (already replayed, purged or trimmed)."""


@contextmanager
def redis_unavailable(action: str) -> Iterator[None]:
    """Turn any redis-py error into StoreUnavailable at the boundary (retried, then kept)."""
    try:
        yield
    # RedisClusterException is not a RedisError: a cluster client raises it while it
    # relearns the slot map (a failover, or no node answering yet).
    except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
        raise StoreUnavailable(f"{action}: Redis error ({type(exc).__name__}: {exc})") from exc
