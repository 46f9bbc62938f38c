"""Beat: the sweep of expired sessions every ``sweep_interval_seconds``, and a slice of
reconciliation (store/reconcile.py) every ``reconcile_interval_seconds``.

The schedule lives in Redis (celery-redbeat) rather than in a local state file, and RedBeat
holds a lock so that a second beat started by mistake waits instead of firing too. Should
both fire anyway (a lock lost in a network partition), nothing is double-applied: the sweep
takes its own short lock, and the store expires each session once.
"""

from __future__ import annotations

from typing import Any

from checkpointq.store.keys import KeySpace
from checkpointq.store.urls import redis_py_url
from checkpointq.tasks.messages import EXPIRE_STALE, RECONCILE
from checkpointq.worker.settings import Settings

#: Name of the sweep's schedule entry.
SWEEP_ENTRY = "checkpointq-expire-stale"
#: Name of the reconciliation's schedule entry.
RECONCILE_ENTRY = "checkpointq-reconcile"


def beat_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for beat (harmless to a worker, which ignores them)."""
    interval = settings.sweep_interval_seconds
    # Beat wakes up at least this often; RedBeat extends its lock on each wake-up, so the
    # lock's lifetime is a few of these: a crashed beat is replaced within seconds.
    # Reconciliation adopts values other writers (the Go store) left in a Redis store; a
    # PostgreSQL store has no other writer and nothing to reconcile: no entry.
    reconciles = not settings.store_is_postgres
    tick = min(interval, settings.reconcile_interval_seconds if reconciles else interval, 5.0)
    schedule: dict[str, Any] = {
        SWEEP_ENTRY: {
            "task": EXPIRE_STALE,
            "schedule": interval,
            "options": {
                "queue": settings.queue,
                # A sweep still queued when the next is due is redundant: let it lapse.
                "expires": interval,
            },
        },
    }
    if reconciles:
        schedule[RECONCILE_ENTRY] = {
            "task": RECONCILE,
            "schedule": settings.reconcile_interval_seconds,
            "options": {
                "queue": settings.queue,
                # The cursor is in Redis: a lapsed slice is simply done by the next one.
                "expires": settings.reconcile_interval_seconds,
            },
        }
    return {
        "beat_schedule": schedule,
        "beat_scheduler": "redbeat.RedBeatScheduler",
        # Schedule and lock on a plain Redis: the store's, else (a cluster store, which
        # RedBeat's pipelines cannot span) the broker's, else CHECKPOINTQ_BEAT_URL
        # (Settings.resolved_beat_url), as redis-py (which RedBeat uses) spells it.
        "redbeat_redis_url": redis_py_url(settings.resolved_beat_url or ""),
        "redbeat_redis_options": {},
        "redbeat_key_prefix": KeySpace(settings.key_prefix).beat_prefix(),
        "redbeat_lock_timeout": int(tick * 6),
        "beat_max_loop_interval": tick,
    }
