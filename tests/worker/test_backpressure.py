"""The store gate (worker/backpressure.py) on a real kombu consumer, and the queue reader's
put-back of an item whose dead letter cannot be written."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
from kombu import connection, entity, messaging

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.keys import KeySpace
from checkpointq.store.memory import InMemoryStore
from checkpointq.tasks import runtime
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.runtime import Runtime
from checkpointq.worker import backpressure
from checkpointq.worker.backpressure import StoreGate
from checkpointq.worker.hooks import kombu as kombu_hooks
from tests.support.servers import wait_until

# kombu's hints are partial (untyped functions): its classes are used as Any here.
Connection: Any = connection.Connection
Consumer: Any = messaging.Consumer
Producer: Any = messaging.Producer
Queue: Any = entity.Queue

OOM = "out of memory (maxmemory reached, eviction off): command not allowed"


@pytest.fixture
def kombu_consumer() -> Iterator[tuple[Any, Any, list[Any]]]:
    """A kombu consumer of queue "gate" on the in-memory transport, and what it received."""
    with Connection("memory://") as conn:
        channel = conn.channel()
        received: list[Any] = []
        queue = Queue("gate", channel=channel)
        queue.declare()
        consumer = Consumer(channel, queues=[queue], callbacks=[lambda b, m: received.append(b)])
        consumer.consume()
        yield conn, consumer, received
        consumer.cancel()
        channel.close()


def _publish(conn: Any, body: str) -> None:
    Producer(conn.default_channel).publish(body, routing_key="gate")


def _drain(conn: Any) -> None:
    with contextlib.suppress(TimeoutError):  # nothing (more) to deliver
        conn.drain_events(timeout=0.2)


def test_the_gate_stops_consuming_while_the_store_refuses_writes_and_resumes_after(
    kombu_consumer: tuple[Any, Any, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    conn, consumer, received = kombu_consumer
    answers = iter([OOM, OOM, None])
    gate = StoreGate(SimpleNamespace(task_consumer=consumer), lambda: next(answers))
    # When the probe is refused (twice), the queue is cancelled and a message waits
    gate.tick()
    gate.tick()
    assert gate.paused and gate.refusal == f"store refusing writes: {OOM}"
    assert not consumer.consuming_from("gate")
    _publish(conn, "waits")
    _drain(conn)
    assert received == []
    assert caplog.text.count("store refusing writes") == 1  # once per outage
    # When a probe is accepted, the queue is consumed again and the message delivered
    gate.tick()
    assert not gate.paused and consumer.consuming_from("gate")
    _drain(conn)
    assert received == ["waits"]
    assert "store accepts writes again" in caplog.text


def test_a_refusal_seen_elsewhere_trips_the_gate_at_once(
    kombu_consumer: tuple[Any, Any, list[Any]],
) -> None:
    _, consumer, _ = kombu_consumer
    gate = StoreGate(SimpleNamespace(task_consumer=consumer), lambda: None)
    gate.trip("record dead letter: Redis unavailable (ConnectionError)")
    assert gate.paused and not consumer.consuming_from("gate")
    gate.tick()  # the next probe is accepted
    assert consumer.consuming_from("gate")


def test_a_pause_outlives_a_consumer_restart_and_its_end_is_announced(
    kombu_consumer: tuple[Any, Any, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    # Given a gate paused by a refused broker write, which restarts the consumer: its steps
    # start again with a new task consumer and a new gate
    conn, first, _ = kombu_consumer
    earlier = StoreGate(SimpleNamespace(task_consumer=first), lambda: None)
    earlier.trip(OOM, backpressure.BROKER)
    channel = conn.channel()
    restarted = Consumer(channel, queues=[Queue("gate", channel=channel)])
    restarted.consume()
    answers = iter([OOM, None])
    gate = StoreGate(SimpleNamespace(task_consumer=restarted), lambda: None, lambda: next(answers))
    # When the new gate takes the pause over, the new consumer takes nothing
    gate.carry(earlier)
    assert gate.paused and not restarted.consuming_from("gate")
    # And while the broker still refuses, the pause goes on without a second announcement
    gate.tick()
    assert gate.paused and caplog.text.count("broker refusing writes") == 1
    # Then once the broker accepts writes, it consumes again and says so, once
    gate.tick()
    assert not gate.paused and restarted.consuming_from("gate")
    assert caplog.text.count("broker accepts writes again") == 1
    restarted.cancel()
    channel.close()


class _DownStream(fakeredis.FakeRedis):
    """A store Redis that cannot record dead letters."""

    def xadd(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("record dead letter: Redis unavailable (ConnectionError)")


def test_a_malformed_item_whose_dead_letter_cannot_be_written_goes_back_to_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a store that cannot take the dead letter, and a broker the reader popped from
    keys = KeySpace("unit")
    down = _DownStream()
    runtime.install(Runtime(InMemoryStore(), down, keys, DeadLetters(down, keys)))
    broker = fakeredis.FakeRedis()
    tripped: list[str] = []
    monkeypatch.setattr(backpressure, "trip", tripped.append)

    @contextlib.contextmanager
    def conn_or_acquire() -> Iterator[Any]:
        yield broker

    channel = SimpleNamespace(conn_or_acquire=conn_or_acquire)
    try:
        # When the reader refuses an item that is not a Celery message
        kombu_hooks._refuse(channel, b"checkpoints", b"not json", "checkpoints", ValueError("x"))
    finally:
        runtime.reset()
    # Then the item is back in the queue, and the worker pauses
    assert broker.lrange("checkpoints", 0, -1) == [b"not json"]
    assert tripped and "Redis unavailable" in tripped[0]


def test_a_trip_with_a_hold_keeps_the_gate_paused_though_the_probe_is_accepted(
    kombu_consumer: tuple[Any, Any, list[Any]],
) -> None:
    # Given a gate whose trips hold (a database: a full disk refuses the table's growth while
    # the probe's one row still fits)
    _, consumer, _ = kombu_consumer
    gate = StoreGate(SimpleNamespace(task_consumer=consumer), lambda: None, trip_hold=0.5)
    # When a write is refused, the probe that follows is accepted, yet the pause goes on
    gate.trip("disk full: could not extend file")
    gate.tick()
    assert gate.paused and gate.refusal == "store refusing writes: disk full: could not extend file"
    assert not consumer.consuming_from("gate")

    # Then a probe after the hold resumes it
    def resumed() -> bool:
        gate.tick()
        return not gate.paused

    started = time.monotonic()
    wait_until(resumed, timeout=5, message="the hold to end")
    assert time.monotonic() - started > 0.2
    assert consumer.consuming_from("gate")


def test_a_refusal_that_changes_kind_while_paused_is_announced(
    kombu_consumer: tuple[Any, Any, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    # Given a gate paused while the primary stops, then probing a standby (a failover)
    _, consumer, _ = kombu_consumer
    answers = iter(
        [
            "unreachable (OperationalError: connection refused)",
            "unreachable (OperationalError: connection refused, again)",
            "read-only (a standby, not the primary): cannot execute INSERT",
        ]
    )
    gate = StoreGate(SimpleNamespace(task_consumer=consumer), lambda: next(answers))
    gate.tick()
    gate.tick()
    assert "still refuses" not in caplog.text  # the same kind: no second line
    gate.tick()
    assert "store still refuses writes, now read-only (a standby" in caplog.text
    assert caplog.text.count("store refusing writes") == 1


class _SlowDatabase:
    """A store whose probe writes answer ``answer`` once ``release`` is set: a database
    whose pool (PgBouncer's) or disk keeps the probe waiting."""

    def __init__(self, answer: str | None = None) -> None:
        self.answer = answer
        self.release = threading.Event()
        self.probes = 0

    def write_refusal(self) -> str | None:
        self.probes += 1
        self.release.wait(30)
        return self.answer

    def close(self) -> None:
        self.release.set()


@pytest.fixture
def slow_database() -> Iterator[tuple[_SlowDatabase, backpressure._DatabaseProbe]]:
    store = _SlowDatabase()
    probe = backpressure._DatabaseProbe(store)
    yield store, probe
    probe.close()


def test_a_database_probe_that_answers_late_is_heard_and_no_refusal_meanwhile(
    slow_database: tuple[_SlowDatabase, backpressure._DatabaseProbe],
) -> None:
    store, probe = slow_database
    store.answer = "read-only (a standby, not the primary)"
    # Given a probe write the database keeps waiting, past the event loop's short wait
    started = time.monotonic()
    # Then the tick neither waits for it nor calls the wait a refusal
    assert probe() is None
    assert time.monotonic() - started < backpressure.PROBE_STALL_SECONDS / 2
    assert probe() is None and store.probes == 1  # (one probe at a time)
    # When it answers, the next tick hears what it said and starts the next probe
    store.release.set()
    wait_until(lambda: probe.running is not None and probe.running.done(), timeout=5)
    assert probe() == "read-only (a standby, not the primary)"
    wait_until(lambda: store.probes == 2, timeout=5)


def test_a_database_probe_unanswered_past_the_stall_is_a_refusal(
    slow_database: tuple[_SlowDatabase, backpressure._DatabaseProbe],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, probe = slow_database
    monkeypatch.setattr(backpressure, "PROBE_STALL_SECONDS", 0.3)
    # Given a probe write the database never answers
    assert probe() is None
    # Then once it has waited the stall, the gate hears "no answer", with how long
    wait_until(lambda: probe() is not None, timeout=5, message="the stall to be called")
    assert re.fullmatch(r"no answer in \d+s \(the probe write still waits\)", probe() or "")
    # and once it answers, its answer replaces it
    store.release.set()
    wait_until(lambda: probe() is None, timeout=5, message="the answer to be heard")
