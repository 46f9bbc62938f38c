"""Latency section: enqueue -> durable (visible to ``load``) at half the measured capacity.

Workers as deployed (prefork, concurrency 2), each on its own private broker and store
redis-servers and all running at once, so that the ways can be interleaved:

* **coalesced (default)**: the production worker with its coalescer traced
  (``bench/traced_app.py``, one JSON line per group), which says where a message waits;
* **coalesced, window 0**: ``coalesce_window_ms=0``, every group goes as soon as a pool
  process is idle (the default waits up to 2 ms while another group is in the pool);
* **coalescing off**: ``coalesce_max_items=0``, one task per message, as before
  worker-side coalescing;
* **via BatchingClient**: the default worker, fed by the Python batching producer.

The target's rate is half the default worker's capacity, measured first in the same run as
the median drain rate of three queued bursts of saves (the worker section's staged drain,
interleaved with the coalescing-off worker's); every way is
offered that same rate. Half the coalescing-off worker's burst capacity (the rate this
section offered before coalescing) is offered to the default, window 0 and coalescing-off
workers too, to tell a slower worker from a faster rate. A producer offers ``requests`` evenly paced
saves through ``CheckpointClient.save`` (or ``BatchingClient``, 5 ms window); a watcher
polls each request's fence (every 0.5 ms) in order and records when it became durable; a
request's latency runs from just before its ``save`` call. Repetitions interleave the rows
(every other one in reverse order), so load from other work on the machine falls on all of
them alike; each percentile is the median of the repetitions (min-max).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench import worker_drain
from bench.harness import RunConfig, SectionReport, Summary, Target, percentile, summarize
from bench.workload import make_checkpoint
from checkpointq.store import Checkpoint, RedisStore
from checkpointq.tasks.producer.batching import BatchingClient
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from tests.support.servers import RedisServer

SIZE = 20_000
P99_TARGET_MS = 25.0
DEFAULT = "coalesced (default)"
WINDOW = "coalesced, window 0 (no wait while a process is idle)"
OFF = "coalescing off"
BATCHED = "coalesced, via BatchingClient (5 ms window)"
#: The offered rates: half the default worker's capacity (the target's), and half the
#: coalescing-off worker's (what this section offered before coalescing).
HALF = "half the default's capacity"
HALF_OFF = "half the coalescing-off capacity"


@dataclass
class Way:
    """One worker (on its own servers) and how requests are offered to it."""

    label: str
    kind: str
    settings: dict[str, object] = field(default_factory=dict)
    batching: bool = False
    traced: bool = False
    broker: RedisServer = field(default_factory=RedisServer)
    store: RedisServer = field(default_factory=RedisServer)
    trace: Path | None = None


def run(config: RunConfig) -> SectionReport:
    requests = 40 if config.quick else 1_000
    burst = 50 if config.quick else 600
    repeats = 1 if config.quick else config.repeats
    default, window, off, batched = ways = [
        Way(DEFAULT, "traced", traced=True),
        Way(WINDOW, "save", {"coalesce_window_ms": 0}),
        Way(OFF, "save", {"coalesce_max_items": 0}),
        Way(BATCHED, "save", batching=True),
    ]
    offers = [(default, HALF), (window, HALF), (off, HALF), (batched, HALF)]
    offers += [(default, HALF_OFF), (window, HALF_OFF), (off, HALF_OFF)]
    latencies: dict[tuple[str, str], list[list[float]]] = {(w.label, r): [] for w, r in offers}
    sends: list[dict[str, float]] = []
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="cq-latency-") as tmp, _workers(ways, Path(tmp)):
        # The median of three bursts each: one burst lasts under a second, and the offered
        # rate should not hang on what else the machine did in that second.
        capacities: dict[str, list[float]] = {DEFAULT: [], OFF: []}
        for n in range(3):
            for way in (default, off):
                tag = f"cap{n}"
                capacities[way.label].append(
                    worker_drain.drain(way.broker, "checkpoint.save", burst, SIZE, tag)
                )
        capacity = summarize(capacities[DEFAULT]).median
        capacity_off = summarize(capacities[OFF]).median
        rates = {HALF: capacity / 2, HALF_OFF: capacity_off / 2}
        checkpoints = [make_checkpoint(f"lat-{i}", SIZE) for i in range(64)]
        for repetition in range(repeats):
            # Every other repetition in reverse, so that no row always follows the same one.
            for way, rate in offers if repetition % 2 == 0 else offers[::-1]:
                loads.append(os.getloadavg()[0])
                client = CheckpointClient(way.broker.url, RedisStore.from_url(way.store.url))
                producer = BatchingClient(client, window_ms=5) if way.batching else client
                try:
                    sent, ms = _offer(producer, checkpoints, rates[rate], requests)
                finally:
                    producer.close()
                latencies[(way.label, rate)].append(ms)
                if way.traced and rate == HALF:
                    sends.append(sent)
        breakdown = _breakdown(default.trace, sends) if default.trace else None
    report = SectionReport("latency", "Latency: enqueue -> durable at half capacity")
    _write(report, latencies, rates, capacity, capacity_off, requests, repeats, loads, breakdown)
    p99 = {key: summarize([percentile(ms, 99) for ms in r]) for key, r in latencies.items()}
    report.targets.append(
        Target(
            "enqueue -> durable p99 at half capacity",
            f"<= {P99_TARGET_MS:.0f} ms",
            f"{p99[(DEFAULT, HALF)].fmt('.1f', ' ms')} (coalescing off at the same rate: "
            f"{p99[(OFF, HALF)].fmt('.1f', ' ms')}; at half the coalescing-off capacity: "
            f"{p99[(DEFAULT, HALF_OFF)].fmt('.1f', ' ms')}, off "
            f"{p99[(OFF, HALF_OFF)].fmt('.1f', ' ms')})",
            None if config.quick else p99[(DEFAULT, HALF)].median <= P99_TARGET_MS,
        )
    )
    from bench import plots

    plots.cdf(
        config.out_dir / "latency_cdf.png",
        f"Enqueue -> durable at {rates[HALF]:,.0f} saves/s (half capacity)",
        {w: [v for ms in r for v in ms] for (w, rate), r in latencies.items() if rate == HALF},
        "milliseconds (log)",
    )
    report.plots.append("latency_cdf.png")
    return report


@contextmanager
def _workers(ways: list[Way], tmp: Path) -> Iterator[None]:
    """Every way's servers and worker, started together and stopped afterwards."""
    with ExitStack() as stack:
        for way in ways:
            for server in (way.broker, way.store):
                server.start()
                stack.callback(server.cleanup)
            env = {}
            if way.traced:
                way.trace = tmp / f"trace-{way.kind}.jsonl"
                way.trace.touch()
                env["BENCH_TRACE_FILE"] = str(way.trace)
            stack.enter_context(
                worker_drain.running_worker(
                    way.broker, way.store, kind=way.kind, settings=way.settings, extra_env=env
                )
            )
        yield


