"""Errors of the task layer, under the store's one root (``store.CheckpointError``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis import exceptions as redis_errors

from checkpointq.store.errors import CheckpointError, InvalidInput, StoreUnavailable


class BrokerUnavailable(CheckpointError):
    """The broker could not be reached: to publish a request (after retries), or by a probe."""


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
