"""What Celery's own Request tells monitors about a task, for each request of a group.

Celery's strategy and ``Request`` (``celery/worker/strategy.py``, ``request.py``) send, per
task, the ``task_received`` signal and, when task events are on (``-E``,
``worker_send_task_events``, ``CHECKPOINTQ_TASK_EVENTS``), the ``task-received``,
``task-started`` and ``task-succeeded`` events that Flower and ``celery events`` show. A
coalesced request never becomes a ``Request``, so the coalescer (``worker/coalesce.py``)
calls these instead, with the same fields: its own uuid and name, the producer's
``argsrepr``/``kwargsrepr`` cut to ``REPR_MAX`` characters (checkpointq's producers write
a brief one: session id, version and size, never the history), and the runtime of its
group's pool job. The events go through the consumer's own dispatcher, which buffers task
events and publishes them together once per event loop turn.

A request is received when it joins a group, and started and succeeded once the group's
answer says its item was applied. A request that leaves its group is not announced again:
it runs as the single task it is (``coalesce.single_task``), whose ``Request`` sends
started, then succeeded, retried, failed or rejected. So each request shows one received,
one started and one outcome, as without coalescing.

With events off and no ``task_received`` receivers, nothing here builds anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery import signals
from celery.worker.request import Request

#: Longest ``args``/``kwargs`` repr an event carries, in characters.
REPR_MAX = 200

#: Task events the consumer's dispatcher buffers before it publishes them at once. It
#: publishes what it holds at the end of each event loop turn anyway; Celery's limit (24)
#: would also publish a full group's 96 events in four broker round trips (each one a JSON
#: dump, a base64 copy and the exchange's binding lookup), where this lets a turn's events
#: go in one.
EVENTS_PER_PUBLISH = 512


def _brief(text: object) -> str:
    text = text if isinstance(text, str) else ""
    return text if len(text) <= REPR_MAX else text[: REPR_MAX - 3] + "..."


class GroupEvents:
    """Signals and events for the requests one consumer's coalescer applies."""

    def __init__(self, consumer: Any, app: Any) -> None:
        self.consumer = consumer
        self.app = app

    def _eventer(self, task: Any) -> Any:
        # Looked up each time: the consumer makes a new dispatcher when it reconnects, and
        # remote control may enable or disable events.
        eventer = self.consumer.event_dispatcher
        if eventer is not None and eventer.enabled and task.send_events:
            if eventer.buffer_limit < EVENTS_PER_PUBLISH:
                eventer.buffer_limit = EVENTS_PER_PUBLISH
            return eventer
        return None

    def received(self, task: Any, message: Any, ack: Any, reject: Any) -> None:
        """As the strategy does for a message it accepted: ``task_received``, then
        ``task-received``."""
        if signals.task_received.receivers:
            request = Request(
                message,
                on_ack=ack,
                on_reject=reject,
                app=self.app,
                hostname=self.consumer.hostname,
                eventer=self.consumer.event_dispatcher,
                task=task,
                connection_errors=self.consumer.connection_errors,
            )
            signals.task_received.send(sender=self.consumer, request=request)
        eventer = self._eventer(task)
        if eventer is None:
            return
        headers = message.headers
        eventer.send(
            "task-received",
            uuid=headers["id"],
            name=task.name,
            args=_brief(headers.get("argsrepr")),
            kwargs=_brief(headers.get("kwargsrepr")),
            root_id=headers.get("root_id"),
            parent_id=headers.get("parent_id"),
            retries=headers.get("retries") or 0,
            eta=None,
            expires=None,
        )

    def applied(self, requests: Iterable[tuple[Any, str]], runtime: float) -> None:
        """As ``Request.on_accepted`` then ``Request.on_success`` for each (task, task id) a
        group applied, sent once the group's answer came: until then a request might still
        leave the group. The result stays in the worker (no result backend)."""
        for task, task_id in requests:
            eventer = self._eventer(task)
            if eventer is None:
                return  # events off: the group's other requests are the same two tasks
            eventer.send("task-started", uuid=task_id)
            eventer.send("task-succeeded", uuid=task_id, result=None, runtime=runtime)
