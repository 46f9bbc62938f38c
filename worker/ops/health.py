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
from checkpointq.store.base import CheckpointStore, new_identity
from checkpointq.store.errors import CheckpointError
from checkpointq.store.factory import store_from_settings
from checkpointq.store.keys import KeySpace
from checkpointq.store.urls import is_redis_url, redact_url, redis_py_url
from checkpointq.tasks import brokers, held_rows, store_identity
from checkpointq.tasks.errors import BrokerUnavailable, StoreMismatch
from checkpointq.tasks.producer.broker_durability import BrokerDurability
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.pending import EpochWatch, ring_field, ring_token
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
        broker: Any = None,
        broker_keys: KeySpace | None = None,
        announce: StoreAnnouncement | None = None,
    ):
        self.client = client
        #: The broker Redis (None: another broker), read each beat for its pending epoch and
        #: mark: a worker notices a broker that went back in time too (issue 44).
        self.broker = broker
        self.broker_keys = broker_keys or keys
        self.epochs = EpochWatch()
        self.announce = announce
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
        value["broker_losses"] = self.epochs.changes
        return value

    def watch_broker(self) -> None:
        """Read the broker's pending epoch and mark: a loss is counted and logged (ERROR,
        ``EpochWatch``) and goes into the heartbeat (``broker_losses``)."""
        if self.broker is None:
            return
        floor = self.epochs.floor()
        mark_key = self.broker_keys.pending_mark()
        try:
            pipe = self.broker.pipeline(transaction=False)
            pipe.get(self.broker_keys.pending_epoch())
            pipe.hget(mark_key, "n")
            pipe.hget(mark_key, ring_field(floor.mark))
            epoch, mark, held = pipe.execute()
            # The new mark's token, for the next beat to judge it by (publish.lua's ring).
            token = (
                ""
                if mark is None
                else ring_token(self.broker.hget(mark_key, ring_field(int(mark))), int(mark))
            )
        except redis.RedisError:
            return  # the broker's own check says so
        # The mark seen last beat, held by another publish: the broker lost it and gave it
        # again (a loss, even when the counter is back above it).
        seen = ring_token(held, floor.mark)
        forked = floor if floor.token and seen and seen != floor.token else None
        self.epochs.observe(
            epoch, None if mark is None else int(mark), below=floor.mark, token=token, forked=forked
        )

    def beat(self) -> None:
        self.watch_broker()
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
        if self.announce is not None:
            self.announce.send(self.worker, int(self.interval * HEARTBEAT_LIVES * 1000))

    def clear(self) -> None:
        """Remove the heartbeat at a clean stop, so nobody mistakes us for running."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.keys.heartbeat(self.worker))
            pipe.srem(self.keys.workers(), self.worker)
            pipe.execute()
        except redis.RedisError as exc:
            logger.info("heartbeat not cleared (it expires by itself): %s", exc)


class StoreAnnouncement:
    """Publishes the identity of the store this worker writes to on its Redis broker, with
    each heartbeat, for producers to compare with theirs (``tasks.store_identity``).

    The heartbeat runs on the consumer's timer, in the main process: the store is read
    only every ``READ_EVERY`` beats (a store emptied since has a new identity, found within
    that), each wait bounded at a second, and a store that does not answer is left alone
    until then; the last identity read is announced meanwhile."""

    #: Heartbeats between two reads of the store's identity.
    READ_EVERY = 6

    def __init__(self, broker: Any, keys: KeySpace, settings: Settings) -> None:
        self.broker = broker
        self.keys = keys
        self.settings = settings
        self._store: CheckpointStore | None = None
        self._identity: str | None = None
        self._read_at = 0.0
        self._beats = 0
        self._failing = False

    @classmethod
    def for_settings(cls, settings: Settings) -> StoreAnnouncement | None:
        """None on a broker that is not a plain Redis (no producer reads records there)."""
        url = settings.broker_url
        if not url or brokers.broker_kind(url) is not brokers.BrokerKind.REDIS:
            return None
        broker = redis.Redis.from_url(
            redis_py_url(url), socket_timeout=1.0, socket_connect_timeout=1.0
        )
        return cls(broker, KeySpace(settings.key_prefix), settings)

    def send(self, worker: str, ttl_ms: int) -> None:
        """Read the store's identity when due (made if the store has none) and publish the
        last one read."""
        due, self._beats = self._beats % self.READ_EVERY == 0, self._beats + 1
        try:
            if self._store is None:
                # The broker's Redis gets an identity too: a producer that takes it for the
                # store (what a shell that only knows the broker does) differs at once. Dated
                # past the clock margin: it precedes every announcement of this worker.
                before = 2 * store_identity.CLOCK_MARGIN_SECONDS
                self.broker.set(self.keys.identity(), new_identity(before), nx=True)
                self._store = store_from_settings(self.settings, socket_timeout=1.0)
            if due or (self._identity is None and not self._failing):
                self._identity, self._read_at = self._store.identity(), time.time()
            if self._identity is not None:
                command = store_identity.publish_command(
                    self.keys, self._identity, repr(self._store), worker, self._read_at, ttl_ms
                )
                self.broker.execute_command(*command)
        except Exception as exc:  # never the heartbeat's (or the consumer's) end
            if not self._failing:
                logger.warning("the store's identity was not published on the broker: %s", exc)
            self._failing = True
        else:
            self._failing = False

    def close(self) -> None:
        self.broker.close()
        if self._store is not None:
            self._store.close()


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
            broker = None
            if resolved.broker_url and is_redis_url(resolved.broker_url):
                broker = redis.Redis.from_url(
                    redis_py_url(resolved.broker_url),
                    socket_timeout=1.0,
                    socket_connect_timeout=1.0,
                )
            heart = Heartbeat(
                client,
                connections.key_space(resolved),
                consumer.hostname,
                interval=settings.heartbeat_seconds,
                queue=settings.queue,
                held=lambda: held_messages(consumer),
                stall_after=stall_seconds(settings),
                broker=broker,
                broker_keys=KeySpace(settings.key_prefix),
                announce=StoreAnnouncement.for_settings(resolved),
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
                if self._heart.broker is not None:
                    self._heart.broker.close()
                if self._heart.announce is not None:
                    self._heart.announce.close()
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
    #: What the broker lost of the requests it accepted, as producers found it
    #: (``broker_losses``); None when it lost nothing they noticed.
    broker_losses: BrokerLosses | None = None

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in self.checks},
            "warnings": [warning.as_json() for warning in self.warnings],
            "broker_losses": None if self.broker_losses is None else self.broker_losses.as_json(),
        }

    def warning_lines(self) -> list[str]:
        lines = [f"warning: {warning.line()}" for warning in self.warnings]
        if self.broker_losses is not None:
            lines.append(f"warning: {self.broker_losses.line()}")
        return lines

    def line(self) -> str:
        """One line: the failures if any, else what passed."""
        shown = [c for c in self.checks if not c.ok] or self.checks
        status = "healthy" if self.ok else "unhealthy"
        return f"{status}: " + "; ".join(f"{c.name}: {c.detail}" for c in shown)


@dataclass(frozen=True, slots=True)
class BrokerLosses:
    """The broker went back in time (a crash inside its fsync window, a failover to a
    lagging replica): producers found its pending mark below one they had seen, and
    publish.lua recorded it in the mark (``KeySpace.pending_mark``). A warning, never a
    failed check: a restart brings nothing back, and the producers republished what they
    still held (docs/reliability.md)."""

    count: int
    #: When the last one was found (seconds since the epoch).
    at: float
    #: The mark a producer had seen, and the mark the broker went back to (-1: unknown, the
    #: loss found by the mark's token after later publishes took the lost marks again).
    seen: int
    back_to: int

    def line(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))
        how = (
            f"it went back below mark {self.seen}, which later publishes took again"
            if self.back_to < 0
            else f"it went back {self.seen - self.back_to} publish(es), from mark {self.seen}"
            f" to {self.back_to}"
        )
        return (
            f"the broker lost accepted requests {self.count} time(s), the last found at {when}"
            f" ({how}: a crash inside its fsync window or a failover to a lagging"
            " replica); producers republished what they still held; see docs/reliability.md"
        )

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "at": self.at, "seen": self.seen, "back_to": self.back_to}


def broker_losses(client: Any, keys: KeySpace) -> BrokerLosses | None:
    """The losses recorded in the broker's pending mark (None: none, or unreadable)."""
    try:
        fields = client.hmget(keys.pending_mark(), "losses", "lost_at", "lost_seen", "lost_mark")
    except redis.RedisError:
        return None
    if not fields[0]:
        return None
    count, at, seen, back_to = (int(f or 0) for f in fields)
    return BrokerLosses(count, at / 1000, seen, back_to)


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


