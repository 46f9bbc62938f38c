"""Settles and reservations lost to a dropped connection are done again (worker/lost_settles.py),
on a real redis-server through kombu's Redis transport with the worker's reader installed.

Without this, each such message waits in the broker's ``unacked`` hash for the visibility
timeout (an hour here: nothing in these tests comes back by timing out).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.producer.pending import Settlement, settle_command
from checkpointq.worker import lost_settles, reserve
from checkpointq.worker.consumer import _release_slot_when_broker_lost
from checkpointq.worker.hooks import kombu as kombu_hooks
from tests.support.servers import RedisServer, wait_until
from tests.worker.test_reserve import QUEUE, _consume, _publish


@pytest.fixture
def lost(monkeypatch: pytest.MonkeyPatch) -> lost_settles.LostSettles:
    """A fresh record for this test, where the worker's hooks write."""
    fresh = lost_settles.LostSettles()
    monkeypatch.setattr(lost_settles, "lost", fresh)
    return fresh


def _cut(*args: Any, **kwargs: Any) -> None:
    raise redis.ConnectionError("Connection closed by server.")


@pytest.mark.parametrize("settle", ["ack", "reject", "requeue"])
def test_a_settle_lost_to_a_dropped_connection_is_done_again_once_the_broker_answers(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
    monkeypatch: pytest.MonkeyPatch,
    settle: str,
) -> None:
    # Given a delivered message, wrapped as the worker's consumer wraps it
    _publish(redis_server.url, 1)
    conn, channel, received = _consume(redis_server.url, prefetch=1)
    try:
        conn.drain_events(timeout=5)
        (message,) = received
        _release_slot_when_broker_lost(message, (redis.ConnectionError,))
        # When its settle is cut off with the connection
        monkeypatch.setattr(channel, "basic_ack", _cut)
        monkeypatch.setattr(channel, "basic_reject", _cut)
        with pytest.raises(redis.ConnectionError):
            message.ack() if settle == "ack" else message.reject(requeue=settle == "requeue")
        # Then it stays unacknowledged on the broker (the visibility timeout's to restore) ...
        assert broker.hlen(channel.unacked_key) == 1 and lost
        # ... until the worker's next attempt settles it as it meant to
        lost.retry(channel)
        assert broker.hlen(channel.unacked_key) == 0
        assert broker.zcard(channel.unacked_index_key) == 0
        assert broker.llen(QUEUE) == (1 if settle == "requeue" else 0)
        assert not lost
    finally:
        conn.close()


def test_a_settle_the_broker_still_refuses_is_kept_for_the_next_attempt(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
) -> None:
    # Given a lost ack, and a broker that refuses writes (out of memory, eviction off)
    _publish(redis_server.url, 1)
    conn, channel, received = _consume(redis_server.url, prefetch=1)
    try:
        conn.drain_events(timeout=5)
        lost.lost_settle(received[0].delivery_tag, requeue=False)
        broker.config_set("maxmemory-policy", "noeviction")
        broker.config_set("maxmemory", 1)
        try:
            # When the worker tries again: the refusal keeps it
            lost.retry(channel)
            assert lost and broker.hlen(channel.unacked_key) == 1
        finally:
            broker.config_set("maxmemory", 0)
        # Then the next attempt, once writes are accepted, settles it
        lost.retry(channel)
        assert not lost and broker.hlen(channel.unacked_key) == 0
    finally:
        conn.close()


def test_pending_records_settled_with_lost_acks_are_settled_again_with_them(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
) -> None:
    # Given an applied staged save whose ack, and its record's settle, the broker refused
    keys = KeySpace()
    value = keys.pending_value("s", "request")
    broker.set(value, b"{}")
    broker.hset(keys.pending_requests("s"), "request", "5 save")
    _publish(redis_server.url, 1)
    conn, channel, received = _consume(redis_server.url, prefetch=1)
    try:
        conn.drain_events(timeout=5)
        lost.lost_settle(received[0].delivery_tag, requeue=False)
        lost.lost_records(*settle_command(keys, [Settlement("s", "request", 5)]))
        # When the worker tries again, once the broker takes writes
        lost.retry(channel)
        # Then the ack, the record and the staged value are all done with
        assert not lost and broker.hlen(channel.unacked_key) == 0
        assert not broker.exists(value, keys.pending_requests("s"))
    finally:
        conn.close()


