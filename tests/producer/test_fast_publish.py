"""The fast publish path writes the message Celery's ``send_task`` would, and fails like it."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis
from kombu.message import Message

from checkpointq.store import InMemoryStore
from checkpointq.store.base import StoreOptions
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.store.urls import redis_py_url
from checkpointq.tasks import brokers
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.messages import SAVE, envelope_body
from checkpointq.tasks.producer import fast_publish
from checkpointq.tasks.producer.client import PUBLISH_RETRY_POLICY, CheckpointClient
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, SilentListener, free_port

QUEUE = "checkpoints"


def _messages(client: redis.Redis) -> list[dict[str, Any]]:
    """The queue's messages, oldest first (the order a worker takes them in)."""
    return [json.loads(raw) for raw in reversed(client.lrange(QUEUE, 0, -1))]


def _body(message: dict[str, Any]) -> Any:
    return json.loads(envelope_body(message))


def _kombu_body(message: dict[str, Any]) -> Any:
    """The body as a stock consumer reads it: kombu's Message decompresses it."""
    decoded = Message(  # type: ignore[no-untyped-call]
        body=base64.b64decode(message["body"]),
        headers=message["headers"],
        content_type=message["content-type"],
        content_encoding=message["content-encoding"],
    )
    assert not decoded.errors
    return json.loads(decoded.body)


@pytest.mark.integration
@pytest.mark.parametrize("compressed", [True, False], ids=["zstd", "plain"])
def test_fast_message_has_the_shape_of_a_send_task_message(
    redis_server: RedisServer, redis_client: redis.Redis, compressed: bool
) -> None:
    # Given one save published by our fast path, carrying its checkpoint, and the same save
    # by Celery's send_task, both with zstd compression or both without
    checkpoint = make_checkpoint("shape", version=4)
    with CheckpointClient(
        redis_server.url,
        InMemoryStore(),
        queue=QUEUE,
        compress_messages=compressed,
        stage_saves=False,
    ) as client:
        handle = client.save(checkpoint)
        stock_id = (
            client._celery_app()
            .send_task(
                SAVE,
                args=[checkpoint_to_wire(checkpoint)],
                kwargs={"seq": handle.seq},
                queue=QUEUE,
                argsrepr="[...]",
                kwargsrepr="{...}",
                compression="zstd" if compressed else None,
            )
            .id
        )
    fast, stock = _messages(redis_client)
    # Then the envelopes have the same fields, with the same values where they do not vary
    assert fast.keys() == stock.keys()
    assert fast["headers"].keys() == stock["headers"].keys()
    assert stock["properties"].keys() - {"argsrepr", "kwargsrepr"} == fast["properties"].keys()
    varying = {"id", "root_id", "argsrepr", "kwargsrepr"}
    for name, value in stock["headers"].items():
        if name not in varying:
            assert fast["headers"][name] == value, name
    for name in ("delivery_mode", "delivery_info", "priority", "body_encoding"):
        assert fast["properties"][name] == stock["properties"][name], name
    for name in ("content-type", "content-encoding"):
        assert fast[name] == stock[name]
    assert ("compression" in fast["headers"]) is compressed
    # And the ids and bodies say the same request, as kombu's own codec decodes them
    assert fast["headers"]["id"] == fast["headers"]["root_id"] == handle.task_id
    assert fast["properties"]["correlation_id"] == handle.task_id
    assert stock["headers"]["id"] == stock_id
    assert fast["properties"]["delivery_tag"] != stock["properties"]["delivery_tag"]
    assert _body(fast) == _body(stock) == _kombu_body(fast)