def broker_durability(settings: Settings, client: Any) -> Check:
    """Which broker durability this deployment's producers use
    (``CHECKPOINTQ_BROKER_DURABILITY``); with ``replicated``, whether the broker has as many
    replicas connected and streaming as each save waits for (INFO replication): with fewer,
    every save and delete waits out its timeout and raises ``ReplicationTimeout``."""
    durability = BrokerDurability.from_settings(settings)
    if not durability.is_replicated:
        return Check("broker durability", True, durability.describe())
    try:
        connected = online_replicas(client.info("replication"))
    except redis.RedisError as exc:
        return Check("broker durability", False, f"replicated: INFO failed ({exc})")
    needed = durability.replicas
    if connected >= needed:
        return Check(
            "broker durability",
            True,
            f"replicated ({connected} of {needed} replica(s) connected; a save waits at most "
            f"{durability.timeout_ms} ms for them)",
        )
    return Check(
        "broker durability",
        False,
        f"replicated needs {needed} replica(s), the broker has {connected} connected: every "
        f"save and delete waits {durability.timeout_ms} ms and raises ReplicationTimeout "
        "(queued on the primary all the same); reconnect a replica, or lower "
        "CHECKPOINTQ_BROKER_REPLICAS",
    )


def online_replicas(info: dict[str, Any]) -> int:
    """The replicas INFO replication shows connected and streaming (``state=online``)."""
    count = 0
    for name, value in info.items():
        if name.startswith("slave") and name[5:].isdigit():
            state = value.get("state") if isinstance(value, dict) else None
            count += state == "online"
    return count


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
        losses, replication = None, None
        if answered and probe.redis_client is not None:
            losses = broker_losses(probe.redis_client, connections.key_space(settings))
            # The deployment's check, not a process's probe: a worker or beat restarted
            # for a missing broker replica would gain nothing.
            if not (local or beat):
                replication = broker_durability(settings, probe.redis_client)
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
            held = [row.line(time.time()) for row in held_rows.read(store, keys)]
            checks.append(_check_workers(live_workers(store, keys), local, refusing, held))
    except (redis.RedisError, RedisClusterException) as exc:
        checks.append(Check(name, False, f"store read failed ({type(exc).__name__})"))
    finally:
        if store is not None:
            store.close()
    if not beat and answered and store_check.ok:
        identity = _check_one_store(settings)
        if identity is not None:
            checks.append(identity)
    if replication is not None:
        checks.append(replication)
    return Report(checks, warnings, losses)


