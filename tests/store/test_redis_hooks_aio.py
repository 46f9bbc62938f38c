"""The asyncio hand-sent path (store/redis_hooks_aio.py): one write and its replies on a
connection it keeps, bounded by its watchdog, and on a redis-py it is not proven on (or
whose connection methods are not what it calls) the public pipeline instead, said once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from checkpointq.store import redis_hooks, redis_hooks_aio
from checkpointq.store.redis_hooks_aio import RoundTrips
from tests.support.servers import RedisServer

COMMANDS: list[tuple[Any, ...]] = [("SET", "k", "v"), ("INCR", "k"), ("GET", "k")]


@pytest.fixture(autouse=True)
def _fresh_verdict() -> Iterator[None]:
    caches = (
        redis_hooks.refusal,
        redis_hooks_aio.refusal,
        redis_hooks_aio._announce_pipeline,
    )
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def _client(server: RedisServer) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(server.url, socket_timeout=None)


def _assert_replies_in_place(replies: list[Any]) -> None:
    # (a SET's OK as the pipeline's callback makes it, or as sent)
    assert replies[0] in (True, b"OK") and replies[2] == b"v"
    assert isinstance(replies[1], redis.ResponseError)


def test_round_trips_go_hand_sent_on_one_kept_connection(redis_server: RedisServer) -> None:
    # Given the installed redis-py (proven on), and a client whose pipeline must not be used
    async def main() -> set[int]:
        client = _client(redis_server)
        client.pipeline = None  # type: ignore[assignment,method-assign]
        send = RoundTrips(client, 1.0)
        assert send.refusal is None
        ids = set()
        try:
            # When commands go three times, an error reply among them
            for _ in range(3):
                _assert_replies_in_place(await send(COMMANDS))
                (client_id,) = await send([("CLIENT", "ID")])
                ids.add(client_id)
        finally:
            await client.aclose()
        return ids

    # Then each reply is in its place, and every call went down the one kept connection
    assert len(asyncio.run(main())) == 1


@pytest.mark.parametrize("why", ["version", "self-test"])
def test_without_the_hook_round_trips_go_through_the_pipeline_and_say_so_once(
    why: str,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a redis-py line the path is not proven on, or one whose connection lost a method
    if why == "version":
        monkeypatch.setattr(redis, "__version__", "9.0.0")
        expected = "redis-py 9.0.0 is not a line it is proven on"
    else:
        monkeypatch.setattr(AbstractConnection, "read_response", lambda *_: None)
        expected = "redis.asyncio AbstractConnection.read_response is not a coroutine function"
        assert redis_hooks_aio.refusal() == expected  # the verdict, read once at start-up
        monkeypatch.undo()  # (the pipeline needs the method back)

    async def main() -> None:
        client = _client(redis_server)
        try:
            # When two senders start up and send, an error reply among the commands
            for _ in range(2):
                send = RoundTrips(client, 1.0)
                assert send.refusal == expected
                _assert_replies_in_place(await send(COMMANDS))
        finally:
            await client.aclose()

    asyncio.run(main())
    # Then the replies are the hand-sent path's, and one line says why, once
    lines = [r for r in caplog.records if "hand-sent path is off" in r.getMessage()]
    assert [r.getMessage().endswith(f"({expected})") for r in lines] == [True]


def test_a_call_past_its_timeout_raises_redis_timeout_and_the_next_one_reconnects(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a sender bounded at 0.2 s and a server that holds writes for 2 s
    async def main() -> tuple[float, int, Any]:
        client = _client(redis_server)
        send = RoundTrips(client, 0.2)
        try:
            await send([("PING",)])
            redis_client.client_pause(2_000, all=False)
            started = time.monotonic()
            # When a write is sent
            with pytest.raises(redis.TimeoutError):
                await send([("SET", "held", "1")])
            took = time.monotonic() - started
            task = asyncio.current_task()
            assert task is not None
            redis_client.client_unpause()
            # Then the next call, on a new connection, is answered
            return took, task.cancelling(), await send([("GET", "held")])
        finally:
            await client.aclose()

    took, cancelling, replies = asyncio.run(main())
    # Within its timeout and the watchdog's quarter; the task is not left cancelled
    assert 0.2 <= took < 0.2 * 1.25 + 0.2, took
    assert cancelling == 0
    assert replies in ([b"1"], [None])  # the held SET may or may not have run


def test_a_caller_cancelled_mid_call_is_cancelled_not_timed_out(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a call the server holds, past the sender's timeout
    async def main() -> Any:
        client = _client(redis_server)
        send = RoundTrips(client, 0.1)
        try:
            await send([("PING",)])
            redis_client.client_pause(1_000, all=False)
            task = asyncio.create_task(send([("SET", "held", "1")]))
            await asyncio.sleep(0.02)
            # When its caller cancels it before the watchdog does
            task.cancel()
            # Then it ends cancelled, and the watchdog's later pass leaves nothing behind
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.1)
            redis_client.client_unpause()
            return await send([("SET", "after", "1")])
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [b"OK"]
