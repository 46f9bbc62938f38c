"""Every use of Celery's private names, in one place."""

from __future__ import annotations

from typing import Any

# Celery's own TaskFormatter reads the running task the same way; the public
# ``celery.current_task`` is a proxy over this function.
from celery._state import get_current_task


def current_task() -> Any:
    """The task this thread is running, or None."""
    return get_current_task()


def cancel_connection_timers(consumer: Any) -> None:
    """Cancel the timer entries a failed broker connection registered, as Celery's own
    consumer loop does on a lost connection from 5.7 on; before 5.7 that loop does not (its
    event loop cancels its own entries) and the consumer has no such method."""
    cancel = getattr(consumer, "_cancel_connection_timer_entries", None)
    if cancel is not None:
        cancel()
