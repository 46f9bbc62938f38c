"""End to end with RabbitMQ as the broker: the same tasks, the same guarantees.

A vhost of our own on the machine's RabbitMQ (deleted afterwards), a private store Redis,
one real prefork worker for the module.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu.connection import Connection
from kombu.entity import Exchange
from kombu.messaging import Producer

from checkpointq.store.keys import KeySpace
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.dead_letters import DeadLetters, Reason
from checkpointq.tasks.messages import DELETE, SAVE
from checkpointq.tasks.producer.client import CheckpointClient
from tests.scale.conftest import RESUMED, Fleet, store_out_of_memory, wait_drained
from tests.scale.load import all_applied, expected_state, mismatches, mixed_load
from tests.support.checkpoints import make_checkpoint
from tests.support.rabbitmq import RabbitVhost
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import QUEUE

pytestmark = pytest.mark.integration


def wire(session_id: str, version: int) -> dict[str, Any]:
    return checkpoint_to_wire(make_checkpoint(session_id, version=version))


@pytest.fixture(scope="module")
def fleet(rabbit_vhost: RabbitVhost, store_server: RedisServer) -> Iterator[Fleet]:
    fleet = Fleet.of(broker_url=rabbit_vhost.url, store_url=store_server.url)
    try:
        yield fleet.start_workers(1)
    finally:
        fleet.stop()


def test_client_publishes_with_confirms_over_celery(client: CheckpointClient) -> None:
    # Given a client built from RabbitMQ settings
    # Then it publishes through Celery with publisher confirms on
    assert client._app is not None
    assert client._app.conf.broker_transport_options == {"confirm_publish": True}


def test_saves_and_deletes_through_the_client_are_applied(client: CheckpointClient) -> None:
    # Given saves of three sessions and a delete of one, through a RabbitMQ broker
    handles = [client.save(make_checkpoint(f"amqp-{i}", version=i + 1)) for i in range(3)]
    deleted = client.delete("amqp-1")
    # Then each becomes durable, in the store the worker writes
    for handle in [*handles, deleted]:
        client.wait_durable(handle, timeout=20)
    assert client.load("amqp-1") is None
    assert [client.load(f"amqp-{i}").version for i in (0, 2)] == [1, 3]  # type: ignore[union-attr]
    assert sorted(client.list()) == ["amqp-0", "amqp-2"]


def test_duplicated_out_of_order_requests_end_at_the_highest_seq(
    client: CheckpointClient, rabbit_vhost: RabbitVhost
) -> None:
    # Given every request of a mixed load sent twice, in shuffled order, with its own seq
    load = mixed_load("amqp-mix", sessions=20, per_session=5, seed=7)
    for request in load:
        if request.version is None:
            client.send(DELETE, [request.session_id], {"seq": request.seq})
        else:
            wire = checkpoint_to_wire(make_checkpoint(request.session_id, version=request.version))
            client.send(SAVE, [wire], {"seq": request.seq})
    # When the worker has run them all
    expected = expected_state(load)
    wait_until(lambda: all_applied(client.store, expected), timeout=30, message="load applied")
    wait_drained(rabbit_vhost)
    # Then per session the highest seq won, and deleted sessions stay deleted
    assert mismatches(client.store, expected) == []


def test_poison_messages_are_dead_lettered_and_the_worker_carries_on(
    client: CheckpointClient, fleet: Fleet, rabbit_vhost: RabbitVhost, store_client: redis.Redis
) -> None:
    letters = DeadLetters(store_client, KeySpace(fleet.settings.key_prefix))
    # Given a body that is not JSON, published raw to the queue's exchange ...
    with Connection(rabbit_vhost.url) as connection:  # type: ignore[no-untyped-call]
        exchange = Exchange(QUEUE, "direct")  # type: ignore[no-untyped-call]  # kombu: no hints
        channel = connection.default_channel
        producer = Producer(channel, exchange=exchange)  # type: ignore[no-untyped-call]
        producer.publish(  # type: ignore[no-untyped-call]
            b"{not json",
            routing_key=QUEUE,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": SAVE, "id": str(uuid.uuid4())},
        )
    # ... a task nobody knows, and a save of an invalid checkpoint
    client.send("checkpoint.no_such_task", ["x"], {})
    client.send(SAVE, [{"sessionId": "", "version": 1}], {"seq": 5})
    # and a good save after them
    handle = client.save(make_checkpoint("amqp-after-poison"))
    # Then the good save is applied, and each poison message is a dead letter
    client.wait_durable(handle, timeout=20)
    wait_until(lambda: letters.count() == 3, timeout=20, message="three dead letters")
    kinds = sorted(entry.kind for entry in letters.list().entries)
    assert kinds == sorted([Reason.UNDECODABLE, Reason.UNKNOWN_TASK, Reason.INVALID_INPUT])
    # and nothing stays in the queue for redelivery
    wait_drained(rabbit_vhost)


def test_raw_amqp_message_with_the_documented_headers_is_applied(
    client: CheckpointClient, rabbit_vhost: RabbitVhost
) -> None:
    # Given a producer without Celery: plain JSON body, the two required headers
    body = json.dumps([[wire("amqp-raw", version=4)], {"seq": 2_000}, {}]).encode()
    with Connection(rabbit_vhost.url) as connection:  # type: ignore[no-untyped-call]
        exchange = Exchange(QUEUE, "direct")  # type: ignore[no-untyped-call]  # kombu: no hints
        channel = connection.default_channel
        producer = Producer(channel, exchange=exchange)  # type: ignore[no-untyped-call]
        producer.publish(  # type: ignore[no-untyped-call]
            body,
            routing_key=QUEUE,
            content_type="application/json",
            content_encoding="utf-8",
            delivery_mode=2,
            headers={"task": SAVE, "id": str(uuid.uuid4())},
        )
    # Then the worker applies it like any other save
    wait_until(lambda: client.load("amqp-raw") is not None, timeout=20, message="raw save")
    fence = client.store.fence("amqp-raw")
    assert fence is not None and fence.seq == 2_000


def test_a_store_out_of_memory_pauses_the_worker_and_saves_wait_in_rabbitmq(
    client: CheckpointClient, fleet: Fleet, rabbit_vhost: RabbitVhost, store_client: redis.Redis
) -> None:
    # Given a worker that applied a save through RabbitMQ
    client.wait_durable(client.save(make_checkpoint("amqp-oom-0")), timeout=30)
    # When the store runs out of memory, and the worker has paused (its RabbitMQ consumer
    # cancelled)
    with store_out_of_memory(store_client, fleet):
        # Then saves published meanwhile wait in RabbitMQ, ready: none was delivered to the
        # worker, nor taken and retried
        handles = [client.save(make_checkpoint(f"amqp-oom-{i}", version=i)) for i in range(1, 21)]
        wait_until(lambda: rabbit_vhost.pending() == 20, timeout=30, message="20 saves queued")
        assert rabbit_vhost.counts() == (20, 0)
        assert client.store.load("amqp-oom-20") is None
    # When an operator raises the limit, the worker resumes by itself and every save
    # applies: none lost, none dead-lettered
    for handle in handles:
        client.wait_durable(handle, timeout=60)
    wait_drained(rabbit_vhost)
    assert DeadLetters(store_client, KeySpace(fleet.settings.key_prefix)).count() == 0
    assert RESUMED in fleet.logs()


def test_a_worker_on_rabbitmq_shuts_down_without_an_error(
    rabbit_vhost: RabbitVhost, store_server: RedisServer
) -> None:
    # Given a worker of its own on RabbitMQ, ready
    fleet = Fleet.of(broker_url=rabbit_vhost.url, store_url=store_server.url).start_workers(1)
    (worker,) = fleet.processes
    # When it is stopped (warm shutdown, SIGTERM)
    code = worker.stop()
    # Then it exits cleanly, and no step's stop logged an error (the lost-settles step
    # once read a kombu virtual channel's QoS off py-amqp's channel, which has none)
    log = worker.log()
    assert code == 0, log
    assert "ERROR" not in log and "Traceback" not in log, log