def test_a_reservation_whose_reply_was_lost_is_handed_back_to_the_queue(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a consumer with room for 8 that took a first message, and 9 queued since
    _publish(redis_server.url, 1)
    conn, channel, received = _consume(redis_server.url, prefetch=8)
    try:
        conn.drain_events(timeout=5)
        assert len(received) == 1
        _publish(redis_server.url, 9)
        kombu_hooks._reading(channel).busy = True  # as after a wait woke on them
        # When the reserve script runs on the broker but its reply is lost with the connection
        client = channel.client
        parse = client.parse_response

        def reply_lost(connection: Any, command: str, **options: Any) -> Any:
            parse(connection, command, **options)  # the script ran: 7 more are in unacked
            raise redis.ConnectionError("Connection closed by server.")

        monkeypatch.setattr(client, "parse_response", reply_lost)
        with pytest.raises(redis.ConnectionError):
            conn.drain_events(timeout=5)
        monkeypatch.undo()
        assert len(received) == 1 and broker.hlen(channel.unacked_key) == 8
        # Then the worker's next attempt hands the 7 it never saw back to the queue, and
        # keeps the one it holds
        lost.retry(channel)
        assert broker.llen(QUEUE) == 9
        tags: list[bytes] = broker.hkeys(channel.unacked_key)  # type: ignore[assignment]
        assert [t.decode() for t in tags] == [received[0].delivery_tag]
        assert not lost
    finally:
        conn.close()


def test_a_reservation_left_unread_when_the_consumer_restarts_is_handed_back(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a consumer with room for 8 that took a first message, and whose reserve script
    # for the next 7 of the 9 queued since ran on the broker
    _publish(redis_server.url, 1)
    conn, channel, _ = _consume(redis_server.url, prefetch=8)
    conn.drain_events(timeout=5)
    _publish(redis_server.url, 9)
    kombu_hooks._reading(channel).busy = True  # as after a wait woke on them
    channel._brpop_start()  # what kombu's poller sends next: the script
    wait_until(lambda: broker.hlen(channel.unacked_key) == 8, timeout=10, message="the script")
    # When Celery restarts its consumer because a connection dropped: its close of the
    # channel reads the pending reply first, fails on the dead connection, and Celery
    # ignores the error (nothing is delivered, nothing restored)
    monkeypatch.setattr(channel.client, "parse_response", _cut)
    with pytest.raises(redis.ConnectionError):
        channel.close()
    monkeypatch.undo()
    assert broker.llen(QUEUE) == 2 and broker.hlen(channel.unacked_key) == 8
    # Then the next consumer's first attempt hands the 7 it never saw back to the queue
    # (the one delivered stays for the visibility timeout: the pool may still run it)
    dropped, conn, channel, _ = conn, *_consume(redis_server.url, prefetch=8)
    try:
        lost.retry(channel)
        assert broker.llen(QUEUE) == 9 and broker.hlen(channel.unacked_key) == 1
        assert not lost
    finally:
        conn.close()
        dropped.close()


def test_messages_held_at_a_consumer_restart_are_restored_once_the_broker_takes_writes(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
) -> None:
    # Given a consumer holding a message when its consumer restarts, and a broker out of
    # memory, which refuses kombu's restore as the channel closes
    _publish(redis_server.url, 1)
    conn, channel, _ = _consume(redis_server.url, prefetch=1)
    conn.drain_events(timeout=5)
    lost.restarting(channel.qos)
    broker.config_set("maxmemory-policy", "noeviction")
    broker.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.ResponseError):
            channel.close()
        assert broker.hlen(channel.unacked_key) == 1 and broker.llen(QUEUE) == 0
        lost.retry(channel)
        assert lost  # still refused: kept
    finally:
        broker.config_set("maxmemory", 0)
    # When the broker takes writes again, then the next consumer's attempt restores it
    dropped, conn, channel, _ = conn, *_consume(redis_server.url, prefetch=1)
    try:
        lost.retry(channel)
        assert broker.llen(QUEUE) == 1 and broker.hlen(channel.unacked_key) == 0
        assert not lost
    finally:
        conn.close()
        dropped.close()


def test_a_reservation_whose_put_back_was_cut_short_is_handed_back(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    lost: lost_settles.LostSettles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given 10 queued messages and a consumer that fails on the third it is handed
    _publish(redis_server.url, 10)

    def fail_on_third(message: Any) -> None:
        if message.decode()["n"] == 2:
            raise RuntimeError("consumer bug")

    conn, channel, _ = _consume(redis_server.url, prefetch=10, on_message=fail_on_third)
    try:
        # When the put-back of the rest of its batch is cut off with the connection
        monkeypatch.setattr(reserve, "put_back", _cut)
        with pytest.raises(redis.ConnectionError):
            conn.drain_events(timeout=5)
        monkeypatch.undo()
        assert broker.hlen(channel.unacked_key) == 10 and broker.llen(QUEUE) == 0
        # Then the next attempt hands back the 7 it never saw, and keeps the 3 it holds
        lost.retry(channel)
        assert broker.llen(QUEUE) == 7 and broker.hlen(channel.unacked_key) == 3
        assert not lost
    finally:
        conn.close()
