"""A module for ``checkpointq worker -I``: Sentry's SDK as a user sets it up, plus a bug.

``sentry_sdk.init`` with its default integrations (Celery's and logging's are enabled by
default) and a transport that appends each event, as JSON, to ``$CQ_SENTRY_LOG`` instead of
sending it. The bug stands in for any unexpected failure: the Redis store raises
``RuntimeError`` for a session whose id starts with ``sentry-bug``, in a group's round trip
as in a single save.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import sentry_sdk
from sentry_sdk.envelope import Envelope
from sentry_sdk.transport import Transport

from checkpointq.store.base import BatchOp
from checkpointq.store.redis import RedisStore

_PATH = os.environ.get("CQ_SENTRY_LOG", "")
BUG = "sentry-bug"


class FileTransport(Transport):
    """Each event of an envelope as one JSON line (one ``write`` on an O_APPEND file)."""

    def capture_envelope(self, envelope: Envelope) -> None:
        for item in envelope.items:
            if item.type != "event" or item.payload.json is None:
                continue
            line = json.dumps(item.payload.json, default=str) + "\n"
            fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)


class InjectedBug(RuntimeError):
    """The failure this module injects."""


_save, _apply_batch = RedisStore.save, RedisStore.apply_batch


def _save_with_bug(self: RedisStore, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
    if checkpoint.session_id.startswith(BUG):
        raise InjectedBug(f"a bug while saving {checkpoint.session_id}")
    return _save(self, checkpoint, *args, **kwargs)


def _apply_batch_with_bug(self: RedisStore, ops: Sequence[BatchOp]) -> Any:
    for op in ops:
        checkpoint = getattr(op, "checkpoint", None)
        if checkpoint is not None and checkpoint.session_id.startswith(BUG):
            raise InjectedBug(f"a bug while saving {checkpoint.session_id} in a batch")
    return _apply_batch(self, ops)


if _PATH:
    sentry_sdk.init(dsn="https://public@sentry.invalid/1", transport=FileTransport)
    RedisStore.save = _save_with_bug  # type: ignore[method-assign]
    RedisStore.apply_batch = _apply_batch_with_bug  # type: ignore[method-assign]