def _offer(
    producer: CheckpointClient | BatchingClient,
    checkpoints: list[Checkpoint],
    rate: float,
    requests: int,
) -> tuple[dict[str, float], list[float]]:
    """``requests`` saves offered at ``rate`` per second: when each was sent (wall clock, by
    task id) and each one's latency in ms."""
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
    wall: dict[str, float] = {}
    for n in range(requests):
        # Pacing the offered load (not synchronising anything): wait for this request's slot.
        delay = start + n * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        started = time.perf_counter()
        wall_started = time.time()
        handle = producer.save(checkpoints[n % len(checkpoints)])
        wall[handle.task_id] = wall_started
        with ready:
            sent.append((started, handle))
            ready.notify()
    watcher.join()
    return wall, latencies


@dataclass(slots=True)
class Breakdown:
    """Where the default worker's messages spent their time, in ms (all repetitions)."""

    in_broker: list[float]
    in_main: list[float]
    in_pool: list[float]
    acking: list[float]
    sizes: list[int]
    sent_while_busy: int


def _breakdown(trace: Path, sends: list[dict[str, float]]) -> Breakdown:
    """The traced worker's groups of the requests in ``sends`` (task id -> when sent).

    A message's time in the broker runs from just before the producer's ``save`` call to its
    arrival in the coalescer; both clocks are this machine's wall clock.
    """
    sent = {task_id: t for run in sends for task_id, t in run.items()}
    b = Breakdown([], [], [], [], [], 0)
    with trace.open(encoding="utf-8") as lines:
        for line in lines:
            group = json.loads(line)
            if group["items"][0][0] not in sent:
                continue  # the capacity burst, or another rate's runs
            b.sizes.append(len(group["items"]))
            b.in_pool.append((group["done"] - group["sent"]) * 1000)
            if "ack" in group:
                b.acking.append((group["ack"][1] - group["ack"][0]) * 1000)
            b.sent_while_busy += bool(group["in_pool"])
            for task_id, arrived in group["items"]:
                b.in_main.append((group["sent"] - arrived) * 1000)
                if task_id in sent:
                    b.in_broker.append((arrived - sent[task_id]) * 1000)
    return b


