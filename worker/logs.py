"""Log lines of the worker and beat: one line per event, as text or JSON, passwords redacted.

``CHECKPOINTQ_LOG_FORMAT=text`` keeps Celery's human format; ``json`` writes one JSON object
per line with ``time``, ``level``, ``logger``, ``message`` and, where they apply, the
structured fields ``event``, ``task``, ``task_id``, ``session_id``, ``seq``, ``outcome``
(inside a task, ``task`` and ``task_id`` are filled in from Celery's current task). A
traceback stays inside its JSON line (``exc``), so one event is always one line.

In both formats every URL in a line is shown with its password replaced (``redact_url``),
a last line of defence behind the code that already logs redacted URLs.

(Named ``logs`` rather than ``logging`` so that it never shadows the standard library.)
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

from celery import signals

from checkpointq.store.urls import redact_urls
from checkpointq.worker.hooks import celery as celery_hooks

#: Attributes callers may attach with ``extra=`` that the JSON format shows as fields.
STRUCTURED_FIELDS = (
    "event",
    "task",
    "task_id",
    "session_id",
    "seq",
    "outcome",
    "kind",
    "entry",
    "expired",
)

LogFormat = Literal["text", "json"]
_format: LogFormat = "text"


class RedactingFormatter(logging.Formatter):
    """Another formatter's line, URLs redacted (keeps Celery's text format and colours)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact_urls(self.inner.format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": record.process,
            "message": redact_urls(record.getMessage()),
        }
        task = celery_hooks.current_task()
        if task is not None and task.request.id is not None:
            line["task"] = task.name
            line["task_id"] = task.request.id
        for name in STRUCTURED_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = redact_urls(self.formatException(record.exc_info))
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter_for(log_format: LogFormat, current: logging.Formatter | None) -> logging.Formatter:
    """The formatter a handler should use (``current`` is the one Celery gave it)."""
    if log_format == "json":
        return JsonFormatter()
    if isinstance(current, RedactingFormatter):
        return current
    return RedactingFormatter(current or logging.Formatter())


def apply(logger: logging.Logger, log_format: LogFormat) -> None:
    """Give every handler of ``logger`` the format (idempotent)."""
    for handler in logger.handlers:
        handler.setFormatter(formatter_for(log_format, handler.formatter))


def install(log_format: LogFormat) -> None:
    """Use ``log_format`` when Celery sets up the worker's or beat's loggers."""
    global _format
    _format = log_format


def _on_setup_logger(logger: logging.Logger, **_: Any) -> None:
    apply(logger, _format)


signals.after_setup_logger.connect(
    _on_setup_logger, weak=False, dispatch_uid="checkpointq.logs.root"
)
signals.after_setup_task_logger.connect(
    _on_setup_logger, weak=False, dispatch_uid="checkpointq.logs.task"
)
