"""Producer section: what one enqueue costs an API server, per request (p50/p99).

Three ways to get a 20 KB checkpoint on its way, each timed call by call against the same
private Redis (broker and store alike), interleaved repetitions:

* ``CheckpointClient.save``: our producer client (validate, stamp ``seq``, publish);
* Celery's ``apply_async`` of the same payload on a stock app (default settings, a task
  registered under the same name), what a team would write without our client;
* ``RedisStore.save``: writing the checkpoint synchronously, no queue at all.

Nothing consumes the queue: it is emptied between repetitions. Each ``CheckpointClient.save``
is a staged save (its value SET on the broker under the request's id, then one publish.lua
call that pushes a message naming it and writes the session's pending record, issue 22), in
one round trip.

Loads: ``CheckpointClient.load_with_fence`` (which merges the pending record: one script
call, broker and store being one Redis) against ``RedisStore.load_with_fence``, for a
session whose newest write is still pending (the record answers) and for one the worker
settled (the store answers). And the broker memory a pending 20 KB session holds (``MEMORY
USAGE`` of its record, plus its index entry).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from bench.harness import (
    RunConfig,
    SectionReport,
    Summary,
    Target,
    percentile,
    summarize,
    time_calls,
)
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.messages import SAVE
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.servers import RedisServer

SIZE = 20_000
QUEUE = "checkpoints"
WAYS = ("CheckpointClient.save", "Celery apply_async", "RedisStore.save (direct)")
LOADS = (
    "CheckpointClient.load_with_fence (record answers)",
    "CheckpointClient.load_with_fence (store answers)",
    "RedisStore.load_with_fence (direct)",
)
#: Issue 22: a merged load p50 at most this much a direct load's.
LOAD_VS_DIRECT_TARGET = 1.2
#: Targets of the performance issue.
VS_DIRECT_TARGET = 1.0
VS_APPLY_ASYNC_TARGET = 3.0


def run(config: RunConfig) -> SectionReport:
    calls = 50 if config.quick else 2_000
    server = RedisServer().start()
    try:
        p50s, p99s, everything = _measure(server, calls, config)
        loads = _measure_loads(server, calls, config)
        memory = _pending_memory(server)
    finally:
        server.cleanup()
    report = SectionReport("producer", "Producer: enqueue cost per request")
    _write(report, p50s, p99s, everything, calls, config)
    _write_loads(report, loads, memory, config)
    return report


def _measure_loads(server: RedisServer, calls: int, config: RunConfig) -> dict[str, Summary]:
    """p50 per repetition of each way to load, interleaved."""
    raw = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
    raw.flushall()
    store = RedisStore(raw, prefix="bench")
    client = CheckpointClient(server.url, RedisStore(raw, prefix="bench"), queue=QUEUE)
    try:
        for i in range(32):
            store.save(make_checkpoint(f"settled{i}", SIZE), seq=1)
            client.save(make_checkpoint(f"pending{i}", SIZE))
        raw.delete(QUEUE)
        ways: dict[str, Callable[[int], object]] = {
            LOADS[0]: lambda i: client.load_with_fence(f"pending{i % 32}"),
            LOADS[1]: lambda i: client.load_with_fence(f"settled{i % 32}"),
            LOADS[2]: lambda i: store.load_with_fence(f"settled{i % 32}"),
        }
        for way in ways.values():
            for i in range(20):
                way(i)
        p50: dict[str, list[float]] = {w: [] for w in LOADS}
        for rep in range(config.repeats):
            for name in LOADS[rep % 3 :] + LOADS[: rep % 3]:
                p50[name].append(percentile(time_calls(ways[name], calls), 50))
    finally:
        client.close()
        raw.close()
    return {w: summarize(v) for w, v in p50.items()}


@dataclass(frozen=True, slots=True)
class PendingMemory:
    """Broker bytes (``MEMORY USAGE``, medians over 1,000 pending 20 KB saves): what a pending
    session holds (its record, its index entry), and what each queued save holds until a
    worker settles it (its message, its staged value)."""

    record: int
    index: int
    message: int
    value: int


def _pending_memory(server: RedisServer) -> PendingMemory:
    raw = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
    raw.flushall()
    client = CheckpointClient(server.url, RedisStore(raw, prefix="bench"), queue=QUEUE)
    try:
        handles = [client.save(make_checkpoint(f"mem{i}", SIZE)) for i in range(1000)]
        keys = client.pending_records.keys if client.pending_records else None
        assert keys is not None, "a Redis broker has pending records"
        records = [
            int(raw.memory_usage(keys.pending_requests(f"mem{i}")) or 0) for i in range(1000)
        ]
        index = int(raw.memory_usage(keys.pending_index()) or 0)
        values = [
            int(raw.memory_usage(keys.pending_value(h.session_id, h.task_id)) or 0) for h in handles
        ]
        queue = int(raw.memory_usage(QUEUE, samples=0) or 0)
        raw.delete(QUEUE)
    finally:
        client.close()
        raw.close()
    return PendingMemory(
        round(statistics.median(records)),
        round(index / 1000),
        round(queue / 1000),
        round(statistics.median(values)),
    )


def _stock_celery(url: str) -> tuple[Celery, Any]:
    app = Celery("bench-stock", broker=url, set_as_current=False)
    app.conf.task_default_queue = QUEUE

    @app.task(name=SAVE)  # type: ignore[untyped-decorator]
    def save(checkpoint: dict[str, Any], seq: int | None = None) -> None:
        """Never runs here: only its ``apply_async`` is measured."""

    return app, save


def _measure(
    server: RedisServer, calls: int, config: RunConfig
) -> tuple[dict[str, Summary], dict[str, Summary], dict[str, list[float]]]:
    raw = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
    store = RedisStore(raw, prefix="bench")
    client = CheckpointClient(server.url, RedisStore(raw, prefix="bench"), queue=QUEUE)
    app, stock_task = _stock_celery(server.url)
    checkpoints = [make_checkpoint(f"s{i}", SIZE) for i in range(32)]
    wires = [checkpoint_to_wire(cp) for cp in checkpoints]
    seq = iter(range(time.time_ns() // 1000, 2**53))
    ways: dict[str, Callable[[int], object]] = {
        WAYS[0]: lambda i: client.save(checkpoints[i % 32]),
        WAYS[1]: lambda i: stock_task.apply_async(
            args=[wires[i % 32]], kwargs={"seq": next(seq)}, queue=QUEUE
        ),
        WAYS[2]: lambda i: store.save(checkpoints[i % 32]),
    }
    try:
        for way in ways.values():  # warm up: connections, scripts, Celery's lazy setup
            for i in range(20):
                way(i)
        per_rep_p50: dict[str, list[float]] = {w: [] for w in WAYS}
        per_rep_p99: dict[str, list[float]] = {w: [] for w in WAYS}
        everything: dict[str, list[float]] = {w: [] for w in WAYS}
        for rep in range(config.repeats):
            for name in WAYS[rep % 3 :] + WAYS[: rep % 3]:
                raw.delete(QUEUE)
                micros = time_calls(ways[name], calls)
                per_rep_p50[name].append(percentile(micros, 50))
                per_rep_p99[name].append(percentile(micros, 99))
                everything[name] += micros
        raw.delete(QUEUE)
    finally:
        client.close()
        app.close()
        raw.close()
    return (
        {w: summarize(v) for w, v in per_rep_p50.items()},
        {w: summarize(v) for w, v in per_rep_p99.items()},
        everything,
    )


def _write_loads(
    report: SectionReport,
    loads: dict[str, Summary],
    memory: PendingMemory,
    config: RunConfig,
) -> None:
    direct = loads[LOADS[2]].median
    worst = max(loads[LOADS[0]].median, loads[LOADS[1]].median)
    report.lines += [
        "",
        "Loads of the same 20 KB checkpoint (p50 per repetition, median (min-max)):",
        "",
        "| way | p50 us | p50 / direct load |",
        "|---|---:|---:|",
    ]
    for way in LOADS:
        report.lines.append(
            f"| {way} | {loads[way].fmt(',.0f')} | {loads[way].median / direct:.2f}x |"
        )
    report.lines += [
        "",
        f"A pending 20 KB session holds **{memory.record + memory.index:,} bytes** of broker "
        f"memory ({memory.record:,} its record, which names its staged value; "
        f"{memory.index} its index entry), and each queued save "
        f"**{memory.message + memory.value:,} bytes** ({memory.message:,} its message, "
        f"{memory.value:,} its staged value, the checkpoint's JSON), until a worker settles "
        "its request: the broker holds what the lag's backlog holds, not what time has seen.",
    ]
    report.targets.append(
        Target(
            "client load p50 vs direct RedisStore load (issue 22)",
            f"<= {LOAD_VS_DIRECT_TARGET:.1f}x",
            f"{worst / direct:.2f}x",
            None if config.quick else worst / direct <= LOAD_VS_DIRECT_TARGET,
        )
    )


def _write(
    report: SectionReport,
    p50s: dict[str, Summary],
    p99s: dict[str, Summary],
    everything: dict[str, list[float]],
    calls: int,
    config: RunConfig,
) -> None:
    client, stock, direct = (p50s[w].median for w in WAYS)
    report.lines += [
        f"A {SIZE // 1000} KB generated checkpoint; {calls:,} calls per way per repetition, "
        f"{config.repeats} repetitions; p50 and p99 per repetition, then their median "
        "(min-max). Broker and store are one private redis-server.",
        "",
        "| way | p50 us | p99 us | p50 / direct save |",
        "|---|---:|---:|---:|",
    ]
    for way in WAYS:
        report.lines.append(
            f"| {way} | {p50s[way].fmt(',.0f')} | {p99s[way].fmt(',.0f')} | "
            f"{p50s[way].median / direct:.2f}x |"
        )
    report.lines += [
        "",
        f"Our client's p50 is **{client / direct:.2f}x** a direct `RedisStore.save` and "
        f"**{stock / client:.2f}x faster** than `apply_async` (ratio of p50s).",
    ]
    quick = config.quick
    report.targets += [
        Target(
            "producer enqueue p50 vs direct RedisStore.save",
            f"<= {VS_DIRECT_TARGET:.1f}x",
            f"{client / direct:.2f}x",
            None if quick else client / direct <= VS_DIRECT_TARGET,
        ),
        Target(
            "producer enqueue p50: apply_async / ours",
            f">= {VS_APPLY_ASYNC_TARGET:.0f}x",
            f"{stock / client:.2f}x",
            None if quick else stock / client >= VS_APPLY_ASYNC_TARGET,
        ),
    ]
    from bench import plots

    plots.cdf(
        config.out_dir / "producer_cdf.png",
        f"Enqueue cost per request, {SIZE // 1000} KB checkpoint",
        everything,
        "microseconds per call (log)",
    )
    report.plots.append("producer_cdf.png")
