"""Producer section: what one enqueue costs an API server, per request (p50/p99).

Three ways to get a 20 KB checkpoint on its way, each timed call by call against the same
private Redis (broker and store alike), interleaved repetitions:

* ``CheckpointClient.save``: our producer client (validate, stamp ``seq``, publish);
* Celery's ``apply_async`` of the same payload on a stock app (default settings, a task
  registered under the same name), what a team would write without our client;
* ``RedisStore.save``: writing the checkpoint synchronously, no queue at all.

Nothing consumes the queue: it is emptied between repetitions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from bench.harness import RunConfig, SectionReport, Summary, Target, percentile, summarize
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.messages import SAVE
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.servers import RedisServer

SIZE = 20_000
QUEUE = "checkpoints"
WAYS = ("CheckpointClient.save", "Celery apply_async", "RedisStore.save (direct)")
#: Targets of the performance issue.
VS_DIRECT_TARGET = 1.0
VS_APPLY_ASYNC_TARGET = 3.0


def run(config: RunConfig) -> SectionReport:
    calls = 50 if config.quick else 2_000
    server = RedisServer().start()
    try:
        p50s, p99s, everything = _measure(server, calls, config)
    finally:
        server.cleanup()
    report = SectionReport("producer", "Producer: enqueue cost per request")
    _write(report, p50s, p99s, everything, calls, config)
    return report


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
                micros = _time_calls(ways[name], calls)
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


def _time_calls(op: Callable[[int], object], calls: int) -> list[float]:
    clock = time.perf_counter
    micros: list[float] = []
    for i in range(calls):
        start = clock()
        op(i)
        micros.append((clock() - start) * 1e6)
    return micros


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
