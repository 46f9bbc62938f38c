"""Latency section: enqueue -> durable (visible to ``load``) at half the measured capacity.

One worker as deployed by default (prefork, concurrency 2) on private broker and store
redis-servers. First its capacity for 20 KB saves is measured (a staged drain, as in the
worker section); then a producer offers half of it, evenly paced, through
``CheckpointClient.save`` and, in a second run, through ``BatchingClient`` (5 ms window).
A watcher polls each request's fence (every 0.5 ms) in order and records when it became
durable; the latency of a request runs from just before its ``save`` call.
"""

from __future__ import annotations

import threading
import time

from bench import worker_drain
from bench.harness import RunConfig, SectionReport, Target, percentile
from bench.workload import make_checkpoint
from checkpointq.store import Checkpoint, RedisStore
from checkpointq.tasks.producer.batching import BatchingClient
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from tests.support.servers import RedisServer

SIZE = 20_000
P99_TARGET_MS = 25.0
WAYS = ("CheckpointClient.save", "BatchingClient.save (5 ms window)")


def run(config: RunConfig) -> SectionReport:
    requests = 40 if config.quick else 2_000
    broker, store = RedisServer().start(), RedisServer().start()
    try:
        with worker_drain.running_worker(broker, store, "prefork", 2):
            capacity = worker_drain.drain(
                broker, "checkpoint.save", 50 if config.quick else 600, SIZE, "cap"
            )
            rate = capacity / 2
            checkpoints = [make_checkpoint(f"lat-{i}", SIZE) for i in range(64)]
            samples: dict[str, list[float]] = {}
            for way in WAYS:
                client = CheckpointClient(broker.url, RedisStore.from_url(store.url))
                producer = BatchingClient(client, window_ms=5) if way != WAYS[0] else client
                try:
                    samples[way] = _offer(producer, checkpoints, rate, requests)
                finally:
                    producer.close()
    finally:
        broker.cleanup()
        store.cleanup()
    report = SectionReport("latency", "Latency: enqueue -> durable at half capacity")
    report.lines += [
        f"prefork -c 2 worker; measured capacity {capacity:,.0f} saves/s of a "
        f"{SIZE // 1000} KB checkpoint; offered {rate:,.0f}/s, evenly paced, {requests:,} "
        "requests per way; one run each (the percentiles are over all its requests).",
        "",
        "| way | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for way, ms in samples.items():
        report.lines.append(
            f"| {way} | {percentile(ms, 50):.1f} | {percentile(ms, 90):.1f} | "
            f"{percentile(ms, 99):.1f} | {max(ms):.1f} |"
        )
    p99 = percentile(samples[WAYS[0]], 99)
    report.targets.append(
        Target(
            "enqueue -> durable p99 at half capacity",
            f"<= {P99_TARGET_MS:.0f} ms",
            f"{p99:.1f} ms (batched: {percentile(samples[WAYS[1]], 99):.1f} ms)",
            None if config.quick else p99 <= P99_TARGET_MS,
        )
    )
    from bench import plots

    plots.cdf(
        config.out_dir / "latency_cdf.png",
        f"Enqueue -> durable at {rate:,.0f} saves/s (half capacity)",
        samples,
        "milliseconds (log)",
    )
    report.plots.append("latency_cdf.png")
    return report


def _offer(
    producer: CheckpointClient | BatchingClient,
    checkpoints: list[Checkpoint],
    rate: float,
    requests: int,
) -> list[float]:
    """Latencies in ms of ``requests`` saves offered at ``rate`` per second."""
    sent: list[tuple[float, Handle]] = []
    ready = threading.Condition()
    latencies: list[float] = []

    def watch() -> None:
        store = producer.client.store if isinstance(producer, BatchingClient) else producer.store
        for n in range(requests):
            with ready:
                while len(sent) <= n:
                    ready.wait()
                started, handle = sent[n]
            seq = handle.seq or 0
            while True:
                fence = store.fence(handle.session_id)
                if fence is not None and fence.seq >= seq:
                    break
                time.sleep(0.0005)
            latencies.append((time.perf_counter() - started) * 1000)

    watcher = threading.Thread(target=watch, name="latency-watcher")
    watcher.start()
    interval = 1 / rate
    start = time.perf_counter()
    for n in range(requests):
        # Pacing the offered load (not synchronising anything): wait for this request's slot.
        delay = start + n * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        started = time.perf_counter()
        handle = producer.save(checkpoints[n % len(checkpoints)])
        with ready:
            sent.append((started, handle))
            ready.notify()
    watcher.join()
    return latencies
