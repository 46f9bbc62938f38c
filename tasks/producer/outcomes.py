"""How a request ended, read from the store: what ``wait_durable`` answers.

The fence keeps the winning request's id, and a worker that dead-letters a request records
the refusal under the request's id, so a producer can tell its own request's fate:

* **applied**: the fence names the request by its whole stamp, id, ``seq`` and kind (it is
  what the store holds, or its delete is): an id alone may be reused by a faulty producer;
* **superseded**: the fence holds a request ordered after it (``store.ordering``), so it can
  no longer apply (it was applied and overwritten, or refused as stale);
* **expired**: it reached a worker past its deadline, or is past it now: never stored;
* **lost**: its message was gone while its pending record stayed (a purge): settled as
  lost and dead-lettered, never applied;
* **refused**: dead-lettered (``RequestRefused``, with the kind, reason and entry);
* otherwise it is still on its way.

A save whose history the store trims (oldest messages first) says so in its handle and its
outcome (``Trimmed``): the producer encodes the value as the store does, with the same
options, so it knows how many messages go, and why, before it sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointq.store.base import Fence
from checkpointq.store.ordering import order_key
from checkpointq.tasks.messages import DELETE

APPLIED = "applied"
SUPERSEDED = "superseded"
EXPIRED = "expired"
#: Its message was gone while its pending record stayed (a purge): settled as lost, never
#: applied (tasks/orphans.py; a dead letter of kind ``lost`` says more).
LOST = "lost"


#: Why a saved history was trimmed: the message-count cap, or the stored-size budget.
HISTORY_CAP = "history_cap"
MAX_VALUE_BYTES = "max_value_bytes"


@dataclass(frozen=True, slots=True)
class Trimmed:
    """How many of a save's messages the store keeps (the newest), and why it drops the rest:
    ``history_cap`` (CHECKPOINTQ_HISTORY_CAP) or ``max_value_bytes`` (the stored-size budget,
    CHECKPOINTQ_MAX_VALUE_BYTES, which took messages the cap would have kept)."""

    sent: int
    kept: int
    cause: str

    @classmethod
    def of(cls, sent: int, trimmed: int, history_cap: int) -> Trimmed | None:
        """The trim of a ``sent``-message history that lost ``trimmed``; None if none.

        The store applies the cap first, then the budget (``CheckpointStore.encode``): more
        dropped than the cap accounts for means the budget took some.
        """
        if trimmed <= 0:
            return None
        cause = MAX_VALUE_BYTES if trimmed > max(0, sent - history_cap) else HISTORY_CAP
        return cls(sent, sent - trimmed, cause)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """A request's known outcome and the fence it was read from."""

    #: ``"applied"``, ``"superseded"`` or ``"expired"`` (it reached a worker past its
    #: deadline, or can no longer: never stored, as it would have expired by now).
    outcome: str
    #: The ``seq`` of the session's last applied request.
    seq: int
    #: Whether that request was a delete.
    deleted: bool
    #: That request's id (``""`` from workers that do not record it).
    winner: str
    #: An applied save whose history the store trimmed: how, and why (None: kept whole).
    trimmed: Trimmed | None = None


def decide(
    task: str,
    request_id: str,
    seq: int,
    fence: Fence | None,
    lapsed: bool = False,
) -> RequestOutcome | None:
    """The outcome of request ``request_id`` (a ``task`` stamped ``seq``), or None while it
    may still apply. ``lapsed``: the request is past its deadline (``store.ordering``), so a
    save can no longer apply whatever the fence says (a delete applies at any age)."""
    deleting = task == DELETE
    lapsed = lapsed and not deleting
    if fence is None:
        return RequestOutcome(EXPIRED, 0, False, "") if lapsed else None
    winner = fence.request_id
    if (winner == request_id or not winner) and fence.seq == seq and fence.deleted == deleting:
        # The fence is this request's only when its whole stamp is: a request id alone may be
        # another request's (a faulty producer reusing it, issue 44). (A fence without a
        # winner was written by an older worker: at the request's own stamp it is taken as
        # this request's.)
        outcome = EXPIRED if fence.lapsed else APPLIED
    elif fence.key > order_key(seq, deleting, request_id):
        outcome = SUPERSEDED
    elif lapsed:
        outcome = EXPIRED
    else:
        return None
    return RequestOutcome(outcome, fence.seq, fence.deleted, winner)
