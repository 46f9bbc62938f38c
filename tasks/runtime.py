"""What the tasks run against, installed by whoever hosts them (the worker, or a test).

Tasks must not import ``worker``; instead the worker calls ``configure(factory)`` when it
builds its Celery app, and ``reset()`` in every process after a fork, so that each process
builds its own Redis connection pool on first use (pools must never cross a fork).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from checkpointq.store.base import CheckpointStore
from checkpointq.store.keys import KeySpace
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.policy import RetryPolicy
from checkpointq.tasks.producer.pending import Settler


@dataclass(frozen=True, slots=True)
class Runtime:
    """The store, its Redis client, the dead letters and the policy the tasks apply."""

    store: CheckpointStore
    #: A ``redis.Redis`` on the store Redis: sweep lock, events stream, dead letters.
    redis: Any
    keys: KeySpace
    dead_letters: DeadLetters
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: Largest accepted request (JSON arguments), bytes.
    max_message_bytes: int = 8 * 1024 * 1024
    #: Staged values one coalesced group reads at most, bytes (0: no bound but the message
    #: limit): what the prefetch byte budget bounds for messages carrying their checkpoint.
    group_value_bytes: int = 4 * 1024 * 1024
    #: How far (s) a message's ``eta`` may be ahead: the broker's visibility timeout.
    max_eta_ahead_seconds: float = 300.0
    #: How far (µs) a request's ``seq`` may be ahead of this worker's clock (tasks/seq.py).
    max_seq_ahead_us: int = 300_000_000
    #: Most sessions one sweep expires.
    sweep_limit: int = 10_000
    #: Keys and index entries one reconciliation slice looks at.
    reconcile_budget: int = 50_000
    #: Entries kept in the events stream.
    events_maxlen: int = 100_000
    #: Settles the pending records on a Redis broker (None: no records on this broker).
    pending: Settler | None = None
    #: The queue the workers consume (where a pending request's message waits).
    queue: str = "checkpoints"
    #: How old a pending entry must be before the sweep looks for its message (orphans).
    orphan_grace_seconds: float = 600.0

    def close(self) -> None:
        self.store.close()
        if self.pending is not None:
            self.pending.close()


_lock = threading.Lock()
_factory: Callable[[], Runtime] | None = None
_current: Runtime | None = None


def configure(factory: Callable[[], Runtime]) -> None:
    """Say how to build the runtime; nothing connects until a task first needs it."""
    global _factory, _current
    with _lock:
        _factory, _current = factory, None


def install(runtime: Runtime) -> None:
    """Use this runtime from now on (tests with an in-memory store, embedded workers)."""
    global _current
    with _lock:
        _current = runtime


def reset() -> None:
    """Forget the current runtime without closing it (after a fork its sockets are the
    parent's); the next ``current()`` builds a fresh one from the factory."""
    global _current
    with _lock:
        _current = None


def current() -> Runtime:
    """The runtime, built on first use in this process.

    Raises:
        RuntimeError: nothing was configured or installed (a host forgot to set it up).
    """
    global _current
    with _lock:
        if _current is None:
            if _factory is None:
                raise RuntimeError(
                    "checkpointq.tasks.runtime is not configured: create the worker app with "
                    "checkpointq.worker.app.create_app() or call tasks.runtime.install()"
                )
            _current = _factory()
        return _current