def _check_one_store(settings: Settings) -> Check | None:
    """Whether this configuration's store is the one the broker's workers write to, as a
    producer compares them (``tasks.store_identity``); None where there is nothing to
    compare (a broker other than a plain Redis)."""
    url = settings.broker_url
    if not url or brokers.broker_kind(url) is not brokers.BrokerKind.REDIS:
        return None
    try:
        with CheckpointClient.from_settings(settings) as client:
            client.check_store()
            agreed = client.store_check.agreed
    except StoreMismatch as exc:
        return Check("one store", False, str(exc))
    except CheckpointError as exc:
        return Check("one store", False, f"not compared: {exc}")
    if agreed:
        return Check("one store", True, "the workers write to this store")
    return Check("one store", True, "no worker has said which store it writes to yet")


def _check_workers(
    beats: list[dict[str, Any]],
    local: bool,
    refusing: bool = False,
    held: list[str] | None = None,
) -> Check:
    """The workers' check. ``held``: sessions waiting on a row another client holds
    (``tasks/held_rows.py``): named, and never called the worker's fault."""
    held = held or []
    host = socket.gethostname()
    alive = [b for b in beats if not local or b.get("host") == host]
    where = f" on {host}" if local else ""
    if not alive:
        if refusing:
            # Heartbeats are writes too: their absence says nothing about the workers.
            return Check("worker", False, "not checked: the store refuses writes (heartbeats too)")
        return Check("worker", False, f"no worker heartbeat{where} (is a worker running?)")
    stuck = [
        f"{b.get('worker')} {why}" for b in alive if (why := _stalled(b, bool(held))) is not None
    ]
    if stuck and not held:
        return Check("worker", False, "; ".join(stuck))
    names = ", ".join(str(b.get("worker")) for b in alive)
    return Check("worker", True, "; ".join([f"{len(alive)} alive{where} ({names})", *stuck, *held]))


def _stalled(beat: dict[str, Any], rows_held: bool = False) -> str | None:
    """Why a worker whose heartbeat runs is stuck: it holds messages and finishes none. While
    sessions wait on rows another client holds, that is what it waits for, not a fault of
    its own (``rows_held``)."""
    held = int(beat.get("held") or 0)
    since = float(beat.get("time") or 0) - float(beat.get("progress_at") or beat.get("time") or 0)
    if held and since > float(beat.get("stall_after") or 120.0):
        why = (
            "waiting for the held rows below"
            if rows_held
            else "stuck: restart it; its messages go back to the queue"
        )
        return f"holds {held} message(s) but finished none in {since:.0f}s ({why})"
    return None


def _check_beat(settings: Settings, store: Any) -> Check:
    due = next_sweep(settings, store)
    if due is None:
        return Check("beat", False, "no sweep scheduled (is beat running?)")
    late = time.time() - due
    if late > BEAT_SLACK_SECONDS:
        return Check("beat", False, f"the sweep is {late:.0f}s overdue (is beat running?)")
    return Check("beat", True, f"next sweep in {max(0.0, -late):.0f}s")
