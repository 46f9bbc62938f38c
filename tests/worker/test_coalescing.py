"""When the worker's coalescer sends a group (worker/coalesce.py): at once on an idle worker.

The policy is checked on a stand-in consumer (an event loop whose turns the test runs, a pool
whose answers and a timer whose expiries the test gives); without a window unless a test
says so. The last tests prove it on real workers (the default: a 2 ms window).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from billiard.einfo import ExceptionInfo

from checkpointq.store.errors import StoreUnavailable
from checkpointq.tasks.messages import SAVE
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.pending import Settlement
from checkpointq.worker.coalesce import Coalescer, _Pending
from checkpointq.worker.group_events import GroupEvents
from checkpointq.worker.settings import Settings
from tests.faults.harness import children
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained
from tests.worker.conftest import Deployment


@dataclass
class Loop:
    """An event loop's ``call_soon``: callbacks wait for the test to end the turn."""

    soon: list[Callable[[], Any]] = field(default_factory=list)

    def call_soon(self, callback: Callable[[], Any]) -> None:
        self.soon.append(callback)

    def end_turn(self) -> None:
        due, self.soon = self.soon, []
        for callback in due:
            callback()


@dataclass
class Pool:
    """``num_processes`` processes; each job waits until the test answers it."""

    num_processes: int
    jobs: list[tuple[list[Any], Callable[[list[Any]], None]]] = field(default_factory=list)

    failures: dict[int, Callable[[Any], None]] = field(default_factory=dict)

    def apply_async(self, fn: Any, args: Any, callback: Any, error_callback: Any) -> None:
        self.failures[id(callback)] = error_callback
        self.jobs.append((args[0], callback))

    def fail(self, error: Any, index: int = 0) -> None:
        """The job raised: billiard hands its ``ExceptionInfo`` to the error callback."""
        _, callback = self.jobs.pop(index)
        self.failures.pop(id(callback))(error)

    def answer(self, index: int = 0) -> None:
        """The job applied every request of its group (each settled as request of session)."""
        requests, callback = self.jobs.pop(index)
        callback([Settlement("session", "request", 1)] * len(requests))

    def sizes(self) -> list[int]:
        return [len(requests) for requests, _ in self.jobs]


@dataclass
class Timer:
    """The consumer's timer: entries wait for the test to fire them."""

    entries: list[Callable[[], Any]] = field(default_factory=list)

    def call_after(self, seconds: float, callback: Callable[[], Any]) -> Callable[[], Any]:
        self.entries.append(callback)
        return callback

    def cancel(self, entry: Callable[[], Any]) -> None:
        self.entries.remove(entry)

    def fire(self) -> None:
        due, self.entries = self.entries, []
        for callback in due:
            callback()


@dataclass
class Rig:
    coalescer: Coalescer
    loop: Loop
    pool: Pool
    timer: Timer
    acked: list[str]
    on_ack: Callable[[], None] = lambda: None

    def deliver(self, *ids: str) -> None:
        """Messages the broker reader hands over within one turn of the loop."""
        for task_id in ids:
            message = SimpleNamespace(
                body=b"[]", channel=None, delivery_tag=task_id, headers={}, delivery_info={}
            )
            self.coalescer.add(
                _Pending(
                    message, _TASK, SAVE, task_id, self._ack(task_id), None, None, _no_fallback
                )
            )

    def turns(self, *ids: str) -> None:
        """Messages arriving one per turn of the loop."""
        for task_id in ids:
            self.deliver(task_id)
            self.loop.end_turn()

    def _ack(self, task_id: str) -> Callable[..., None]:
        def ack(*args: Any) -> None:
            self.on_ack()
            self.acked.append(task_id)

        return ack


_TASK = SimpleNamespace(name=SAVE, send_events=True)


def _no_fallback(*args: Any) -> None:
    raise AssertionError("an applied request must not run again as a task")


def _rig(*, processes: int = 2, max_items: int = 32, window: float = 0.0) -> Rig:
    loop, pool, timer, acked = Loop(), Pool(processes), Timer(), list[str]()
    consumer = SimpleNamespace(
        pool=pool,
        hub=loop,
        timer=timer,
        connection_errors=(),
        channel_errors=(),
        event_dispatcher=None,
    )
    # The clock stands still: a window passes only when the test fires the timer, however
    # long a loaded machine takes between two turns.
    coalescer = Coalescer(
        consumer, max_items, window, events=GroupEvents(consumer, app=None), clock=lambda: 0.0
    )
    return Rig(coalescer, loop, pool, timer, acked)


