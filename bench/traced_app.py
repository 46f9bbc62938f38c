"""Our production worker with its coalescer traced: where a grouped message spends its time.

For each group the main process sends to the pool, one JSON line goes to the file named by
``BENCH_TRACE_FILE``: the wall-clock time (s) each of its messages reached the coalescer
(with its task id, so a bench can join it with when the producer sent it), when the group
was handed to the pool, when the pool's answer came back, when its acks were begun and
written, and how many groups were in the pool when it was sent. Benchmark only
(``bench/latency_bench.py``); production workers never load it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from checkpointq.worker import coalesce
from checkpointq.worker.app import create_app

app = create_app()

_trace = open(os.environ["BENCH_TRACE_FILE"], "a", buffering=1)  # noqa: SIM115 - the worker's life
_arrived: dict[int, float] = {}
_groups: dict[int, dict[str, Any]] = {}
#: The group being settled (the event loop runs one callback at a time).
_settling: dict[str, Any] | None = None

_add = coalesce.Coalescer.add
_dispatch = coalesce.Coalescer._dispatch
_settle = coalesce.Coalescer._settle
_ack_together = coalesce.Coalescer._ack_together


def _traced_add(self: coalesce.Coalescer, pending: coalesce._Pending) -> None:
    _arrived[id(pending)] = time.time()
    _add(self, pending)


def _traced_dispatch(self: coalesce.Coalescer, group: list[coalesce._Pending]) -> None:
    _groups[id(group)] = {
        "sent": time.time(),
        "in_pool": self._in_flight,
        "items": [[p.task_id, _arrived.pop(id(p), 0.0)] for p in group],
    }
    _dispatch(self, group)


def _traced_settle(
    self: coalesce.Coalescer, group: list[coalesce._Pending], done: Any, flushes: int
) -> None:
    global _settling
    _settling = record = _groups.pop(id(group), None)
    if record is not None:
        record["done"] = time.time()
    try:
        _settle(self, group, done, flushes)
    finally:
        _settling = None
    if record is not None:
        _trace.write(json.dumps(record) + "\n")


def _traced_ack_together(
    self: coalesce.Coalescer, applied: list[coalesce._Pending], settled: Any
) -> None:
    started = time.time()
    _ack_together(self, applied, settled)
    if _settling is not None:
        _settling["ack"] = [started, time.time()]


coalesce.Coalescer.add = _traced_add  # type: ignore[method-assign]
coalesce.Coalescer._dispatch = _traced_dispatch  # type: ignore[method-assign]
coalesce.Coalescer._settle = _traced_settle  # type: ignore[method-assign]
coalesce.Coalescer._ack_together = _traced_ack_together  # type: ignore[method-assign]
