"""Task policy without processes: InMemoryStore, fakeredis, tasks applied in-process."""

from __future__ import annotations

import pickle
import random
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, NoReturn

import fakeredis
import pytest
from billiard.einfo import ExceptionInfo
from celery import Celery, Task
from celery.app.task import Context
from celery.app.trace import build_tracer
from celery.exceptions import Reject, Retry
from redis.exceptions import OutOfMemoryError

from checkpointq.store.base import Fence, SaveResult
from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.keys import KeySpace
from checkpointq.store.memory import InMemoryStore
from checkpointq.store.model import Checkpoint
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks import checkpoints, messages, runtime
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.policy import RetryPolicy
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.runtime import Runtime
from checkpointq.tasks.sweep import sweep
from checkpointq.worker.app import celery_config
from checkpointq.worker.settings import Settings
from tests.support.checkpoints import make_checkpoint, secret_checkpoint


class DownStore(InMemoryStore):
    """A store whose Redis is unreachable for every write."""

    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
        raise StoreUnavailable("save: Redis unavailable (ConnectionError)")

    def fence(self, session_id: str) -> Fence | None:
        raise StoreUnavailable("fence: Redis unavailable")


@pytest.fixture
def redis() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def install(store: InMemoryStore, redis: fakeredis.FakeRedis, retries: int = 2) -> Runtime:
    keys = KeySpace("unit")
    rt = Runtime(
        store=store,
        redis=redis,
        keys=keys,
        dead_letters=DeadLetters(redis, keys, maxlen=1000),
        retry=RetryPolicy(max_retries=retries, base_seconds=0.001, max_seconds=0.002),
        max_message_bytes=64 * 1024,
    )
    runtime.install(rt)
    return rt


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("unit", set_as_current=False)
    checkpoints.register(app)
    yield app
    runtime.reset()


