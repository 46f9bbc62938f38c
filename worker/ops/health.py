"""Worker heartbeats, and the health check that reads them (``checkpointq health``).

Remote control is off by default (anyone who can write to the broker could otherwise stop
the fleet), so ``celery inspect ping`` cannot tell whether a worker runs. Instead each
worker writes a heartbeat to the store Redis every ``heartbeat_seconds``: a key
(``KeySpace.heartbeat(name)``) that expires after three intervals, and its name in a set
(``KeySpace.workers()``) so that readers find the keys without SCAN. The value is a small
JSON document: host, pid, time, and the worker's totals so far (``metrics.snapshot()``),
which is what ``checkpointq top`` turns into throughput.

The heartbeat is sent from the consumer's event loop (a consumer bootstep on its timer, as
Celery's own event heartbeat), not from a thread: it stops when the loop is stuck, and when
the broker connection is lost (Celery stops the consumer's steps until it reconnects). It
therefore says "this worker is consuming", not merely "this process exists". Its expiry is
measured by Redis, so the clocks of the worker and the checker never have to agree.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery, bootsteps
from celery.worker import state as worker_state
from redis.exceptions import RedisClusterException

from checkpointq.store import probe
from checkpointq.store.errors import CheckpointError
from checkpointq.store.keys import KeySpace
from checkpointq.store.urls import redact_url, redis_py_url
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.worker import connections
from checkpointq.worker.beat import SWEEP_ENTRY, beat_config
from checkpointq.worker.hooks import kombu as kombu_hooks
from checkpointq.worker.ops import broker_probe, eviction, metrics
from checkpointq.worker.settings import Settings

logger = logging.getLogger(__name__)

#: A heartbeat lives this many intervals: one late beat is not yet a dead worker.
HEARTBEAT_LIVES = 3
#: Seconds a health check waits for the broker and for the store to connect and answer.
CHECK_TIMEOUT = 3.0
#: A sweep this much later than its due time means beat is not running (a running beat
#: fires within one tick, at most 5 s, of the due time and reschedules it at once).
BEAT_SLACK_SECONDS = 30.0


# -- the heartbeat ------------------------------------------------------------------------


def heartbeat_value(worker: str, started: float, queue: str) -> dict[str, Any]:
    """What one heartbeat says: who, since when, and the worker's totals so far."""
    return {
        "worker": worker,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "queue": queue,
        "started": started,
        "time": time.time(),
        "totals": metrics.snapshot(),
    }


def finished(totals: dict[str, Any]) -> int:
    """Requests a worker finished with in any way (retries and requeues included)."""
    return sum(int(n) for n in totals.get("requests", {}).values())


def held_messages(consumer: Any) -> int:
    """Messages delivered to this worker and not yet acknowledged or given back.

    kombu's virtual (Redis) QoS keeps that count; other transports (RabbitMQ) do not expose
    it, and then the tasks Celery holds (reserved, ETA retries included) stand in for it.
    """
    qos = getattr(getattr(getattr(consumer, "task_consumer", None), "channel", None), "qos", None)
    held = kombu_hooks.held_messages(qos)
    return len(worker_state.reserved_requests) if held is None else held