def test_messages_delivered_in_one_turn_go_as_one_group_when_the_turn_ends() -> None:
    # Given an idle pool
    rig = _rig()
    # When one read of the broker delivers three messages in the same turn of the loop
    rig.deliver("a", "b", "c")
    # Then nothing is sent before the turn ends, and all three go together then
    assert rig.pool.sizes() == []
    rig.loop.end_turn()
    assert rig.pool.sizes() == [3]


def test_a_lone_message_goes_at_the_end_of_its_turn_while_a_process_is_idle() -> None:
    # Given a pool with one process busy and one idle
    rig = _rig()
    rig.turns("first")
    # When a single message arrives
    rig.turns("lone")
    # Then it goes alone to the idle process, without waiting for company
    assert rig.pool.sizes() == [1, 1]


def test_while_every_process_is_busy_a_group_fills_and_goes_when_one_is_free() -> None:
    # Given both pool processes busy with a group each
    rig = _rig()
    rig.turns("a", "b")
    # When more messages arrive over several turns
    rig.turns("c", "d", "e")
    # Then they wait, together, until a process is free, and go at once then
    assert rig.pool.sizes() == [1, 1]
    rig.pool.answer(0)
    assert rig.acked == ["a"]
    assert rig.pool.sizes() == [1, 3]


def test_a_freed_process_gets_the_waiting_group_before_the_acks_are_written() -> None:
    # Given both pool processes busy and a group waiting for one
    rig = _rig()
    rig.turns("a", "b")
    rig.deliver("c", "d")
    rig.loop.end_turn()
    seen: list[list[int]] = []
    rig.on_ack = lambda: seen.append(rig.pool.sizes())
    # When the first group's answer comes back
    rig.pool.answer(0)
    # Then the waiting group was already in the pool when the answered one was acknowledged
    assert seen == [[1, 2]]
    assert rig.acked == ["a"]


def test_with_nothing_in_the_pool_a_lone_message_does_not_wait_for_the_window() -> None:
    # Given an idle worker with a window
    rig = _rig(window=0.002)
    # When a single message arrives
    rig.turns("lone")
    # Then it goes at the end of its turn, and no timer waits for company
    assert rig.pool.sizes() == [1]
    assert rig.timer.entries == []


def test_with_another_group_in_the_pool_an_idle_process_gets_a_group_after_the_window() -> None:
    # Given a window, and one pool process busy with a group
    rig = _rig(window=0.002)
    rig.turns("a")
    # When messages arrive over two turns
    rig.turns("b", "c")
    # Then they wait together for the window, and go to the idle process when it passes
    assert rig.pool.sizes() == [1]
    rig.timer.fire()
    assert rig.pool.sizes() == [1, 2]


def test_a_group_held_by_the_window_goes_at_once_when_the_pool_empties() -> None:
    # Given a group held by the window while another is in the pool
    rig = _rig(window=0.002)
    rig.turns("a", "b")
    # When the group in the pool answers
    rig.pool.answer(0)
    # Then the held group goes at once, and its timer is cancelled
    assert rig.pool.sizes() == [1]
    assert rig.timer.entries == []


def test_a_full_group_goes_at_once_even_while_every_process_is_busy() -> None:
    # Given a single pool process, busy
    rig = _rig(processes=1, max_items=3)
    rig.turns("a")
    # When a group's worth of messages arrives
    rig.deliver("b", "c", "d")
    # Then it is handed to the pool without waiting for the turn's end or the process
    assert rig.pool.sizes() == [1, 3]


def test_each_message_is_acknowledged_only_once_its_group_answered() -> None:
    # Given a group in the pool
    rig = _rig()
    rig.deliver("a", "b")
    rig.loop.end_turn()
    # Then nothing is acknowledged until the pool says the items are durable
    assert rig.acked == []
    rig.pool.answer()
    assert sorted(rig.acked) == ["a", "b"]


def test_a_group_the_pool_dropped_at_a_reconnect_holds_no_process_after_it() -> None:
    # Given both pool processes taken: one group running, one the pool has not started
    rig = _rig()
    rig.turns("a", "b")
    # When the consumer reconnects: Celery flushes the pool, which drops the group not
    # started without calling back
    rig.pool.jobs.pop(1)
    rig.coalescer.pool_flushed()
    # Then the next message goes at once, and the group sent before the flush, answering,
    # is acknowledged without freeing a process it no longer counted as holding
    rig.turns("c")
    rig.pool.answer(0)
    assert rig.acked == ["a"]
    rig.turns("d", "e")
    assert rig.pool.sizes() == [1, 1]
    rig.pool.answer(0)
    assert rig.pool.sizes() == [1, 1]