def _write(
    report: SectionReport,
    latencies: dict[tuple[str, str], list[list[float]]],
    rates: dict[str, float],
    capacity: float,
    capacity_off: float,
    requests: int,
    repeats: int,
    loads: list[float],
    breakdown: Breakdown | None,
) -> None:
    report.lines += [
        f"prefork -c 2 workers, each on its own broker and store redis-servers, all running "
        f"at once; {SIZE // 1000} KB checkpoints. Capacity (drain of a queued burst of saves, "
        f"median of 3 in this run): default worker {capacity:,.0f} saves/s, coalescing off "
        f"{capacity_off:,.0f} saves/s. Offered, evenly paced: **{rates[HALF]:,.0f}/s** "
        f"({HALF}: the target's rate) and {rates[HALF_OFF]:,.0f}/s ({HALF_OFF}: the rate "
        f"this section offered before coalescing). {requests:,} requests per run, {repeats} "
        f"run(s) per row, rows interleaved (every other repetition reversed); each "
        f"percentile is the median of the runs (min-max). 1-minute load average while "
        f"measuring: {min(loads):.2f}-{max(loads):.2f} "
        f"(2 CPUs; the producer and its watcher run on them too).",
        "",
        "| way | offered | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (label, rate), runs in latencies.items():
        cells = [summarize([percentile(ms, q) for ms in runs]) for q in (50, 90, 99)]
        cells.append(summarize([max(ms) for ms in runs]))
        row = " | ".join(_ms(c) for c in cells)
        report.lines.append(f"| {label} | {rates[rate]:,.0f}/s | {row} |")
    if breakdown is None or not breakdown.sizes:
        return
    b = breakdown
    report.lines += [
        "",
        f"Where the default worker's messages waited at {rates[HALF]:,.0f}/s (its trace, "
        f"all runs; ms): "
        f"{len(b.sizes):,} groups, {sum(b.sizes) / len(b.sizes):.1f} messages on average "
        f"(p50 {percentile(b.sizes, 50)}, p99 {percentile(b.sizes, 99)}, max {max(b.sizes)}); "
        f"{b.sent_while_busy / len(b.sizes):.0%} sent while another group was in the pool.",
        "",
        "| stage | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for stage, values in (
        ("producer's `save` -> reaches the coalescer (in the broker's list, read)", b.in_broker),
        ("waits in the main process for its group to be sent", b.in_main),
        ("group sent -> pool's answer back (applied, durable)", b.in_pool),
        ("acknowledging the group's messages (one pipeline)", b.acking),
    ):
        if values:
            row = " | ".join(f"{percentile(values, q):.1f}" for q in (50, 90, 99))
            report.lines.append(f"| {stage} | {row} | {max(values):.1f} |")


def _ms(summary: Summary) -> str:
    return summary.fmt(".1f") if summary.runs > 1 else f"{summary.median:.1f}"
