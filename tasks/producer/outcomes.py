"""How a request ended, read from the store: what ``wait_durable`` answers.

The fence keeps the winning request's id, and a worker that dead-letters a request records
the refusal under the request's id, so a producer can tell its own request's fate:

* **applied**: the fence names the request (it is what the store holds, or its delete is);
* **superseded**: the fence passed the request's ``seq`` with another request, so it can no
  longer apply (it was applied and overwritten, or refused as stale);
* **refused**: dead-lettered (``RequestRefused``, with the kind, reason and entry);
* otherwise it is still on its way.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointq.store.base import Fence
from checkpointq.tasks.messages import SAVE, SAVE_STAGED

APPLIED = "applied"
SUPERSEDED = "superseded"


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """A request's known outcome and the fence it was read from."""

    #: ``"applied"`` or ``"superseded"``.
    outcome: str
    #: The ``seq`` of the session's last applied request.
    seq: int
    #: Whether that request was a delete.
    deleted: bool
    #: That request's id (``""`` from workers that do not record it).
    winner: str


def decide(task: str, request_id: str, seq: int, fence: Fence | None) -> RequestOutcome | None:
    """The outcome of request ``request_id`` (a ``task`` stamped ``seq``), or None while it
    may still apply."""
    if fence is None:
        return None
    winner = fence.request_id
    if winner == request_id or (not winner and fence.seq == seq):
        # (A fence without a winner was written by an older worker: at the request's own
        # seq it is taken as this request's.)
        outcome = APPLIED
    elif fence.seq > seq or (fence.seq == seq and _loses_tie(task, fence)):
        outcome = SUPERSEDED
    else:
        return None
    return RequestOutcome(outcome, fence.seq, fence.deleted, winner)


def _loses_tie(task: str, fence: Fence) -> bool:
    # At equal seq another request holds the fence: a save can never apply over it; a
    # delete applies over a save, but not over another delete.
    return bool(fence.request_id) and (task in (SAVE, SAVE_STAGED) or fence.deleted)
