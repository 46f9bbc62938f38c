"""The reconciliation task: one bounded slice of ``store.reconcile`` per beat tick.

Beat runs ``checkpoint.reconcile`` (``messages.RECONCILE``) every
``CHECKPOINTQ_RECONCILE_INTERVAL_SECONDS``; each run looks at about
``CHECKPOINTQ_RECONCILE_BUDGET`` keys and index entries, from where the last one stopped (the
cursor lives in Redis, so any worker may run the next slice). What it fixes is what other
writers, a Go ``RedisStore`` saving or deleting directly, left behind: see
``checkpointq.store.reconcile``. Running two slices at once is harmless (each fix is one
idempotent script call), so no lock is taken.
"""

from __future__ import annotations

import logging
from typing import Any

from checkpointq.store.base import CheckpointStore
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import display_id
from checkpointq.tasks.events import DROPPED, KEY_GONE, announce

logger = logging.getLogger(__name__)


def reconcile_slice(
    store: CheckpointStore, budget: int, client: Any, keys: KeySpace, events_maxlen: int
) -> dict[str, object]:
    """Run one slice, log what it changed, and announce each session it dropped (its value
    deleted by another writer) as a ``dropped`` event with reason ``key gone`` on the events
    stream (``checkpointq.tasks.events``, through ``client`` on the store Redis, trimmed to
    about ``events_maxlen``); return the task's JSON outcome.

    Raises:
        StoreUnavailable: the store Redis could not be reached (the next tick retries; a
            slice whose drops could not be announced is not run again, so those few go
            unannounced).
    """
    report = store.reconcile(budget)
    announce(client, keys, DROPPED, report.dropped, events_maxlen, reason=KEY_GONE)
    for kind, ids in (
        ("adopted", report.adopted),
        ("moved", report.moved),
        ("dropped", report.dropped),
    ):
        if ids:
            # Ids other writers chose may hold anything: shown escaped, never raw.
            logger.info(
                "reconcile %s %d session(s): %s",
                kind,
                len(ids),
                " ".join(display_id(sid) for sid in ids[:50]),
            )
    if report.completed_pass:
        logger.debug("reconciliation pass completed")
    return {"outcome": "reconciled", **report.as_json()}
