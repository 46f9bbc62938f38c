"""Remote control, read-only unless enabled: ``celery inspect`` works, nothing else does.

Celery's remote control answers whoever can publish to the broker's pidbox exchange, and
most of its commands change the worker: ``shutdown``, ``pool_restart``, ``pool_grow``,
``autoscale``, ``rate_limit``, ``time_limit``, ``revoke``, ``add_consumer`` and
``enable_events`` among them. A producer's credentials are the broker's, so with the full
panel any API server (or whoever took one over) could stop or reconfigure the fleet. The
inspection commands only read what a worker holds, which is what ``celery inspect``,
``celery status`` and Flower's worker pages need. So by default the worker answers those
(``READ_ONLY``) and refuses the rest with an error reply; ``CHECKPOINTQ_REMOTE_CONTROL=true``
gives back Celery's whole panel. ``conf``, ``report``, ``objgraph``, ``memdump`` and
``memsample`` stay refused too: they print the configuration, or cost the worker memory and
time on request.

The worker's mailbox (``celery.worker.pidbox.Pidbox``) dispatches through the handlers
dict it was given, Celery's ``control.Panel.data``; a consumer bootstep after Celery's
``Control`` gives it this filtered copy instead.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.worker import control

#: The inspection commands a worker answers by default.
READ_ONLY = frozenset(
    {
        "ping",
        "stats",
        "active",
        "dump_active",
        "registered",
        "dump_tasks",
        "reserved",
        "dump_reserved",
        "scheduled",
        "dump_schedule",
        "revoked",
        "dump_revoked",
        "active_queues",
        "query_task",
        "clock",
        "hello",
    }
)

REFUSAL = (
    "checkpointq: this worker answers only read-only inspect commands; remote control "
    "(shutdown, pool and rate changes, revoke, events) is off unless "
    "CHECKPOINTQ_REMOTE_CONTROL=true"
)


def _refuse(state: Any, **_: Any) -> dict[str, str]:
    return {"error": REFUSAL}


def read_only_panel(panel: dict[str, Any]) -> dict[str, Any]:
    """``panel`` with every command outside ``READ_ONLY`` answering an error instead."""
    return {name: panel[name] if name in READ_ONLY else _refuse for name in panel}


class ReadOnlyControl(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: no hints
    """Swaps the worker mailbox's handlers for the read-only panel before it listens."""

    requires = ("celery.worker.consumer.control:Control",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)

    def include_if(self, consumer: Any) -> bool:
        return bool(consumer.app.conf.worker_enable_remote_control)

    def start(self, consumer: Any) -> None:
        step = consumer.blueprint.steps.get("celery.worker.consumer.control.Control")
        box = getattr(step, "box", None)
        if box is None:  # no mailbox (a transport without fanout): nothing answers anyway
            return
        box.node.handlers = read_only_panel(control.Panel.data)


def install(app: Any, *, full: bool) -> None:
    """Answer inspection over the broker; change anything only with ``full`` control."""
    if not full:
        app.steps["consumer"].add(ReadOnlyControl)
