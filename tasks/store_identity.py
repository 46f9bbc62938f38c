"""One deployment, one truth: a producer must read the store its broker's workers write to.

Each store has an identity created once in the store itself by its first user, with when it
was made (``CheckpointStore.identity``). Every worker reads its store's identity (every
few heartbeats) and announces it, with when it read it, on a Redis broker with each
heartbeat. After a read, a producer reads its own store's identity, then the announcement
(``StoreCheck``): the same, they agree; different, and read by the worker after the
producer's identity was made, it raises ``StoreMismatch`` naming both stores instead of
answering from one no worker writes. An identity read before (a store emptied and given a
new one since, or an identity the producer made just now) proves nothing yet: the producer
looks again after ``RECHECK_SECONDS``, as it does while no worker has announced at all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from checkpointq.store.base import identity_created_ms
from checkpointq.store.keys import KeySpace
from checkpointq.tasks.errors import StoreMismatch

#: How long a producer waits before it compares again, until it agrees with the workers:
#: a worker's heartbeat (CHECKPOINTQ_HEARTBEAT_SECONDS' default).
RECHECK_SECONDS = 5.0
#: How much later than an identity's making an announcement must be to count: the
#: disagreement allowed between the worker's clock and the identity maker's.
CLOCK_MARGIN_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class PublishedStore:
    """What a worker on the broker said of its store, with a heartbeat."""

    identity: str
    store: str  # the store's URL, redacted
    worker: str
    time: float  # when the worker read it from its store, by its clock

    @classmethod
    def decode(cls, raw: bytes | str | None) -> PublishedStore | None:
        if raw is None:
            return None
        try:
            fields = json.loads(raw)
            return cls(
                str(fields["identity"]),
                str(fields["store"]),
                str(fields["worker"]),
                float(fields["time"]),
            )
        except (ValueError, KeyError, TypeError):
            return None  # not ours to judge: no comparison rather than a false alarm


def publish_command(
    keys: KeySpace,
    identity: str,
    store: str,
    worker: str,
    read_at: float,
    ttl_ms: int,
) -> tuple[Any, ...]:
    """The SET a worker sends with each heartbeat (``store``: its redacted URL; ``read_at``:
    when it read ``identity`` from the store, by its clock, which is what a producer
    compares with its own identity's making)."""
    value = json.dumps({"identity": identity, "store": store, "worker": worker, "time": read_at})
    return ("SET", keys.published_store(), value, "PX", ttl_ms)


class StoreCheck:
    """A client's comparison of its store with the workers', without I/O: ``due`` says when
    to read both identities (this store's first), ``compare`` what they mean."""

    def __init__(self) -> None:
        self.agreed = False
        self._checked_at: float | None = None

    def due(self) -> bool:
        if self.agreed:
            return False
        at = self._checked_at
        return at is None or time.monotonic() - at >= RECHECK_SECONDS

    def unknown(self) -> None:
        """Neither identity could be read now: look again after ``RECHECK_SECONDS``."""
        self._checked_at = time.monotonic()

    def compare(
        self, mine: str | None, my_store: str, published: PublishedStore | None, broker: str
    ) -> None:
        """Judge this store's identity (None: this kind of store has none) against the
        workers' announcement (None: none yet), read after it.

        Raises:
            StoreMismatch: the workers announced another store after this one's identity
                was made.
        """
        self._checked_at = time.monotonic()
        if mine is None or published is None:
            return
        if mine == published.identity:
            self.agreed = True
            return
        created = identity_created_ms(mine)
        if created is None or published.time < created / 1000 + CLOCK_MARGIN_SECONDS:
            return  # said before this identity existed: proves nothing yet
        self._checked_at = None  # every read raises, until the configuration changes
        raise StoreMismatch(
            f"this producer reads the store {my_store} (identity {mine}), but the workers "
            f"on {broker} write to {published.store} (identity {published.identity}, said "
            f"by {published.worker}): its loads would miss what they apply. Point it at "
            "their store (CHECKPOINTQ_STORE_URL, as `checkpointq up` prints it)"
        )
