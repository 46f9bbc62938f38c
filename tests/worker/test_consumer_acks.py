"""The consumer's ack and reject wrappers, on real kombu messages (in-memory transport, and
a real Redis broker for a connection closed under a message).

A prefetch window of one message: ``qos.can_consume()`` tells whether its slot is free.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import connection, entity, messaging
from redis.exceptions import OutOfMemoryError, ResponseError

from checkpointq.worker import backpressure, lost_settles
from checkpointq.worker.consumer import _leave_for_redelivery, _release_slot_when_broker_lost
from tests.support.servers import RedisServer

# kombu's hints are partial (untyped functions): its classes are used as Any here.
Connection: Any = connection.Connection
Producer: Any = messaging.Producer
Queue: Any = entity.Queue

ERRORS = (ConnectionError,)


@pytest.fixture
def channel() -> Iterator[Any]:
    with Connection("memory://") as connection:
        channel = connection.channel()
        channel.basic_qos(0, 1, False)
        queue = Queue("acks", channel=channel)
        queue.declare()
        yield channel
        queue.delete()
        channel.close()


def _delivered(channel: Any) -> Any:
    """A 200 KB message taken from the queue, wrapped as the consumer wraps it."""
    Producer(channel).publish(
        b"x" * 200_000,
        routing_key="acks",
        content_type="application/octet-stream",
        content_encoding="binary",
    )
    message = Queue("acks", channel=channel).get(no_ack=False)
    assert message is not None
    _release_slot_when_broker_lost(message, ERRORS)
    return message


def _unreachable(*args: Any, **kwargs: Any) -> None:
    raise ConnectionError("broker down")


def test_an_acknowledged_message_is_freed_without_waiting_for_the_garbage_collector(
    channel: Any,
) -> None:
    # Given a delivered message, and no cyclic garbage collection
    message = _delivered(channel)
    alive = weakref.ref(message)
    gc.disable()
    try:
        # When it is acknowledged and dropped, and the QoS forgets it (at the next delivery)
        message.ack()
        del message
        _delivered(channel).ack()
        # Then reference counting alone has freed it, body and all: no cycle holds it
        assert alive() is None
    finally:
        gc.enable()


def test_an_ack_that_cannot_reach_the_broker_frees_the_prefetch_slot(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a delivered message, which takes the one prefetch slot, and a broker gone away
    message = _delivered(channel)
    assert not channel.qos.can_consume()
    monkeypatch.setattr(channel, "basic_ack", _unreachable)
    # When it is acknowledged, Then the error reaches the caller (Celery logs it) ...
    with pytest.raises(ConnectionError):
        message.ack()
    # ... and the slot is free again, so that the worker keeps polling the broker
    assert channel.qos.can_consume()


def test_a_reject_that_cannot_reach_the_broker_frees_the_prefetch_slot(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a delivered message and a broker gone away
    message = _delivered(channel)
    monkeypatch.setattr(channel, "basic_reject", _unreachable)
    # When it is requeued, Then the error reaches the caller and the slot is free again
    with pytest.raises(ConnectionError):
        message.reject(requeue=True)
    assert channel.qos.can_consume()


def test_a_reachable_broker_settles_the_message_as_kombu_would(channel: Any) -> None:
    # Given a delivered message
    message = _delivered(channel)
    # When it is acknowledged with the broker up, Then kombu records it and frees the slot
    message.ack()
    assert message.acknowledged
    assert channel.qos.can_consume()


def test_a_message_left_for_redelivery_frees_its_slot_and_stays_unacknowledged(
    channel: Any,
) -> None:
    # Given a delivered message whose dead letter could not be written (store down)
    message = _delivered(channel)
    assert not channel.qos.can_consume()
    # When it is left for redelivery
    _leave_for_redelivery(message)
    # Then the worker can take the next message, and this one was never settled
    assert channel.qos.can_consume()
    assert not message.acknowledged


@pytest.mark.parametrize("settle", ["ack", "requeue"])
def test_a_settle_the_broker_refuses_pauses_the_worker_instead_of_ending_it(
    channel: Any, monkeypatch: pytest.MonkeyPatch, settle: str
) -> None:
    # Given a delivered message and a broker that answers every write with -OOM
    message = _delivered(channel)
    tripped: list[str] = []
    monkeypatch.setattr(backpressure, "trip_broker", tripped.append)

    def out_of_memory(*args: Any, **kwargs: Any) -> None:
        raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    monkeypatch.setattr(channel, "basic_ack", out_of_memory)
    monkeypatch.setattr(channel, "basic_reject", out_of_memory)
    # When it is acknowledged or requeued: no error reaches Celery (it would end the
    # consumer: this is no connection error to it) ...
    if settle == "ack":
        message.ack()
    else:
        message.reject(requeue=True)
    # ... the slot is free, the message was never settled (the broker redelivers it), and
    # the worker's gate was told the broker refuses writes
    assert channel.qos.can_consume()
    assert not message.acknowledged
    assert len(tripped) == 1 and tripped[0].startswith("out of memory")


def test_any_other_broker_error_while_settling_still_reaches_celery(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _delivered(channel)

    def wrong(*args: Any, **kwargs: Any) -> None:
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    monkeypatch.setattr(channel, "basic_ack", wrong)
    with pytest.raises(ResponseError):
        message.ack()


@pytest.mark.integration
@pytest.mark.parametrize("requeue", [False, True], ids=["ack", "requeue"])
def test_a_settle_after_its_connection_was_closed_is_left_for_the_next_one(
    redis_server: RedisServer, requeue: bool
) -> None:
    # Given a message delivered over a real Redis broker, whose connection is then closed
    # as Celery's consumer closed it after a lost broker, with a pool result still due: the
    # transport let go of its connection (``client`` None, as ``Connection.close`` leaves
    # it) before the channel closed, and the channel's restore failed on it (worker log)
    queue = f"closed-{requeue}"
    connection = Connection(redis_server.url)
    channel = connection.channel()
    Queue(queue, channel=channel).declare()
    Producer(channel).publish(b"{}", routing_key=queue, content_type="application/json")
    message = Queue(queue, channel=channel).get(no_ack=False)
    assert message is not None
    _release_slot_when_broker_lost(message, ERRORS)
    connection.transport.client = None
    with pytest.raises(AttributeError):
        channel.close()
    tag = str(message.delivery_tag)
    try:
        # When the result arrives and the message is settled: no error ends the consumer
        # (kombu raised AttributeError on the detached transport) ...
        if requeue:
            message.reject(requeue=True)
        else:
            message.ack()
        # ... and the settle waits for the next connection (which restores what the
        # failed close left unacknowledged, then settles this)
        assert tag in (lost_settles.lost.requeues if requeue else lost_settles.lost.acks)
        assert redis.Redis.from_url(redis_server.url).hexists("unacked", tag)
    finally:
        lost_settles.lost.requeues.pop(tag, None)
        lost_settles.lost.acks.pop(tag, None)