class Heartbeat:
    """Writes one worker's heartbeat; ``beat()`` is called on the consumer's timer."""

    def __init__(
        self,
        client: Any,
        keys: KeySpace,
        worker: str,
        *,
        interval: float,
        queue: str,
        held: Callable[[], int] = lambda: 0,
        stall_after: float = 120.0,
    ):
        self.client = client
        self.keys = keys
        self.worker = worker
        self.interval = interval
        self.queue = queue
        self.held = held
        self.stall_after = stall_after
        self.started = time.time()
        self._failing = False
        self._finished = -1
        self._progress_at = self.started

    def value(self) -> dict[str, Any]:
        """The heartbeat, with what health needs to tell a stuck worker from an idle one:
        messages held, requests finished, and when the worker last made progress (finished a
        request, or held nothing)."""
        value = heartbeat_value(self.worker, self.started, self.queue)
        done, held = finished(value["totals"]), self.held()
        if done != self._finished or held == 0:
            self._finished, self._progress_at = done, value["time"]
        value.update(
            held=held, finished=done, progress_at=self._progress_at, stall_after=self.stall_after
        )
        return value

    def beat(self) -> None:
        value = json.dumps(self.value())
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(
                self.keys.heartbeat(self.worker),
                value,
                px=int(self.interval * HEARTBEAT_LIVES * 1000),
            )
            pipe.sadd(self.keys.workers(), self.worker)
            pipe.execute()
        except redis.RedisError as exc:
            # Logged once per outage: health checks report the missing heartbeat meanwhile.
            if not self._failing:
                logger.warning("heartbeat not written (store Redis: %s)", exc)
            self._failing = True
        else:
            if self._failing:
                logger.info("heartbeat written again")
            self._failing = False

    def clear(self) -> None:
        """Remove the heartbeat at a clean stop, so nobody mistakes us for running."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.keys.heartbeat(self.worker))
            pipe.srem(self.keys.workers(), self.worker)
            pipe.execute()
        except redis.RedisError as exc:
            logger.info("heartbeat not cleared (it expires by itself): %s", exc)


def stall_seconds(settings: Settings) -> float:
    """How long a worker may hold messages without finishing any before health calls it
    stuck: longer than the longest retry countdown (a held retry waits that long) plus a
    few heartbeats."""
    return settings.retry_backoff_max_seconds + 6 * settings.heartbeat_seconds


def install(app: Celery, settings: Settings) -> None:
    """Make ``app``'s workers send heartbeats while they consume."""

    class HeartbeatStep(bootsteps.StartStopStep):  # type: ignore[misc]  # no celery hints
        """Heartbeats on the consumer's timer, from when it can receive tasks."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            self._heart: Heartbeat | None = None
            self._tref: Any = None

        def start(self, consumer: Any) -> None:
            resolved = connections.resolve(settings)
            client = connections.store_client(resolved, timeout=1.0)
            heart = Heartbeat(
                client,
                connections.key_space(resolved),
                consumer.hostname,
                interval=settings.heartbeat_seconds,
                queue=settings.queue,
                held=lambda: held_messages(consumer),
                stall_after=stall_seconds(settings),
            )
            heart.beat()
            self._heart = heart
            self._tref = consumer.timer.call_repeatedly(settings.heartbeat_seconds, heart.beat)

        def stop(self, consumer: Any) -> None:
            if self._tref is not None:
                consumer.timer.cancel(self._tref)
                self._tref = None
            if self._heart is not None:
                self._heart.clear()
                self._heart.client.close()
                self._heart = None

        shutdown = stop

    app.steps["consumer"].add(HeartbeatStep)


def live_workers(client: Any, keys: KeySpace) -> list[dict[str, Any]]:
    """The heartbeats of workers alive now (their keys have not expired), by name."""
    names = sorted(_text(name) for name in client.smembers(keys.workers()))
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(keys.heartbeat(name))
    beats = []
    for raw in pipe.execute():
        if raw is not None:
            beats.append(json.loads(raw))
    return beats


# -- beat's schedule ------------------------------------------------------------------------


def next_sweep(settings: Settings, client: Any) -> float | None:
    """When beat will next run the sweep (epoch seconds), from RedBeat's schedule in Redis.

    None when no beat has ever scheduled it. ``client`` is on the store Redis; RedBeat keeps
    the schedule there unless ``beat_url`` says otherwise (a cluster store), in which case a
    client on that Redis is opened for this read. The key names come from RedBeat itself.
    """
    # Imported here: only `checkpointq health` reads beat's schedule, and RedBeat (with
    # tenacity) would otherwise cost every worker's main process about 1 MB.
    from redbeat.schedulers import RedBeatConfig, RedBeatSchedulerEntry

    app = Celery("checkpointq-health", set_as_current=False)
    app.conf.update(beat_config(settings))
    app.redbeat_conf = RedBeatConfig(app)
    entry_key = RedBeatSchedulerEntry.generate_key(app, SWEEP_ENTRY)
    beat_url = settings.resolved_beat_url
    if beat_url is None:
        return None
    if beat_url == settings.resolved_redis_url:
        score = client.zscore(app.redbeat_conf.schedule_key, entry_key)
    else:
        beat_client = _client(beat_url)
        try:
            score = beat_client.zscore(app.redbeat_conf.schedule_key, entry_key)
        finally:
            beat_client.close()
    return None if score is None else float(score)


# -- the check ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One thing a health check looked at."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Report:
    """All checks; healthy when every one passed. Warnings (a Redis that may evict our
    keys) never make it unhealthy: a probe must not restart pods over configuration."""

    checks: list[Check] = field(default_factory=list)
    warnings: list[eviction.EvictionWarning] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in self.checks},
            "warnings": [warning.as_json() for warning in self.warnings],
        }

    def warning_lines(self) -> list[str]:
        return [f"warning: {warning.line()}" for warning in self.warnings]

    def line(self) -> str:
        """One line: the failures if any, else what passed."""
        shown = [c for c in self.checks if not c.ok] or self.checks
        status = "healthy" if self.ok else "unhealthy"
        return f"{status}: " + "; ".join(f"{c.name}: {c.detail}" for c in shown)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _client(url: str) -> Any:
    return redis.Redis.from_url(
        redis_py_url(url),
        socket_timeout=CHECK_TIMEOUT,
        socket_connect_timeout=CHECK_TIMEOUT,
    )


def _ping_broker(settings: Settings, probe: broker_probe.BrokerProbe) -> tuple[Check, bool]:
    """The broker's check, and whether it answered at all."""
    try:
        probe.ping()
    except BrokerUnavailable as exc:
        return Check("broker", False, str(exc)), False
    # A broker that answers but refuses writes (out of memory, read-only) cannot take an
    # ack: workers hold still meanwhile (worker/backpressure.py).
    refusal = probe.write_refusal(connections.key_space(settings).write_probe())
    if refusal is not None:
        paused = f"paused: broker refusing writes ({refusal})"
        return Check("broker", False, f"{probe.where} answers; {paused}"), True
    return Check("broker", True, f"{probe.where} answers and accepts writes"), True


