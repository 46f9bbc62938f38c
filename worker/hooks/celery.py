"""Every use of Celery's private names, in one place."""

from __future__ import annotations

import logging
import select
from typing import Any

from billiard.pool import TERMINATE, WorkersJoined

# Celery's own TaskFormatter reads the running task the same way; the public
# ``celery.current_task`` is a proxy over this function.
from celery._state import get_current_task
from celery.concurrency import asynpool

logger = logging.getLogger(__name__)


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


# -- the prefork pool's drain at shutdown ------------------------------------------------------

#: Methods of Celery's prefork result handler (``celery.concurrency.asynpool``) the drain
#: wraps or calls, checked when it goes in; and the attributes its ``__init__`` sets that the
#: drain reads, checked on the handler when it runs. Both are the same on every Celery line
#: we support (5.5 to 5.7).
_HANDLER_METHODS = ("on_stop_not_started", "_flush_outqueue")
_HANDLER_ATTRIBUTES = ("join_exited_workers", "on_state_change", "fileno_to_outq", "_state")


def drain_pool_at_shutdown() -> bool:
    """Keep reading the prefork pool's results at shutdown until every pool process exited.

    On a warm shutdown Celery's consumer flushes the pool (``Consumer.on_close``); in
    Celery 5.7 that forgets every job whose process has not yet said it took it, even one
    already written to that process (5.5 forgot only jobs not yet written). The pool's join
    then reads the processes' results only while it still knows of a job, and waits for
    each process to exit. A process that runs a forgotten job writes its result into a pipe
    that nobody reads any more: a result over the pipe's 64 KiB (a failure's traceback)
    blocks it for good, and the worker with it, until it is killed. Draining until the
    processes exit lets them finish; the forgotten job's result is dropped (its message was
    never acknowledged: the broker redelivers it).

    Returns False, having logged why, where Celery's result handler lacks a method the drain
    needs: Celery's own drain then stays, as on stock Celery (idempotent).
    """
    handler = asynpool.ResultHandler
    stock = handler.on_stop_not_started
    if getattr(stock, "_checkpointq_drain", False):
        return True
    missing = [name for name in _HANDLER_METHODS if not callable(getattr(handler, name, None))]
    if missing:
        _announce_stock_drain(f"its prefork result handler has no {', '.join(missing)}")
        return False

    def on_stop_not_started(self: Any) -> None:
        stock(self)
        missing = [name for name in _HANDLER_ATTRIBUTES if not hasattr(self, name)]
        if missing:
            _announce_stock_drain(f"its prefork result handler has no {', '.join(missing)}")
            return
        _drain_until_exited(self)

    on_stop_not_started._checkpointq_drain = True  # type: ignore[attr-defined]
    handler.on_stop_not_started = on_stop_not_started
    return True


def _announce_stock_drain(why: str) -> None:
    logger.warning(
        "the pool's shutdown drain stays Celery's (%s): a warm shutdown may wait for good on "
        "a pool process blocked writing a result nobody reads",
        why,
    )


#: Milliseconds the drain waits for a result before it looks for exited processes again.
_DRAIN_POLL_MS = 100


def _drain_until_exited(handler: Any) -> None:
    """Celery's shutdown drain (``on_stop_not_started``) without its "while any job is
    known" condition: read every process's results until all processes exited."""
    gone: set[int] = set()
    while handler._state != TERMINATE:
        try:
            handler.join_exited_workers(shutdown=True)
        except WorkersJoined:
            return
        fds = [fd for fd in list(handler.fileno_to_outq) if fd not in gone]
        if not fds:
            return  # nothing left to read: the pool's join waits for the processes
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        for fd, events in poller.poll(_DRAIN_POLL_MS):
            if events & select.POLLNVAL:
                gone.add(fd)  # closed as its process was cleaned up
            elif events & select.POLLIN:
                handler._flush_outqueue(
                    fd, gone.add, handler.fileno_to_outq, handler.on_state_change
                )
