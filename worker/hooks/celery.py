"""Every use of Celery's private names, in one place."""

from __future__ import annotations

from typing import Any

# Celery's own TaskFormatter reads the running task the same way; the public
# ``celery.current_task`` is a proxy over this function.
from celery._state import get_current_task


def current_task() -> Any:
    """The task this thread is running, or None."""
    return get_current_task()
