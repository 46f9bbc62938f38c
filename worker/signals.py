"""Worker process hooks: fresh store connections after each fork, quiet per-request logs."""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from checkpointq.tasks import runtime

# Celery logs a line per received and per finished task at INFO; at INFO our worker logs
# per-minute summaries instead (tasks.checkpoints.OutcomeLog), and per-request lines at DEBUG.
_PER_REQUEST_LOGGERS = ("celery.app.trace", "celery.worker.strategy")


def _on_process_init(**_: Any) -> None:
    # A forked child inherits the parent's Redis connection pool, sockets and all; two
    # processes sharing a socket interleave replies. Drop it and build our own now, so the
    # first task does not pay for it, nor for loading zstd (the main process never does).
    runtime.reset()
    runtime.current().store.codec.warm_up()


def _on_setup_logger(loglevel: int, **_: Any) -> None:
    if loglevel > logging.DEBUG:
        for name in _PER_REQUEST_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


signals.worker_process_init.connect(
    _on_process_init, weak=False, dispatch_uid="checkpointq.process_init"
)
signals.after_setup_logger.connect(_on_setup_logger, weak=False, dispatch_uid="checkpointq.logging")
