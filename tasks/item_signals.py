"""Celery's task signals for each request a coalesced group applies, in the pool process.

A group is one pool job, not one Celery task per request, so Celery's tracer fires nothing
for its requests. Here each request gets what the tracer gives a task: ``task.request``
pushed with the message's headers (trace context included), ``delivery_info`` and
``retries``, then ``task_prerun``, and once the group's round trip answered,
``task_success`` and ``task_postrun`` with the registered task as sender. OpenTelemetry's
and Sentry's Celery integrations, and any handler, see it as they see any task.

The group's items are applied by one store call, so their prerun signals all come before it
and their postrun signals after it. Each request's signals run in a ``contextvars.Context``
of its own (copied before the first one), so what a handler makes current in prerun (an
OpenTelemetry span) is current again in that request's postrun and never becomes the parent
of the next request's span.

A request that leaves the group for the single-task path (the store refused its item, or
the store could not be reached) gets ``task_postrun`` with state ``RETRY`` here, as a task
that Celery retries does; the single-task path then fires its own signals. A request that
never parsed gets none here. Nothing is built unless a signal has receivers.
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

    def prerun(self) -> None:
        self._send(
            signals.task_prerun,
            task_id=self.task_id,
            task=self.task,
            args=self.args,
            kwargs=self.kwargs,
        )

    def succeeded(self, retval: Any, runtime: float) -> None:
        self._send(signals.task_success, result=retval, runtime=runtime)
        self._postrun(retval, states.SUCCESS)

    def left_group(self) -> None:
        """The request runs again as a single task, which signals on its own."""
        self._postrun(None, states.RETRY)

    def _postrun(self, retval: Any, state: str) -> None:
        self._send(
            signals.task_postrun,
            task_id=self.task_id,
            task=self.task,
            args=self.args,
            kwargs=self.kwargs,
            retval=retval,
            state=state,
        )
