"""Sessions as every producer sees them, for ``checkpointq show`` and ``ls``.

A producer's ``load`` and ``list`` (``CheckpointClient``) merge the writes still queued (the
pending records on the broker) with the store, so the CLI reads through the same calls and
answers the same. What it adds is telling a queued answer from a stored one: the fence a
load returns is the store's own, unless a request still queued answered, and then it is that
request's, ordered after the store's fence (or where the store has none). The store's fence is read
after the load, so a request a worker applied in between counts as stored, as it now is.
docs/operations.md ("Reading sessions: show and ls") describes what the commands print.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointq.store.base import Fence
from checkpointq.store.model import Checkpoint
from checkpointq.tasks.producer.client import CheckpointClient


@dataclass(frozen=True, slots=True)
class Session:
    """One session as a load answers it."""

    session_id: str
    #: The live checkpoint, or None (never saved, expired, or deleted).
    checkpoint: Checkpoint | None
    #: The request that answered when it is still queued, not yet in the store (a save, or
    #: a delete: ``queued.deleted``); None when the store answered.
    queued: Fence | None


def read(client: CheckpointClient, session_id: str) -> Session:
    """``session_id`` as ``client.load`` answers it, and whether a queued request answered.

    Raises:
        BrokerUnavailable, StoreUnavailable: as ``CheckpointClient.load``.
    """
    checkpoint, fence = client.load_with_fence(session_id)
    stored = client.store.fence(session_id)
    queued = fence if fence is not None and (stored is None or fence.key > stored.key) else None
    return Session(session_id, checkpoint, queued)


@dataclass(frozen=True, slots=True)
class Listing:
    """The live session ids as ``client.list`` answers them, sorted, and which of them (or of
    the store's) only queued requests make so."""

    sessions: list[str]
    #: Listed sessions whose save is still queued, not yet in the store.
    queued_saves: list[str]
    #: Sessions the store still lists that a queued delete removes (not listed).
    queued_deletes: list[str]


def listing(client: CheckpointClient, limit: int | None = None) -> Listing:
    """Every live session id (the first ``limit``, sorted), merged as ``client.list`` merges.

    The store's own listing, read after, gives the ids where the two differ; each of those
    is read as ``read`` does (one load each, as many as there are queued requests that change
    the listing), so a session created or removed between the two listings is not taken for
    a queued request.

    Raises:
        BrokerUnavailable, StoreUnavailable: as ``CheckpointClient.list``.
    """
    merged = sorted(client.list())
    stored = set(client.store.list())
    sessions = merged if limit is None else merged[:limit]
    saves = [s for s in sessions if s not in stored and _queued(client, s, deleted=False)]
    gone = sorted(stored.difference(merged))
    deletes = [s for s in gone if _queued(client, s, deleted=True)]
    return Listing(sessions, saves, deletes)


def _queued(client: CheckpointClient, session_id: str, *, deleted: bool) -> bool:
    queued = read(client, session_id).queued
    return queued is not None and queued.deleted == deleted
