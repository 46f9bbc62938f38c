"""What the worker did with each request, told to whoever listens (metrics, heartbeats).

The tasks and the consumer call ``notify()`` once per request they finish with; the worker
subscribes its metrics (``worker/ops/metrics.py``) at start-up. This keeps ``tasks/`` free of
Prometheus and of ``worker`` imports: with nobody subscribed (unit tests, the CLI),
``notify`` costs a loop over an empty tuple.

An observer must be cheap and must not raise: a failing observer is logged and skipped, it
never fails the request it observes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Task label for a request whose task name is not one of ours (unknown or undecodable):
#: metrics must not grow a label value per name an attacker makes up.
OTHER_TASK = "other"

#: Our task names, without their ``checkpoint.`` prefix: the ``task`` label values. A batch
#: counts once as ``apply_batch``/``batch``, and each of its items under its own task.
TASK_LABELS = frozenset({"save", "delete", "refresh", "expire_stale", "reconcile", "apply_batch"})


def task_label(name: str | None) -> str:
    """``checkpoint.save`` -> ``save``; anything that is not one of our tasks -> ``other``."""
    short = (name or "").removeprefix("checkpoint.")
    if short == "save_staged":  # a save, however its value travelled
        return "save"
    return short if short in TASK_LABELS else OTHER_TASK


@dataclass(frozen=True, slots=True)
class Observation:
    """One request the worker finished with (or will retry)."""

    #: Short task name (``save``, ``delete``, ``refresh``, ``expire_stale``, ``other``).
    task: str
    #: applied, superseded, deleted, refreshed, absent, swept, locked_out, dead_lettered, retried,
    #: batch (a whole ``apply_batch`` request; its items are observed one by one).
    outcome: str
    task_id: str | None = None
    session_id: str | None = None
    #: The ``seq`` the producer stamped (µs since the epoch), None when it sent none.
    seq: int | None = None
    #: Seconds the task body ran (the store call); None when it never ran (consumer refusals).
    seconds: float | None = None
    #: For applied saves: the stored (compressed) value's size in bytes.
    stored_bytes: int | None = None
    #: For saves: messages dropped from the history to fit the cap and byte budget.
    trimmed: int = 0
    #: For sweeps: sessions expired.
    expired: int = 0
    #: For dead letters: the reason kind (``checkpointq.tasks.dead_letters.Reason`` value).
    kind: str | None = None


@dataclass(frozen=True, slots=True)
class Received:
    """A task message as it arrived, before anything decoded it (the consumer's view)."""

    task: str
    #: Size of the message body in bytes: the request's JSON, before any compression.
    body_bytes: int


Observer = Callable[[Observation], None]
ReceiptObserver = Callable[[Received], None]

_lock = threading.Lock()
_observers: tuple[Observer, ...] = ()
_receipt_observers: tuple[ReceiptObserver, ...] = ()


def subscribe(observer: Observer, on_receipt: ReceiptObserver | None = None) -> None:
    """Call ``observer`` for every finished request (and ``on_receipt`` for every message).

    Subscribing the same callables twice has no effect.
    """
    global _observers, _receipt_observers
    with _lock:
        if observer not in _observers:
            _observers = (*_observers, observer)
        if on_receipt is not None and on_receipt not in _receipt_observers:
            _receipt_observers = (*_receipt_observers, on_receipt)


def unsubscribe_all() -> None:
    """Forget every observer (tests)."""
    global _observers, _receipt_observers
    with _lock:
        _observers, _receipt_observers = (), ()


def notify(observation: Observation) -> None:
    """Tell every observer; an observer's failure is logged, never raised."""
    for observer in _observers:
        try:
            observer(observation)
        except Exception:
            logger.exception("observer %r failed on %s", observer, observation.outcome)


def notify_received(received: Received) -> None:
    """Tell every receipt observer about a message that just arrived."""
    for observer in _receipt_observers:
        try:
            observer(received)
        except Exception:
            logger.exception("receipt observer %r failed", observer)
