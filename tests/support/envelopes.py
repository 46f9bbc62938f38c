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
    compression: str | None = None,
    eta: str | None = None,
) -> str:
    """The minimal protocol 2 envelope for ``LPUSH <queue>`` (fields the worker needs);
    ``compression`` is the header naming how ``body`` is compressed, if it is; ``eta`` the
    ISO 8601 time before which the worker holds it (Celery's ``eta`` header)."""
    task_id = task_id or str(uuid.uuid4())
    if body is None:
        body = json.dumps([args, kwargs or {}, {}]).encode()
    headers = {"task": task, "id": task_id}
    if compression:
        headers["compression"] = compression
    if eta:
        headers["eta"] = eta
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": content_type,
            "headers": headers,
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


def go_style(task: str, args: list[Any], seq: int, *, queue: str = "checkpoints") -> str:
    """The envelope ``clients/go`` publishes (envelope.go's ``buildEnvelope``): every header
    and property Celery's ``send_task`` writes, ``lang`` "go", and the body's embed part."""
    task_id = str(uuid.uuid4())
    body = json.dumps(
        [args, {"seq": seq}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    ).encode()
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "go",
                "task": task,
                "id": task_id,
                "shadow": None,
                "eta": None,
                "expires": None,
                "group": None,
                "group_index": None,
                "retries": 0,
                "timelimit": [None, None],
                "root_id": task_id,
                "parent_id": None,
                "argsrepr": repr(args)[:100],
                "kwargsrepr": f"{{'seq': {seq}}}",
                "origin": "gen1@go-producer",
                "ignore_result": None,
                "replaced_task_nesting": 0,
                "stamped_headers": None,
                "stamps": {},
            },
            "properties": {
                "correlation_id": task_id,
                "reply_to": str(uuid.uuid4()),
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    )
