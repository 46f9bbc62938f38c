"""A module for ``checkpointq worker -I``: records every task signal the worker fires.

Each line appended to ``$CQ_SIGNAL_LOG`` is one JSON object: the signal, the pid, the task
id and name, and what ``task.request`` held when the handler ran (its id, the
``traceparent`` header, the delivery info's routing key). One short ``write`` per line on
an ``O_APPEND`` file, so the pool processes' lines never interleave.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import signals

_PATH = os.environ.get("CQ_SIGNAL_LOG", "")


def _write(line: dict[str, Any]) -> None:
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def _record(signal: str, task: Any, task_id: str | None, **extra: Any) -> None:
    if not _PATH:
        return
    request = task.request
    line = {
        "signal": signal,
        "pid": os.getpid(),
        "task": task.name,
        "task_id": task_id,
        "request_id": request.id,
        "traceparent": getattr(request, "traceparent", None),
        "routing_key": (request.delivery_info or {}).get("routing_key"),
        **extra,
    }
    _write(line)


def _prerun(sender: Any, task_id: str, task: Any, **_: Any) -> None:
    _record("prerun", task, task_id)


def _postrun(sender: Any, task_id: str, task: Any, state: str, **_: Any) -> None:
    _record("postrun", task, task_id, state=state)


def _success(sender: Any, result: Any, **_: Any) -> None:
    _record("success", sender, sender.request.id)


def _failure(sender: Any, task_id: str, **_: Any) -> None:
    _record("failure", sender, task_id)


def _retry(sender: Any, request: Any, **_: Any) -> None:
    _record("retry", sender, request.id)


def _received(sender: Any, request: Any, **_: Any) -> None:
    if not _PATH:
        return
    _write({"signal": "received", "pid": os.getpid(), "task": request.name, "task_id": request.id})


signals.task_prerun.connect(_prerun, weak=False)
signals.task_postrun.connect(_postrun, weak=False)
signals.task_success.connect(_success, weak=False)
signals.task_failure.connect(_failure, weak=False)
signals.task_retry.connect(_retry, weak=False)
signals.task_received.connect(_received, weak=False)
