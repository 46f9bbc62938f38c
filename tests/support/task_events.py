"""Celery's task events as ``celery events`` and Flower receive them, captured in a thread."""

from __future__ import annotations

import threading
from collections import defaultdict
from types import TracebackType
from typing import Any

from celery import Celery

from checkpointq.worker.app import celery_config
from checkpointq.worker.settings import Settings
from tests.support.servers import wait_until


class TaskEvents:
    """Every ``task-*`` event a worker on ``settings``' broker sends while this is open.

    On Redis the receiver subscribes on its first poll: events sent before then are lost to
    it, so a test first waits for the events of a warm-up request (``listening``).
    """

    def __init__(self, settings: Settings) -> None:
        self.app = Celery("task-events", set_as_current=False)
        self.app.config_from_object(celery_config(settings))
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._connection = self.app.connection_for_read()
        self.receiver = self.app.events.Receiver(self._connection, handlers={"*": self._on_event})
        self._thread = threading.Thread(target=self._capture, daemon=True)

    def _on_event(self, event: dict[str, Any]) -> None:
        if str(event.get("type", "")).startswith("task-"):
            with self._lock:
                self._events.append(event)

    def _capture(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> TaskEvents:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.receiver.should_stop = True
        self._thread.join(timeout=10)
        self._connection.release()

    def by_task(self) -> dict[str, list[dict[str, Any]]]:
        """Each task id's events, by the sender's Lamport clock (in order for the events
        of one process: a retry's ``task-sent`` comes from the pool process's)."""
        with self._lock:
            events = sorted(self._events, key=lambda e: (e.get("clock", 0), e["timestamp"]))
        grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for event in events:
            grouped[event["uuid"]].append(event)
        return grouped

    def types(self, task_id: str) -> list[str]:
        return [e["type"].removeprefix("task-") for e in self.by_task().get(task_id, [])]

    def listening(self, send: Any) -> None:
        """Call ``send()`` (which sends a request and returns its task id) until this
        receives that request's events."""
        sent: set[str] = set()

        def heard() -> bool:
            if sent & set(self.by_task()):
                return True
            sent.add(send())
            return False

        wait_until(heard, timeout=30, interval=0.5, message="the event receiver to listen")