@pytest.mark.integration
def test_a_failed_group_is_logged_in_one_line_and_its_requests_run_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a group of two in the pool
    rig = _rig()
    alone: list[str] = []
    for task_id in ("a", "b"):
        message = SimpleNamespace(
            body=b"[]", channel=None, delivery_tag=task_id, headers={}, delivery_info={}
        )

        def fallback(message: Any, *args: Any) -> None:
            alone.append(message.delivery_tag)

        rig.coalescer.add(_Pending(message, _TASK, SAVE, task_id, None, None, None, fallback))
    rig.loop.end_turn()
    # When its job raises, and billiard hands over the error with its traceback
    try:
        raise StoreUnavailable("apply a batch of 2: Redis error (ConnectionError: refused)")
    except StoreUnavailable:
        error = ExceptionInfo()
    rig.pool.fail(error)
    # Then each request runs alone, and the warning names the error in one line
    assert alone == ["a", "b"]
    (warning,) = [r.getMessage() for r in caplog.records if "a group of" in r.getMessage()]
    assert warning == (
        "a group of 2 requests failed (apply a batch of 2: Redis error (ConnectionError: "
        "refused)): each runs alone"
    )


def test_a_lone_save_on_an_idle_worker_becomes_durable_and_acknowledged(live: Deployment) -> None:
    # Given an idle coalescing worker (the default: groups of up to 32)
    assert live.settings.coalescing
    live.wait_drained()
    with live.checkpoint_client() as client:
        # When a single save arrives, and nothing after it
        handle = client.save(make_checkpoint("lone-save", version=4))
        # Then it is applied without waiting for a group to fill, and its message acknowledged
        fence = client.wait_durable(handle, timeout=15)
        assert handle.seq is not None and fence.seq >= handle.seq
        live.wait_drained(timeout=15)
        loaded = client.load("lone-save")
        assert loaded is not None and loaded.version == 4


@pytest.mark.integration
def test_a_group_the_pool_dropped_at_a_reconnect_does_not_hold_back_later_saves(
    broker_server: RedisServer, store_server: RedisServer
) -> None:
    # Given a coalescing worker with one pool process, on a database of the broker of its own
    # (the module's worker reads database 0), the process stopped (alive, starting nothing)
    url = f"{broker_server.url.rsplit('/', 1)[0]}/5"
    values = {
        **TEST_WORKER_SETTINGS,
        "concurrency": 1,
        "broker_url": url,
        "store_url": store_server.url,
    }
    settings = Settings(**values)  # type: ignore[arg-type]
    assert settings.coalescing
    worker = CeleryProcess("worker", checkpointq_env(**values)).start()
    broker = redis.Redis.from_url(url)
    try:
        assert worker.process is not None
        (process,) = children(worker.process.pid)
        os.kill(process, signal.SIGSTOP)
        with CheckpointClient.from_settings(settings) as client:
            try:
                # and a save the worker took and handed to the pool as a group of one
                dropped = client.save(make_checkpoint("dropped-group", version=1))
                wait_until(
                    lambda: broker.llen(settings.queue) == 0 and broker.hlen("unacked") == 1,
                    timeout=15,
                    message="the worker to take the save",
                )
                # When its broker connections are cut: the consumer reconnects, and Celery
                # flushes the pool, dropping the group no process had started
                _kill_other_clients(broker)
                wait_until(
                    lambda: worker.log().count("Connected to redis") >= 2,
                    timeout=15,
                    message="the consumer to reconnect",
                )
            finally:
                os.kill(process, signal.SIGCONT)
            # Then the dropped save, back from the broker, is applied and acknowledged, and
            # a save sent afterwards is applied too: no group is held for a process that is
            # idle (they waited for the visibility timeout, an hour here)
            client.wait_durable(dropped, timeout=15)
            later = client.save(make_checkpoint("after-the-drop", version=1))
            client.wait_durable(later, timeout=15)
            wait_redis_queue_drained(
                lambda: redis.Redis.from_url(url), timeout=15, queue=settings.queue
            )
    finally:
        broker.close()
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


def _kill_other_clients(broker: redis.Redis) -> None:
    """``CLIENT KILL`` every connection to ``broker``'s database but its own."""
    database, own = broker.connection_pool.connection_kwargs.get("db", 0), broker.client_id()
    for client in broker.client_list():
        if int(client["db"]) == database and int(client["id"]) != own:
            broker.client_kill_filter(_id=client["id"])