def _ping_store(settings: Settings) -> tuple[Check, Any]:
    """PING the store (a single Redis or a cluster: ``connections.store_client``), then
    write to it: a store that answers but refuses writes (out of memory, read-only) stops
    every request, and workers pause meanwhile (``worker/backpressure.py``).

    A PostgreSQL store is asked by a probe write to its own table; the client returned is
    then the broker's Redis, which keeps the heartbeats beside it."""
    where = redact_url(settings.resolved_store_url or "")
    if settings.store_is_postgres:
        return _ping_database(settings, where)
    client = None
    try:
        # A cluster client connects (and may fail) as it is built.
        client = connections.store_client(settings, timeout=CHECK_TIMEOUT)
        client.ping()
    except (redis.RedisError, RedisClusterException) as exc:
        if client is not None:
            client.close()
        return Check("store", False, f"{where} unreachable ({type(exc).__name__})"), None
    refusal = probe.write_refusal(client, connections.key_space(settings).write_probe())
    if refusal is not None:
        return Check("store", False, f"{where} refusing writes: {refusal}"), client
    return Check("store", True, f"{where} answers and accepts writes"), client


def _ping_database(settings: Settings, where: str) -> tuple[Check, Any]:
    try:
        store = connections.open_store(settings)
    except CheckpointError as exc:
        return Check("store", False, f"{where}: {exc}"), None
    try:
        refusal = store.write_refusal()
    finally:
        store.close()
    try:
        client = connections.store_client(settings, timeout=CHECK_TIMEOUT)
    except (redis.RedisError, RedisClusterException):
        client = None
    if refusal is not None:
        return Check("store", False, f"{where} refusing writes: {refusal}"), client
    return Check("store", True, f"{where} answers and accepts writes"), client


def check(settings: Settings, *, local: bool = False, beat: bool = False) -> Report:
    """Ping the broker (whatever its kind: ``broker_probe``) and the store; then look for a
    live worker (or, with ``beat``, for a sweep schedule that is not overdue). Each Redis
    that answered is also asked whether it may evict our keys (``eviction``): warnings.

    Args:
        settings: resolved settings (both URLs known).
        local: the worker must run on this host (a container's or pod's own probe).
        beat: check beat's schedule instead of the workers (beat's own probe).
    """
    store_check, store = _ping_store(settings)
    with broker_probe.open_probe(settings, timeout=CHECK_TIMEOUT) as probe:
        broker_check, answered = _ping_broker(settings, probe)
        # Only servers that answered are asked: a probe waits for each at most once.
        warnings = eviction.check(settings, probe.redis_client if answered else None, store)
    checks = [broker_check, store_check]
    try:
        name = "beat" if beat else "worker"
        if store is None:
            checks.append(Check(name, False, "not checked: the store is down"))
        elif beat:
            checks.append(_check_beat(settings, store))
        else:
            keys = connections.key_space(settings)
            refusing = not store_check.ok
            checks.append(_check_workers(live_workers(store, keys), local, refusing))
    except (redis.RedisError, RedisClusterException) as exc:
        checks.append(Check(name, False, f"store read failed ({type(exc).__name__})"))
    finally:
        if store is not None:
            store.close()
    return Report(checks, warnings)


def _check_workers(beats: list[dict[str, Any]], local: bool, refusing: bool = False) -> Check:
    host = socket.gethostname()
    alive = [b for b in beats if not local or b.get("host") == host]
    where = f" on {host}" if local else ""
    if not alive:
        if refusing:
            # Heartbeats are writes too: their absence says nothing about the workers.
            return Check("worker", False, "not checked: the store refuses writes (heartbeats too)")
        return Check("worker", False, f"no worker heartbeat{where} (is a worker running?)")
    stuck = [f"{b.get('worker')} {why}" for b in alive if (why := _stalled(b)) is not None]
    if stuck:
        return Check("worker", False, "; ".join(stuck))
    names = ", ".join(str(b.get("worker")) for b in alive)
    return Check("worker", True, f"{len(alive)} alive{where} ({names})")


def _stalled(beat: dict[str, Any]) -> str | None:
    """Why a worker whose heartbeat runs is stuck: it holds messages and finishes none."""
    held = int(beat.get("held") or 0)
    since = float(beat.get("time") or 0) - float(beat.get("progress_at") or beat.get("time") or 0)
    if held and since > float(beat.get("stall_after") or 120.0):
        return (
            f"holds {held} message(s) but finished none in {since:.0f}s "
            "(stuck: restart it; its messages go back to the queue)"
        )
    return None


def _check_beat(settings: Settings, store: Any) -> Check:
    due = next_sweep(settings, store)
    if due is None:
        return Check("beat", False, "no sweep scheduled (is beat running?)")
    late = time.time() - due
    if late > BEAT_SLACK_SECONDS:
        return Check("beat", False, f"the sweep is {late:.0f}s overdue (is beat running?)")
    return Check("beat", True, f"next sweep in {max(0.0, -late):.0f}s")
