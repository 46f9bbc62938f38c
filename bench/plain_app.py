"""Plain Celery, the honest baseline: our delivery settings and nothing else of ours.

A stock Celery app with the delivery settings checkpointq's worker runs with (JSON only,
``acks_late``, prefetch multiplier 1; the pool and concurrency come from the command line,
prefork -c 2 in the bench) and no-op tasks registered as ``checkpoint.save`` and
``checkpoint.save_staged``: no task base, no consumer, no transport, no observers, logging
or metrics of ours. Draining the same messages with it measures what Celery itself costs
per message on this machine, so the bench's ratios say what checkpointq adds (or saves) on
top of that.

One thing is matched beyond the delivery settings: Celery's two per-task INFO lines
("received", "succeeded") are off, as they are in our worker, so neither side pays for
writing a log line per message.

Benchmark only; ``BENCH_BROKER_URL`` names the broker, ``BENCH_QUEUE`` the queue.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery, signals

app = Celery("plain", broker=os.environ["BENCH_BROKER_URL"], set_as_current=False)
app.conf.update(
    accept_content=["json"],
    task_serializer="json",
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("BENCH_QUEUE", "checkpoints"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)


@signals.after_setup_logger.connect(weak=False)  # type: ignore[untyped-decorator]
def _quiet_per_task_lines(**_: Any) -> None:
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)


@app.task(name="checkpoint.save")  # type: ignore[untyped-decorator]
def save(checkpoint: object, seq: int | None = None) -> dict[str, Any]:
    """Accept a save's arguments and do nothing with them."""
    return {"outcome": "noop"}


@app.task(name="checkpoint.save_staged")  # type: ignore[untyped-decorator]
def save_staged(session_id: object, seq: object, trimmed: object = 0) -> dict[str, Any]:
    """Accept a staged save's arguments and do nothing with them."""
    return {"outcome": "noop"}
