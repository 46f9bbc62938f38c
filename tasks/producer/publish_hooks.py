"""Celery's publish signals around the fast path's push, so tracing reaches the worker.

Celery's own publish (``app.amqp.send_task_message``) sends ``before_task_publish`` with the
message's headers and properties, which a receiver may extend (OpenTelemetry's Celery
instrumentation injects ``traceparent``, Sentry's ``sentry-trace`` and ``baggage``), then
``after_task_publish`` once the broker took the message. The fast path
(``fast_publish.RedisPublisher``) writes the envelope itself, so it sends both here, with
the same arguments, and pushes the headers as the receivers left them; the worker's
``task.request`` then carries them (``task.request.traceparent``), as with Celery's publish.

Celery is not needed to produce: receivers exist only in a process that imported
``celery.signals``, so if that module was never imported nothing is looked up, and with no
receivers connected the envelope is pushed exactly as rendered.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson


class PublishHooks:
    """The two signals, when at least one of them has a receiver."""

    def __init__(self, before: Any, after: Any) -> None:
        self._before = before
        self._after = after

    def before(self, task: str, body_json: bytes, envelope: bytes, queue: str) -> bytes:
        """Run ``before_task_publish`` on ``envelope``'s headers; the envelope to push."""
        if not self._before.receivers:
            return envelope
        message = orjson.loads(envelope)
        headers, properties = message["headers"], message["properties"]
        self._before.send(
            sender=task,
            body=tuple(orjson.loads(body_json)),
            exchange="",
            routing_key=queue,
            declare=[],
            headers=headers,
            properties=properties,
            retry_policy=None,
        )
        return orjson.dumps(message)

    def after(self, task: str, body_json: bytes, envelope: bytes, queue: str) -> None:
        """Run ``after_task_publish`` for the envelope the broker took."""
        if not self._after.receivers:
            return
        headers = orjson.loads(envelope)["headers"]
        self._after.send(
            sender=task,
            body=tuple(orjson.loads(body_json)),
            headers=headers,
            exchange="",
            routing_key=queue,
        )


def connected() -> PublishHooks | None:
    """The publish signals if this process connected a receiver to one, else None."""
    signals = sys.modules.get("celery.signals")
    if signals is None:
        return None
    before, after = signals.before_task_publish, signals.after_task_publish
    if not before.receivers and not after.receivers:
        return None
    return PublishHooks(before, after)
