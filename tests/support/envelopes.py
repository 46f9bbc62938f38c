"""Raw broker messages as a producer without a Celery library writes them (docs/protocol.md)."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any


def protocol2(
    task: str,
    args: list[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    queue: str = "checkpoints",
    body: bytes | None = None,
    content_type: str = "application/json",
    task_id: str | None = None,
) -> str:
    """The minimal protocol 2 envelope for ``LPUSH <queue>`` (fields the worker needs)."""
    task_id = task_id or str(uuid.uuid4())
    if body is None:
        body = json.dumps([args, kwargs or {}, {}]).encode()
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": content_type,
            "headers": {"task": task, "id": task_id},
            "properties": {
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
                "delivery_info": {"exchange": "", "routing_key": queue},
            },
        }
    )


def protocol1(
    task: str | None,
    args: list[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    queue: str = "checkpoints",
) -> str:
    """A protocol 1 envelope: task name, id and arguments in the JSON body, no task header."""
    message: dict[str, Any] = {"id": str(uuid.uuid4()), "args": args, "kwargs": kwargs or {}}
    if task is not None:
        message["task"] = task
    body = json.dumps(message).encode()
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
                "delivery_info": {"exchange": "", "routing_key": queue},
            },
        }
    )
