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

from checkpointq.store.base import CheckpointStore
from checkpointq.store.model import display_id

logger = logging.getLogger(__name__)


def reconcile_slice(store: CheckpointStore, budget: int) -> dict[str, object]:
    """Run one slice and log what it changed; return the task's JSON outcome.

    Raises:
        StoreUnavailable: the store Redis could not be reached (the next tick retries).
    """
    report = store.reconcile(budget)
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
