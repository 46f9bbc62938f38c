"""Celery's task signals for each request a coalesced group applies, in the pool process.

A group is one pool job, not one Celery task per request, so Celery's tracer fires nothing
for its requests. Here each request gets what the tracer gives a task: ``task.request``
pushed with the message's headers (trace context included), ``delivery_info`` and
``retries``, and ``task_prerun``, ``task_success`` and ``task_postrun`` with the registered
task as sender, so OpenTelemetry's Celery instrumentation and any handler see it as they
see any task. (Sentry's Celery integration wraps Celery's tracer instead: it sees the
requests that leave the group, which is where failures go.)

A request's signals come once its group's round trip answered, and only if its item was
applied there: prerun, success, postrun, each in a ``contextvars.Context`` of its own, so
what a handler makes current in prerun (an OpenTelemetry span) is current again in that
request's postrun and never becomes the parent of the next request's span. A request that
leaves the group for the single-task path (the store refused its item, or could not be
reached) gets nothing here: that task's tracer signals it, once, as without coalescing. So
a handler counts each request's prerun, success or failure, and postrun exactly once. The
price: a span a prerun handler opens covers the signals, not the group's shared round trip
(the ``task-succeeded`` event's runtime does). Nothing is built unless a signal has
receivers.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from celery import current_app, signals, states

_SIGNALS = (signals.task_prerun, signals.task_postrun, signals.task_success)


def wanted() -> bool:
    """Whether any handler listens: else a group pays nothing for the signals."""
    return any(signal.receivers for signal in _SIGNALS)


@dataclass(slots=True)
class ItemSignals:
    """One request's signals, as Celery's tracer sends them for a task."""

    task: Any
    task_id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    request: dict[str, Any]
    context: contextvars.Context = field(default_factory=contextvars.copy_context)

    @classmethod
    def for_request(
        cls,
        name: str,
        task_id: str,
        args: list[Any],
        kwargs: dict[str, Any],
        headers: dict[str, Any],
        delivery_info: dict[str, Any],
    ) -> ItemSignals:
        """The signals of request ``task_id`` of task ``name`` (its message's parts)."""
        # What Celery's Request hands its tracer: the protocol 2 headers as the request's
        # fields (``traceparent`` becomes ``task.request.traceparent``), and the message's.
        request = {
            **headers,
            "headers": headers,
            "delivery_info": delivery_info,
            "args": args,
            "kwargs": kwargs,
            "called_directly": False,
            "is_eager": False,
        }
        return cls(current_app.tasks[name], task_id, tuple(args), kwargs, request)

    def _send(self, signal: Any, **fields: Any) -> None:
        if not signal.receivers:
            return
        self.task.push_request(**self.request)
        try:
            self.context.run(signal.send, sender=self.task, **fields)
        finally:
            self.task.pop_request()

    def applied(self, retval: Any) -> None:
        """The request's item was applied: its prerun, success and postrun, in order."""
        self._send(
            signals.task_prerun,
            task_id=self.task_id,
            task=self.task,
            args=self.args,
            kwargs=self.kwargs,
        )
        self._send(signals.task_success, result=retval)
        self._send(
            signals.task_postrun,
            task_id=self.task_id,
            task=self.task,
            args=self.args,
            kwargs=self.kwargs,
            retval=retval,
            state=states.SUCCESS,
        )