def apply(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
    return app.tasks[name].apply(args=args, kwargs=kwargs).result


def test_save_reports_applied_then_stale_for_an_older_seq(
    app: Celery, redis: fakeredis.FakeRedis
) -> None:
    install(InMemoryStore(), redis)
    wire = checkpoint_to_wire(make_checkpoint("s"))
    assert apply(app, messages.SAVE, wire, seq=5)["outcome"] == "applied"
    assert apply(app, messages.SAVE, wire, seq=4)["outcome"] == "superseded"
    assert apply(app, messages.DELETE, "s", seq=6)["outcome"] == "deleted"
    assert apply(app, messages.REFRESH, "s")["outcome"] == "absent"


def test_invalid_input_is_dead_lettered_without_retry(
    app: Celery, redis: fakeredis.FakeRedis
) -> None:
    rt = install(InMemoryStore(), redis)
    outcome = apply(app, messages.DELETE, "ok", seq=True)
    assert outcome["outcome"] == "dead_lettered" and outcome["kind"] == "invalid_input"
    (letter,) = rt.dead_letters.list().entries
    assert letter.task == messages.DELETE and letter.args == ["ok"]
    assert letter.kwargs == {"seq": True} and letter.retries == 0 and letter.replayable


@pytest.mark.parametrize("task", [messages.SAVE, messages.DELETE])
def test_a_seq_far_ahead_of_the_worker_clock_is_dead_lettered_with_the_reason(
    app: Celery, redis: fakeredis.FakeRedis, task: str
) -> None:
    # Given a session applied at the worker's own time
    rt = install(InMemoryStore(), redis)
    now = time.time_ns() // 1000
    wire = checkpoint_to_wire(make_checkpoint("s", version=1))
    assert apply(app, messages.SAVE, wire, seq=now)["outcome"] == "applied"
    first = wire if task == messages.SAVE else "s"
    # When a producer whose clock is an hour ahead sends a request, and one a minute ahead
    ahead = apply(app, task, first, seq=now + 3600 * 1_000_000)
    near = apply(
        app,
        messages.SAVE,
        checkpoint_to_wire(make_checkpoint("s", version=2)),
        seq=now + 60 * 1_000_000,
    )
    # Then the hour-ahead request is dead-lettered with the reason, and does not fence out
    # the next correct request, which applies (a minute is within the default tolerance)
    assert ahead["outcome"] == "dead_lettered" and ahead["kind"] == "invalid_input"
    (letter,) = rt.dead_letters.list().entries
    assert "ahead of this worker's clock" in letter.reason and letter.replayable
    assert near["outcome"] == "applied"
    loaded = rt.store.load("s")
    assert loaded is not None and loaded.version == 2


def test_a_request_failing_while_the_store_takes_writes_is_dead_lettered_after_retries(
    app: Celery, redis: fakeredis.FakeRedis
) -> None:
    # Given a store that accepts writes (its probe) but fails this request every time
    rt = install(DownStore(), redis, retries=2)
    wire = checkpoint_to_wire(make_checkpoint("down"))
    # When the request has spent its retries (and the one last attempt after the probe)
    app.tasks[messages.SAVE].apply(args=[wire], kwargs={"seq": 1})
    # Then it is dead-lettered, saying the store took other writes meanwhile
    (letter,) = rt.dead_letters.list().entries
    assert letter.kind == "retries_exhausted" and letter.retries == 2
    assert "while the store accepts other writes" in letter.reason
    assert letter.args == [wire] and letter.kwargs == {"seq": 1}


class RefusingStore(DownStore):
    """A store that refuses every write, its probe included (down, out of memory)."""

    def write_refusal(self) -> str | None:
        return "out of memory (maxmemory reached, eviction off): OOM command not allowed"


def test_retries_spent_while_the_store_refuses_writes_requeue_the_message(
    app: Celery, redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a store that refuses every write
    rt = install(RefusingStore(), redis, retries=2)
    wire = checkpoint_to_wire(make_checkpoint("oom"))
    # When a save spends its retries
    result = app.tasks[messages.SAVE].apply(args=[wire], kwargs={"seq": 1})
    # Then the message is rejected with requeue (back to the broker, never acknowledged),
    # and nothing is dead-lettered: the outage is no fault of the request
    assert isinstance(result.result, Reject) and result.result.requeue
    assert rt.dead_letters.count() == 0
    assert "the store refuses writes: out of memory" in caplog.text


def test_a_retry_the_broker_refuses_to_publish_goes_back_to_the_queue(
    app: Celery,
    redis: fakeredis.FakeRedis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a store that is down, and a broker that refuses the retry's publish: Celery's
    # Task.retry then raises Reject *without* requeue, which would drop the message
    install(DownStore(), redis, retries=2)
    task = app.tasks[messages.SAVE]

    def unpublished(*args: Any, **kwargs: Any) -> NoReturn:
        raise Reject(OutOfMemoryError("command not allowed"), requeue=False)

    monkeypatch.setattr(task, "retry", unpublished)
    wire = checkpoint_to_wire(make_checkpoint("oom-broker"))
    # When the save fails and its retry cannot be published
    result = task.apply(args=[wire], kwargs={"seq": 1})
    # Then the message is given back (rejected with requeue), never dropped
    assert isinstance(result.result, Reject) and result.result.requeue
    assert "its retry could not be published" in caplog.text


def pool_result(app: Celery, task: Task, args: list[Any], retries: int) -> ExceptionInfo:
    """What a pool process hands the main process for ``task`` run as the pool runs it
    (Celery's tracer, not eager): for a rejected task, an ``ExceptionInfo``."""
    tracer = build_tracer(task.name, task, eager=False, propagate=False, app=app)
    request = {"id": "request-1", "retries": retries, "delivery_info": {}, "headers": {}}
    result = tracer("request-1", args, {"seq": 1}, request).retval
    assert isinstance(result, ExceptionInfo)
    return result


def rejects(seq: int) -> NoReturn:
    """A task body that only gives its message back."""
    raise Reject("r", requeue=True)


def celerys_own_reject(app: Celery) -> bytes:
    """The least a requeue can pipe: the pickled result of a task body that only raises
    ``Reject`` (Celery's tracer frame holds most of it)."""
    task = app.task(name="unit.rejects")(rejects)
    return pickle.dumps(pool_result(app, task, [], retries=0))


@pytest.mark.parametrize("path", ["store_refuses_writes", "retry_not_published"])
def test_a_requeued_save_pipes_a_small_result_without_its_checkpoint(
    app: Celery,
    redis: fakeredis.FakeRedis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    # Given a save whose every message holds a marker, and a store that refuses it: with
    # its retries spent while the store refuses writes, or its retry refused by the broker
    secret = "MARKER-of-a-conversation"
    wire = checkpoint_to_wire(secret_checkpoint("oom", secret))
    task = app.tasks[messages.SAVE]
    if path == "store_refuses_writes":
        install(RefusingStore(), redis, retries=2)
        retries = 2
    else:
        install(DownStore(), redis, retries=2)
        retries = 0

        def unpublished(*args: Any, **kwargs: Any) -> NoReturn:
            raise Reject(OutOfMemoryError("command not allowed"), requeue=False)

        monkeypatch.setattr(task, "retry", unpublished)
    # When the pool process runs it and the message goes back to the queue
    result = pool_result(app, task, [wire], retries)
    piped = pickle.dumps(result)
    # Then the main process gets Reject(requeue=True) with its reason ...
    rejected = result.exception.exc
    assert isinstance(rejected, Reject) and rejected.requeue
    assert "could not be published" in rejected.reason or "refuses writes" in rejected.reason
    # ... in a result hardly larger than Celery's own least (no errors chained to it, no
    # frames of ours below the task's call), and neither it nor the log holds the marker
    assert "During handling" not in result.traceback
    assert "direct cause" not in result.traceback
    assert len(piped) <= len(celerys_own_reject(app)) + 6 * 1024, len(piped)
    assert secret.encode() not in piped
    assert secret not in caplog.text and "request-1" in caplog.text


def test_a_retried_save_pipes_a_small_result_that_keeps_its_cause(
    app: Celery, redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a save whose every message holds a marker, a store that is down, and a broker
    # that takes the retry
    app.conf.broker_url = "memory://"
    install(DownStore(), redis, retries=2)
    secret = "MARKER-of-a-conversation"
    wire = checkpoint_to_wire(secret_checkpoint("down", secret))
    # When the pool process runs it and schedules the next attempt
    result = pool_result(app, app.tasks[messages.SAVE], [wire], retries=0)
    piped = pickle.dumps(result)
    # Then the main process gets Celery's Retry for the store's error, whose text (with the
    # error it retries, for Celery's task-retried event) is all it carries beyond Celery's
    # own least, and neither it nor the log holds the marker
    retry = result.exception.exc
    assert isinstance(retry, Retry) and isinstance(retry.exc, StoreUnavailable)
    assert "Redis unavailable (ConnectionError)" in result.traceback
    assert len(piped) <= len(celerys_own_reject(app)) + 2 * len(result.traceback) + 3 * 1024
    assert secret.encode() not in piped
    assert secret not in caplog.text and "retry 1/2" in caplog.text


class DownStream(fakeredis.FakeRedis):
    """A store Redis that takes reads but cannot record dead letters."""

    def xadd(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("record dead letter: Redis unavailable (ConnectionError)")


def test_bad_request_whose_dead_letter_cannot_be_written_is_never_acknowledged(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    down = DownStream()
    install(InMemoryStore(), down, retries=2)
    result = app.tasks[messages.DELETE].apply(args=["ok"], kwargs={"seq": "bad"})
    # Then the request is not acknowledged: after its retries it goes back to the queue ...
    assert isinstance(result.result, Reject) and result.result.requeue
    # ... having been retried, and its payload is in the ERROR log as well.
    assert "retry 1/2" in caplog.text and "retry 2/2" in caplog.text
    assert "its dead letter could not be written" in caplog.text
    assert "request kept in this log line only" in caplog.text
    assert '\\"seq\\":\\"bad\\"' in caplog.text


def test_backoff_is_full_jitter_under_a_doubling_ceiling() -> None:
    policy = RetryPolicy(max_retries=3, base_seconds=1, max_seconds=5)
    assert [policy.ceiling(n) for n in range(5)] == [1, 2, 4, 5, 5]
    rng = random.Random(7)
    draws = [policy.countdown(2, rng) for _ in range(200)]
    assert all(0 <= d <= 4 for d in draws) and max(draws) > 2
    assert not policy.exhausted(2) and policy.exhausted(3)


def test_sweep_announces_each_expired_session_and_skips_while_locked(
    redis: fakeredis.FakeRedis,
) -> None:
    now = [1_000.0]
    store = InMemoryStore(clock=lambda: now[0])
    keys = KeySpace("unit")
    store.save(make_checkpoint("old"), seq=1)
    now[0] += 31 * 24 * 3600
    redis.set(keys.sweep_lock(), "someone else")
    assert sweep(store, redis, keys).locked_out
    redis.delete(keys.sweep_lock())
    result = sweep(store, redis, keys)
    assert result.expired == ["old"] and not result.locked_out
    events: Any = redis.xrange(keys.events())
    assert [fields[b"session_id"] for _, fields in events] == [b"old"]
    assert redis.exists(keys.sweep_lock()) == 0


def test_client_seqs_strictly_increase_per_session_and_no_session_raises_another() -> None:
    clock = SeqClock()
    seqs = [clock.next("s") for _ in range(1000)]
    assert seqs == sorted(set(seqs))
    # A fence read for one session (an hour ahead) raises that session's stamps only
    ahead = seqs[-1] + 3_600_000_000
    clock.observe("s", ahead)
    assert clock.next("s") == ahead + 1
    assert clock.next("t") < ahead


def test_celery_config_is_json_only_late_ack_and_fits_the_visibility_timeout() -> None:
    settings = Settings(broker_url="redis://127.0.0.1:1/0")
    conf = celery_config(settings)
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["task_ignore_result"] and conf["result_backend"] is None
    # Inspection only: worker/remote_control.py refuses the commands that change a worker
    assert conf["worker_enable_remote_control"]
    visibility = conf["broker_transport_options"]["visibility_timeout"]
    policy = RetryPolicy(
        settings.retry_max, settings.retry_backoff_seconds, settings.retry_backoff_max_seconds
    )
    assert max(policy.ceiling(n) for n in range(settings.retry_max + 1)) < visibility


def test_a_retry_settles_as_the_publish_it_descends_from() -> None:
    # Given a message as delivered, and a retry's copy of it (a new delivery tag, Celery's,
    # and the header the worker's retry sets)
    delivered = Context(properties={"delivery_tag": "first"})
    retried = Context(properties={"delivery_tag": "copy"}, **{messages.TAG_HEADER: "first"})
    # Then both settle as the first publish (settle.lua), and a request without either as
    # unknown (its stamp alone then judges)
    assert messages.delivery_tag(delivered) == messages.delivery_tag(retried) == "first"
    assert messages.delivery_tag(Context()) == ""
    # And so do the messages the coalesced path settles in the main process
    copy = SimpleNamespace(headers={messages.TAG_HEADER: "first"}, delivery_tag="copy")
    assert messages.message_tag(copy) == "first"
    assert messages.message_tag(SimpleNamespace(headers={}, delivery_tag="first")) == "first"
