"""Prometheus metrics of a worker, counted once each under the prefork pool.

Counters and histograms use prometheus-client's *multiprocess mode*: every process (the
main one, which dead-letters what the consumer refuses, and each pool child, which runs the
tasks) writes its own memory-mapped file in a directory the worker creates fresh at start-up
(``PROMETHEUS_MULTIPROC_DIR``) and removes at shutdown, and the main process's ``/metrics``
sums the files on each scrape. A request is counted by the process that handled it; an
exited child's file stays in the sums. The fresh directory makes a restarted worker start
from zero, which ``rate()`` reads as a counter reset, instead of counting a previous run twice.

Gauges of the broker and the store (queue depth, dead letters, sessions) belong to no
process: ``RedisGauges`` reads them at scrape time with O(1) or O(log n) reads
(``worker/ops/broker_probe.py`` for the queue, XLEN and ZCOUNT on the store). Nothing
connects at start-up, so a server that is down shows as ``checkpointq_redis_up 0`` instead
of stopping the worker. The metrics are listed in docs/operations.md ("Metrics").
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from celery import bootsteps, signals
from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from redis.exceptions import RedisClusterException, RedisError

from checkpointq.store.base import CheckpointStore
from checkpointq.store.errors import StoreUnavailable
from checkpointq.tasks import observers
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.observers import Observation, Received
from checkpointq.worker import connections
from checkpointq.worker.ops import broker_probe
from checkpointq.worker.settings import Settings

logger = logging.getLogger(__name__)

#: Environment variable prometheus-client reads to find the multiprocess directory.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Outcomes after which a request's seq tells how long it waited (enqueue -> apply).
_APPLIED = frozenset({"applied", "superseded", "deleted"})
#: Outcomes of a task body that ran to its end (what the apply-duration histogram times).
_RAN = frozenset({"applied", "superseded", "deleted", "refreshed", "absent", "swept", "locked_out"})

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_LAG_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
_SIZE_BUCKETS = tuple(float(256 * 4**i) for i in range(9))  # 256 B .. 16 MiB
_SWEEP_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60)


class WorkerMetrics:
    """The counters and histograms one worker process updates (multiprocess mode)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # registry=None: nothing is exposed from the default registry; the main process
        # serves the sum of every process's files instead (MultiProcessCollector).
        self.requests = Counter(
            "checkpointq_requests",
            "Requests finished, by task and outcome (retried: a retry was scheduled).",
            ["task", "outcome"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "checkpointq_dead_letters",
            "Requests recorded in the dead-letter stream, by reason kind.",
            ["kind"],
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "checkpointq_apply_duration_seconds",
            "Time a task body took (validation and the store call), by task.",
            ["task"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.lag_seconds = Histogram(
            "checkpointq_lag_seconds",
            "Enqueue to apply: now minus the request's seq, for saves and deletes that carry one.",
            ["task"],
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.request_bytes = Histogram(
            "checkpointq_request_body_bytes",
            "Size of each task message body as received (JSON, before compression), by task.",
            ["task"],
            buckets=_SIZE_BUCKETS,
            registry=registry,
        )
        self.stored_bytes = Histogram(
            "checkpointq_stored_value_bytes",
            "Size of each stored checkpoint value (zstd-compressed), applied saves only.",
            buckets=_SIZE_BUCKETS,
            registry=registry,
        )
        self.trimmed_saves = Counter(
            "checkpointq_trimmed_saves",
            "Applied saves whose history was truncated to fit the cap or byte budget.",
            registry=registry,
        )
        self.trimmed_messages = Counter(
            "checkpointq_trimmed_messages",
            "Messages dropped from histories to fit the cap or byte budget.",
            registry=registry,
        )
        self.sweeps = Counter(
            "checkpointq_sweeps",
            "Sweeps run by the workers (locked_out: another sweep held the lock).",
            ["outcome"],
            registry=registry,
        )
        self.swept_sessions = Counter(
            "checkpointq_swept_sessions",
            "Expired sessions removed by sweeps.",
            registry=registry,
        )
        self.sweep_seconds = Histogram(
            "checkpointq_sweep_duration_seconds",
            "Time one sweep took.",
            buckets=_SWEEP_BUCKETS,
            registry=registry,
        )

    def observe(self, o: Observation) -> None:
        self.requests.labels(o.task, o.outcome).inc()
        if o.kind is not None:
            self.dead_letters.labels(o.kind).inc()
        if o.seconds is not None and o.outcome in _RAN:
            self.apply_seconds.labels(o.task).observe(o.seconds)
        if o.seq is not None and o.outcome in _APPLIED:
            self.lag_seconds.labels(o.task).observe(max(0, time.time_ns() // 1000 - o.seq) / 1e6)
        if o.outcome == "applied" and o.stored_bytes:
            self.stored_bytes.observe(o.stored_bytes)
        if o.trimmed:
            self.trimmed_saves.inc()
            self.trimmed_messages.inc(o.trimmed)
        if o.task == "expire_stale" and o.outcome in ("swept", "locked_out"):
            self.sweeps.labels(o.outcome).inc()
            self.swept_sessions.inc(o.expired)
            if o.seconds is not None and o.outcome == "swept":
                self.sweep_seconds.observe(o.seconds)

    def received(self, r: Received) -> None:
        self.request_bytes.labels(r.task).observe(r.body_bytes)


# -- this process's metrics -----------------------------------------------------------------

_lock = threading.Lock()
_metrics: WorkerMetrics | None = None
_directory: Path | None = None


def _process_metrics() -> WorkerMetrics:
    # Created on first use, which is after prepare_directory() in every worker process.
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = WorkerMetrics()
        return _metrics


def _observe(observation: Observation) -> None:
    _process_metrics().observe(observation)


def _received(received: Received) -> None:
    _process_metrics().received(received)


def prepare_directory() -> Path:
    """Create a fresh multiprocess directory and switch prometheus-client to it.

    Called in the worker's main process before the pool forks; the children inherit the
    environment variable. prometheus-client chooses its value class when it is imported,
    which may have happened before (this module imports it): choose again now.
    """
    global _directory
    path = Path(tempfile.mkdtemp(prefix="checkpointq-metrics-"))
    os.environ[MULTIPROC_ENV] = str(path)
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    _directory = path
    return path


def directory() -> Path | None:
    """The multiprocess directory of this worker (None outside a worker)."""
    return _directory


def snapshot(path: Path | None = None) -> dict[str, Any]:
    """This worker's totals so far, summed over its processes (what heartbeats publish).

    ``requests`` maps ``task:outcome`` to a count, ``dead_letters`` maps a reason kind to a
    count, ``lag`` and ``apply`` are ``[sum_seconds, count]``.
    """
    where = path or _directory
    out: dict[str, Any] = {"requests": {}, "dead_letters": {}, "lag": [0.0, 0], "apply": [0.0, 0]}
    if where is None:
        return out
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, str(where))  # type: ignore[no-untyped-call]
    for family in registry.collect():
        for sample in family.samples:
            _fold(out, sample.name, sample.labels, sample.value)
    return out


def _fold(out: dict[str, Any], name: str, labels: dict[str, str], value: float) -> None:
    if name == "checkpointq_requests_total":
        out["requests"][f"{labels['task']}:{labels['outcome']}"] = int(value)
    elif name == "checkpointq_dead_letters_total":
        out["dead_letters"][labels["kind"]] = int(value)
    elif name in ("checkpointq_lag_seconds_sum", "checkpointq_apply_duration_seconds_sum"):
        out["lag" if "lag" in name else "apply"][0] += value
    elif name in ("checkpointq_lag_seconds_count", "checkpointq_apply_duration_seconds_count"):
        out["lag" if "lag" in name else "apply"][1] += int(value)


# -- the scrape-time gauges ---------------------------------------------------------------


class RedisGauges:
    """Gauges read from the broker and the store on each scrape (main process): cheap
    reads only."""

    #: The families ``collect`` yields (docs/operations.md lists them).
    NAMES = (
        "checkpointq_queue_depth",
        "checkpointq_dead_letter_depth",
        "checkpointq_sessions",
        "checkpointq_redis_up",
    )

    def __init__(self, settings: Settings) -> None:
        resolved = connections.resolve(settings)
        self._settings = resolved
        self._queue = resolved.queue
        self._keys = connections.key_space(resolved)
        self._broker = broker_probe.open_probe(resolved)
        # A cluster client connects as it is built: opened on the first scrape instead.
        self._store: CheckpointStore | None = None
        self._side: Any = None  # the Redis beside the store (dead letters)
        self._store_lock = threading.Lock()

    def close(self) -> None:
        self._broker.close()
        if self._store is not None:
            self._store.close()
            self._side.close()

    def describe(self) -> list[Metric]:
        return []  # no pre-registration checks: names are fixed and documented

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "checkpointq_redis_up",
            "Whether the last scrape could read the broker (any kind) or the store Redis.",
            labels=["role"],
        )
        try:
            depth = self._broker.queue(self._queue).depth
        except BrokerUnavailable as exc:
            logger.warning("metrics: broker unreadable: %s", exc)
            up.add_metric(["broker"], 0)
        else:
            up.add_metric(["broker"], 1)
            queue = GaugeMetricFamily(
                "checkpointq_queue_depth", "Messages waiting in the queue.", labels=["queue"]
            )
            queue.add_metric([self._queue], depth)
            yield queue
        try:
            dead, live, expired = self._store_counts()
        except (RedisError, RedisClusterException, StoreUnavailable) as exc:
            logger.warning("metrics: store unreadable: %s", exc)
            up.add_metric(["store"], 0)
        else:
            up.add_metric(["store"], 1)
            yield GaugeMetricFamily(
                "checkpointq_dead_letter_depth", "Entries in the dead-letter stream.", value=dead
            )
            sessions = GaugeMetricFamily(
                "checkpointq_sessions",
                "Sessions in the deadline index: live, or expired and not yet swept.",
                labels=["state"],
            )
            sessions.add_metric(["live"], live)
            sessions.add_metric(["expired"], expired)
            yield sessions
        yield up

    def _store_counts(self) -> tuple[int, int, int]:
        with self._store_lock:  # overlapping scrapes build one store
            if self._store is None:
                self._store = connections.open_store(self._settings)
                self._side = connections.store_client(self._settings)
        store = self._store
        dead = int(self._side.xlen(self._keys.dead_letters()))
        sessions = store.count_sessions()
        return dead, sessions.live, sessions.expired


# -- wiring into the worker -----------------------------------------------------------------


def registry_for(path: Path, settings: Settings) -> tuple[CollectorRegistry, RedisGauges]:
    """What ``/metrics`` serves: every process's counters, and the Redis gauges."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, str(path))  # type: ignore[no-untyped-call]
    gauges = RedisGauges(settings)
    registry.register(gauges)
    return registry, gauges


_server: WSGIServer | None = None


def install(app: Any, settings: Settings) -> None:
    """Serve ``/metrics`` from ``app``'s workers when ``settings.metrics_port`` is set."""
    if settings.metrics_port is None:
        return
    port: int = settings.metrics_port

    class MetricsEndpoint(bootsteps.StartStopStep):  # type: ignore[misc]  # no celery hints
        """The main process's HTTP endpoint, started once the pool is up."""

        requires = ("celery.worker.components:Pool",)

        def __init__(self, worker: Any, **kwargs: Any) -> None:
            self._gauges: RedisGauges | None = None

        def start(self, worker: Any) -> None:
            global _server
            path = _directory or prepare_directory()
            registry, self._gauges = registry_for(path, settings)
            _server, _ = start_http_server(port, settings.metrics_address, registry)
            logger.info("metrics on http://%s:%d/metrics", settings.metrics_address, port)

        def stop(self, worker: Any) -> None:
            global _server
            if _server is not None:
                _server.shutdown()
                _server.server_close()
                _server = None
            if self._gauges is not None:
                self._gauges.close()
                self._gauges = None

    app.steps["worker"].add(MetricsEndpoint)


def _on_worker_init(**_: Any) -> None:
    # Main process, before the pool forks: every process from now on counts into the files.
    prepare_directory()
    observers.subscribe(_observe, _received)


def _on_child_start(**_: Any) -> None:
    # A forked child inherits the endpoint's listening socket: close its copy, so that only
    # the main process holds the port (and it is free again as soon as that one exits).
    if _server is not None:
        _server.socket.close()


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    # Counters and histograms of a dead child stay (they are part of the totals); only
    # live-process gauges would have to go, which is what mark_process_dead removes.
    if _directory is not None:
        multiprocess.mark_process_dead(pid or os.getpid(), str(_directory))  # type: ignore[no-untyped-call]


def _on_worker_shutdown(**_: Any) -> None:
    global _directory
    if _directory is not None:
        shutil.rmtree(_directory, ignore_errors=True)
        _directory = None


signals.worker_init.connect(_on_worker_init, weak=False, dispatch_uid="checkpointq.metrics.init")
signals.worker_process_init.connect(
    _on_child_start, weak=False, dispatch_uid="checkpointq.metrics.child_start"
)
signals.worker_process_shutdown.connect(
    _on_child_exit, weak=False, dispatch_uid="checkpointq.metrics.child_exit"
)
signals.worker_shutdown.connect(
    _on_worker_shutdown, weak=False, dispatch_uid="checkpointq.metrics.shutdown"
)