@pytest.mark.integration
def test_a_trimmed_save_goes_uncompressed_with_its_whole_history(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a store that keeps 5 messages, and a save of 8: its record holds the trimmed
    # value, so no frame of the message's JSON exists to reuse
    store = InMemoryStore(StoreOptions(history_cap=5))
    with CheckpointClient(redis_server.url, store, queue=QUEUE, stage_saves=False) as client:
        client.save(make_checkpoint("trimmed", version=2, messages=8))
    # Then the message is plain JSON carrying all 8, for the worker to trim as it does
    (message,) = _messages(redis_client)
    assert "compression" not in message["headers"]
    assert len(_body(message)[0][0]["conversationHistory"]) == 8


@pytest.mark.integration
def test_each_fast_message_has_its_own_task_id_and_delivery_tag(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    with CheckpointClient(redis_server.url, InMemoryStore(), queue=QUEUE) as client:
        for n in range(5):
            client.delete(f"s{n}")
    messages = _messages(redis_client)
    assert len({m["headers"]["id"] for m in messages}) == 5
    assert len({m["properties"]["delivery_tag"] for m in messages}) == 5
    # Oldest first, each with its own increasing seq
    seqs = [_body(m)[1]["seq"] for m in messages]
    assert [_body(m)[0] for m in messages] == [[f"s{n}"] for n in range(5)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5


@pytest.mark.integration
def test_short_argsrepr_names_the_checkpoint_not_its_content(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    checkpoint = make_checkpoint("repr", version=2, messages=50)
    with CheckpointClient(redis_server.url, InMemoryStore(), queue=QUEUE) as client:
        client.save(checkpoint)
    (message,) = _messages(redis_client)
    assert message["headers"]["argsrepr"].startswith("[<checkpoint 'repr' v2, ")
    assert len(message["headers"]["argsrepr"]) < 100


def test_publish_to_an_unreachable_broker_raises_broker_unavailable_after_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a publisher of a port nobody listens on, with a short retry policy
    policy = {"max_retries": 2, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.05}
    publisher = fast_publish.RedisPublisher(
        f"redis://127.0.0.1:{free_port()}/0", QUEUE, policy, socket_timeout=1
    )
    attempts = 0
    real_lpush = publisher._client.lpush

    def counting_lpush(*args: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return real_lpush(*args)

    monkeypatch.setattr(publisher._client, "lpush", counting_lpush)
    # When it publishes, Then it tries once plus two retries and raises BrokerUnavailable
    with pytest.raises(BrokerUnavailable, match="3 attempt"):
        publisher.publish(SAVE, b"[[],{},{}]", "[]")
    assert attempts == 3
    publisher.close()


def test_a_broker_that_accepts_and_never_answers_bounds_the_publish() -> None:
    # Given a broker that accepts connections and never answers, and the client's own policy
    with SilentListener() as silent:
        publisher = fast_publish.RedisPublisher(silent.url, QUEUE, PUBLISH_RETRY_POLICY)

        # When a request is published, Then it fails with BrokerUnavailable
        with pytest.raises(BrokerUnavailable, match="TimeoutError") as failure:
            publisher.publish(SAVE, b"[[],{},{}]", "[]")
        publisher.close()

    # And no attempt was started that could not end within the publish timeout: each waits
    # ATTEMPT_TIMEOUT (1 s) for an answer, so 3 attempts, 1.5 s of pauses, 3.5 s in all
    assert fast_publish.PUBLISH_TIMEOUT == 5.0 and fast_publish.ATTEMPT_TIMEOUT == 1.0
    assert silent.accepted == 3, failure.value


@pytest.mark.parametrize("scheme", ["sentinel", "amqp"])
def test_a_silent_sentinel_or_rabbitmq_fails_the_publish_instead_of_hanging(scheme: str) -> None:
    # Given a Sentinel (or RabbitMQ) broker that accepts connections and never answers:
    # the client publishes through Celery there, and a sentinel used to hang it for good
    with SilentListener() as silent:
        url = f"{scheme}://guest:guest@127.0.0.1:{silent.port}/"
        options = brokers.transport_options(url, sentinel_master="mymaster")
        client = CheckpointClient(url, InMemoryStore(), queue=QUEUE, transport_options=options)

        # When a request is published, Then it fails (pytest's per-test timeout would
        # fail a hang) with BrokerUnavailable
        with pytest.raises(BrokerUnavailable):
            client.delete("s1")
        client.close()
    assert silent.accepted >= 1


@pytest.mark.integration
def test_publish_survives_a_broker_that_comes_back_within_the_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a broker that is down when the publish starts
    server = RedisServer()
    policy = {"max_retries": 40, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.05}
    publisher = fast_publish.RedisPublisher(server.url, QUEUE, policy, socket_timeout=1)
    calls = 0
    real_lpush = publisher._client.lpush

    def lpush_starting_the_server_on_first_failure(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            try:
                return real_lpush(*args)
            finally:
                server.start()  # runs after the refused connection, before the retry
        return real_lpush(*args)

    monkeypatch.setattr(publisher._client, "lpush", lpush_starting_the_server_on_first_failure)
    try:
        # When it publishes, Then the retry delivers the message
        publisher.publish(SAVE, b"[[],{},{}]", "[]")
        assert calls >= 2
        assert server.client().llen(QUEUE) == 1
    finally:
        publisher.close()
        server.cleanup()


def test_only_plain_redis_brokers_take_the_fast_path() -> None:
    assert fast_publish.supports("redis://localhost:6379/0")
    assert fast_publish.supports("rediss://localhost:6380/0")
    assert fast_publish.supports("unix:///tmp/redis.sock")
    assert fast_publish.supports("redis+socket:///tmp/redis.sock")
    assert not fast_publish.supports("amqp://guest@localhost//")
    assert not fast_publish.supports("sentinel://localhost:26379")
    assert redis_py_url("redis+socket:///tmp/r.sock") == "unix:///tmp/r.sock"


def test_other_brokers_publish_through_celery() -> None:
    # Given a client of a broker the fast path does not serve (kombu's in-memory transport)
    with CheckpointClient("memory://", InMemoryStore(), queue=QUEUE) as client:
        # When it saves, Then Celery publishes it (no fast publisher was built)
        assert client._publisher is None
        handle = client.save(make_checkpoint("via-celery"))
        assert handle.seq is not None and handle.task_id


def test_seq_stamps_keep_increasing_across_fast_publishes() -> None:
    # time is only read here to bound the seq, never to wait
    before = time.time_ns() // 1000
    with CheckpointClient("memory://", InMemoryStore(), queue=QUEUE) as client:
        handles = [client.delete(f"d{n}") for n in range(3)]
    seqs = [h.seq or 0 for h in handles]
    assert all(s >= before for s in seqs)
    assert seqs == sorted(seqs)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.integration
def test_publish_signals_run_as_in_celerys_publish_and_their_headers_reach_the_message(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    from celery import signals

    seen: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}

    def before(**kwargs: Any) -> None:
        seen["before"].append(kwargs)
        kwargs["headers"]["traceparent"] = TRACEPARENT  # what a tracer's inject does

    def after(**kwargs: Any) -> None:
        seen["after"].append(kwargs)

    # Given receivers of before_task_publish (adding a header) and after_task_publish
    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        # When one save goes by the fast path and one by Celery's send_task
        checkpoint = make_checkpoint("hooks", version=2)
        store = InMemoryStore()
        with CheckpointClient(redis_server.url, store, queue=QUEUE, stage_saves=False) as client:
            handle = client.save(checkpoint)
            wire = checkpoint_to_wire(checkpoint)
            client._send_task(SAVE, [wire], {"seq": handle.seq}, "[...]", "{}")
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    fast, stock = _messages(redis_client)
    # Then both messages carry the header the receiver added
    assert fast["headers"]["traceparent"] == stock["headers"]["traceparent"] == TRACEPARENT
    # And each signal ran once per publish, with the arguments Celery gives it
    (fast_before, stock_before), (fast_after, stock_after) = seen["before"], seen["after"]
    assert fast_before.keys() == stock_before.keys()
    assert fast_after.keys() == stock_after.keys()
    assert fast_before["sender"] == fast_after["sender"] == SAVE
    assert fast_before["headers"]["id"] == fast_after["headers"]["id"] == handle.task_id
    assert fast_before["routing_key"] == stock_before["routing_key"] == QUEUE
    assert list(fast_before["body"]) == list(stock_before["body"])
    # And the rest of the fast message is what it is without receivers
    assert _body(fast) == _body(stock)
    assert fast["properties"]["correlation_id"] == handle.task_id
