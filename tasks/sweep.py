"""The sweep of expired sessions: one at a time under a short lock, each expiry announced.

``sweep()`` is what the ``checkpoint.expire_stale`` task and ``checkpointq sweep`` run. Two
beats or a beat and a person may run it concurrently: the lock makes the second one skip,
and even without it each session is expired once (the store's expire script re-checks the
deadline atomically), so nothing is double-applied or double-announced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import LockNotOwnedError
from redis.lock import Lock

from checkpointq.store.base import CheckpointStore
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import display_id
from checkpointq.tasks.errors import redis_unavailable
from checkpointq.tasks.events import EXPIRED, announce

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one sweep did. ``locked_out``: another sweep held the lock, nothing was done."""

    expired: list[str]
    locked_out: bool = False
    #: True when the sweep hit its limit: more stale sessions may remain for the next one.
    more: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "outcome": "locked_out" if self.locked_out else "swept",
            "expired": len(self.expired),
            "more": self.more,
        }


def sweep(
    store: CheckpointStore,
    client: Any,
    keys: KeySpace,
    *,
    limit: int = 10_000,
    events_maxlen: int = 100_000,
    lock_seconds: float = 60.0,
) -> SweepResult:
    """Expire up to ``limit`` stale sessions and XADD one ``expired`` event per session
    (``checkpointq.tasks.events``).

    Args:
        store: the checkpoint store to sweep.
        client: a ``redis.Redis`` on the store Redis (for the lock and the events stream).
        keys: the deployment's key space.
        limit: most sessions expired by this call.
        events_maxlen: the events stream is trimmed to about this many entries.
        lock_seconds: the lock's lifetime: a crashed sweep blocks others at most this long.

    Raises:
        StoreUnavailable: the store Redis could not be reached.
    """
    # redis-py's Lock is SET NX PX with a random token, released by a compare-and-delete
    # script: a sweep that outlived its lock cannot release the next holder's.
    lock = Lock(client, keys.sweep_lock(), timeout=lock_seconds, blocking=False)
    with redis_unavailable("take the sweep lock"):
        taken = lock.acquire()
    if not taken:
        logger.info("sweep skipped: another sweep holds the lock")
        return SweepResult([], locked_out=True)
    try:
        expired = store.expire_stale(limit=limit)
        announce(client, keys, EXPIRED, expired, events_maxlen)
    finally:
        _release(lock)
    if expired:
        shown = " ".join(display_id(session_id) for session_id in expired)
        logger.info("sweep expired %d session(s): %s", len(expired), shown)
    else:
        logger.debug("sweep found nothing to expire")
    return SweepResult(expired, more=len(expired) >= limit)


def _release(lock: Lock) -> None:
    with redis_unavailable("release the sweep lock"):
        try:
            lock.release()
        except LockNotOwnedError:
            # The sweep outlived its lock: harmless (expiry is idempotent), worth knowing.
            logger.warning("the sweep lock expired before the sweep finished")
