"""Backpressure: while the store or the broker refuses writes, the worker takes no messages.

A request may leave the broker only once it is applied, superseded, or recorded where an
operator can replay it; during a store outage none of the three can happen, so the broker is
the one safe place for requests. Celery has no "pause" (celery/celery#1452), so ``StoreGate``
does what its ``cancel_consumer``/``add_consumer`` remote commands do, from the consumer's
event loop: every ``store_probe_seconds`` it writes a probe key (``checkpointq.store.probe``)
and cancels the task queues while the write is refused, adding them back once one is
accepted. The broker is probed the same way. A refusal seen elsewhere in the process (a dead
letter that could not be written: ``trip()``; a refused ack, reject or requeue:
``trip_broker()``) closes the gate at once; so does a database's refusal met by a coalesced
group's write (``worker/coalesce.py``: a full disk under the sessions table, no connection
slot left), and it holds the gate closed for a few probes, as the probe's own write on its
own connection may not meet it. Messages already held are retried (each retry waits in the
queue too); one whose retries run out meanwhile is requeued, never acknowledged.
docs/design.md has the whole behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from celery import Celery, bootsteps
from redis import exceptions as redis_errors

from checkpointq.store import probe
from checkpointq.worker import connections
from checkpointq.worker.ops import broker_probe
from checkpointq.worker.settings import Settings

logger = logging.getLogger(__name__)

#: Seconds a probe waits for the store to connect and answer: it runs in the event loop.
PROBE_TIMEOUT = 1.0

#: Seconds a database's probe write may wait unanswered before the gate calls the database
#: refusing: a probe queued behind other transactions (PgBouncer's pool, a slow commit) is
#: slow, not refused; one that waits this long finds a database that stopped answering.
PROBE_STALL_SECONDS = 10.0

#: Seconds the consumer's event loop waits for a database's fresh probe; a later answer is
#: heard at the next tick.
PROBE_PROMPT_SECONDS = 0.1

#: Probe intervals a refusal seen by a write holds the gate paused (``StoreGate.trip_hold``).
TRIP_HOLD_PROBES = 5

Probe = Callable[[], "str | None"]

#: The sides a gate probes, as its log lines and ``checkpointq health`` name them.
STORE, BROKER = "store", "broker"


class StoreGate:
    """Cancels the task consumer's queues while the store or the broker refuses writes;
    adds them back once both accept them."""

    def __init__(
        self,
        consumer: Any,
        probe_write: Probe,
        probe_broker: Probe | None = None,
        *,
        trip_hold: float = 0.0,
    ) -> None:
        self.consumer = consumer
        self.probes: dict[str, Probe] = {STORE: probe_write}
        if probe_broker is not None:
            self.probes[BROKER] = probe_broker
        #: Why each refusing side refuses writes, while paused; empty while consuming.
        self.refusals: dict[str, str] = {}
        #: Seconds a ``trip()`` keeps its side refusing whatever the probes answer: for
        #: refusals a probe's own write may not meet (a full disk under the sessions table
        #: while the probe's row still fits; no connection slot left while the probe holds
        #: one). Once it lapses, the next refused write trips the gate again.
        self.trip_hold = trip_hold
        self._trips: dict[str, tuple[float, str]] = {}
        self._paused_at = 0.0
        self._queues: list[Any] = []

    @property
    def paused(self) -> bool:
        return bool(self.refusals)

    @property
    def refusal(self) -> str | None:
        """Why the worker is paused ("broker refusing writes: ..."), or None."""
        if not self.refusals:
            return None
        return "; ".join(f"{side} refusing writes: {why}" for side, why in self.refusals.items())

    def tick(self) -> None:
        """Probe each side, then pause or resume accordingly (the consumer's timer)."""
        refusals = {
            side: why for side, probe_write in self.probes.items() if (why := probe_write())
        }
        now = time.monotonic()
        for side, (at, why) in list(self._trips.items()):
            if now - at >= self.trip_hold:
                del self._trips[side]
            else:
                refusals.setdefault(side, why)
        if refusals:
            for side, why in refusals.items():
                self._pause(side, why)
            for side in set(self.refusals) - set(refusals):
                del self.refusals[side]
        else:
            self._resume()

    def trip(self, why: str, side: str = STORE) -> None:
        """Pause now: this process just saw ``side`` refuse a write."""
        if self.trip_hold > 0:
            self._trips[side] = (time.monotonic(), why)
        self._pause(side, why)

    def carry(self, earlier: StoreGate) -> None:
        """Hold the pause of ``earlier``, the gate of this consumer before it restarted (a
        refused broker write restarts it): its refusals were announced, and the tick that
        finds them over says so, with the pause's whole length."""
        if earlier.refusals:
            self._stop_taking()
            self.refusals = dict(earlier.refusals)
            self._paused_at = earlier._paused_at
        self._trips = dict(earlier._trips)

    def _stop_taking(self) -> None:
        task_consumer = self.consumer.task_consumer
        self._queues = list(task_consumer.queues)
        for queue in self._queues:
            task_consumer.cancel_by_queue(queue.name)
        self._paused_at = time.monotonic()

    def _pause(self, side: str, refusal: str) -> None:
        if not self.refusals:
            self._stop_taking()
        if side not in self.refusals:
            logger.warning(
                "%s refusing writes (%s): stopped taking messages from %s until it "
                "accepts one (probed every few seconds)",
                side,
                refusal,
                ", ".join(q.name for q in self._queues),
            )
        elif _kind(refusal) != _kind(self.refusals[side]):
            # (a failover: unreachable while the primary stops, then read-only)
            logger.warning("%s still refuses writes, now %s", side, refusal)
        self.refusals[side] = refusal

    def _resume(self) -> None:
        if not self.refusals:
            return
        task_consumer = self.consumer.task_consumer
        for queue in self._queues:
            if not task_consumer.consuming_from(queue.name):
                task_consumer.add_queue(queue)
        task_consumer.consume()
        paused = time.monotonic() - self._paused_at
        sides = sorted(self.refusals)
        logger.warning(
            "%s again after %.1fs: taking messages from %s again",
            f"{sides[0]} accepts writes"
            if len(sides) == 1
            else f"{' and '.join(sides)} accept writes",
            paused,
            ", ".join(q.name for q in self._queues),
        )
        self.refusals, self._queues = {}, []


def _kind(refusal: str) -> str:
    """The words a refusal starts with ("read-only", "unreachable", "disk full"), without
    the server's own message."""
    return re.split(r"[:(]", refusal, maxsplit=1)[0].strip()


class _StoreProbe:
    """The worker's own write probe: a client with a short timeout, made on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.key = connections.key_space(settings).write_probe()
        self.client: Any = None

    def __call__(self) -> str | None:
        if self.client is None:
            try:  # a cluster client connects as it is built
                self.client = connections.store_client(self.settings, timeout=PROBE_TIMEOUT)
            except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
                return probe.describe(exc)
        return probe.write_refusal(self.client, self.key)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


class _DatabaseProbe:
    """The write probe of a PostgreSQL store (``PostgresStore.write_refusal``): run on a
    thread of its own, so that a database that stops answering mid-query (no client-side
    timeout can end a psycopg call) never holds the consumer's event loop.

    A slow answer is no refusal: behind PgBouncer a probe queues for a server connection
    behind the groups' transactions, and a busy disk holds a commit; pausing then would
    stall every session when the database is busiest. The gate hears the last probe that
    answered, and "no answer" only once one has waited ``PROBE_STALL_SECONDS``."""

    def __init__(self, store: Any) -> None:
        #: A store with ``write_refusal()`` and ``close()`` (``PostgresStore``).
        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpointq-probe")
        self.running: Future[str | None] | None = None
        self.started = 0.0
        #: What the last probe to answer said.
        self.answer: str | None = None

    def __call__(self) -> str | None:
        running = self.running
        if running is not None and not running.done():
            waited = time.monotonic() - self.started
            if waited >= PROBE_STALL_SECONDS:
                return f"no answer in {waited:.0f}s (the probe write still waits)"
            return self.answer
        if running is not None:
            self.answer = running.result()
        self.running = self.pool.submit(self.store.write_refusal)
        self.started = time.monotonic()
        with contextlib.suppress(FutureTimeout):  # a database that answers at once is heard
            self.answer = self.running.result(timeout=PROBE_PROMPT_SECONDS)
        return self.answer

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


class _BrokerProbe:
    """The worker's write probe of its broker: ``broker_probe``'s, made on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.key = connections.key_space(settings).write_probe()
        self.probe: broker_probe.BrokerProbe | None = None

    def __call__(self) -> str | None:
        if self.probe is None:
            self.probe = broker_probe.open_probe(self.settings, timeout=PROBE_TIMEOUT)
        return self.probe.write_refusal(self.key)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None


#: The gate of this process's consumer, for ``trip()`` (one consumer per worker process).
_current: StoreGate | None = None


def trip(why: str) -> None:
    """Tell this process's gate, if any, that the store just refused a write."""
    if _current is not None:
        _current.trip(why)


def trip_broker(why: str) -> None:
    """Tell this process's gate, if any, that the broker just refused a write."""
    if _current is not None:
        _current.trip(why, BROKER)


def current() -> StoreGate | None:
    return _current


def install(app: Celery, settings: Settings) -> None:
    """Make ``app``'s workers pause consuming while the store refuses writes."""

    class StoreGateStep(bootsteps.StartStopStep):  # type: ignore[misc]  # no celery hints
        """The gate on the consumer's timer, from when the task consumer exists."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            self._probe: _StoreProbe | _DatabaseProbe | None = None
            self._broker: _BrokerProbe | None = None
            self._tref: Any = None
            #: The gate of the consumer's last start, kept through a restart.
            self._gate: StoreGate | None = None

        def start(self, consumer: Any) -> None:
            global _current
            resolved = connections.resolve(settings)
            self._probe = (
                _DatabaseProbe(connections.open_store(resolved))
                if resolved.store_is_postgres
                else _StoreProbe(resolved)
            )
            self._broker = _BrokerProbe(resolved)
            # A database's refusals reach the gate from the writes too (worker/coalesce.py):
            # those hold it paused for a few probes, as its probe may not meet them.
            hold = TRIP_HOLD_PROBES * settings.store_probe_seconds
            gate = StoreGate(
                consumer,
                self._probe,
                self._broker,
                trip_hold=hold if resolved.store_is_postgres else 0.0,
            )
            if self._gate is not None:
                gate.carry(self._gate)
            self._gate = _current = gate
            gate.tick()
            self._tref = consumer.timer.call_repeatedly(settings.store_probe_seconds, gate.tick)

        def stop(self, consumer: Any) -> None:
            global _current
            if self._tref is not None:
                consumer.timer.cancel(self._tref)
                self._tref = None
            _current = None
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            if self._broker is not None:
                self._broker.close()
                self._broker = None

        shutdown = stop

    app.steps["consumer"].add(StoreGateStep)
