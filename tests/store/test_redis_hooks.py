"""The hand-sent command path (store/redis_hooks.py) is used only on a redis-py it is proven
on; elsewhere the store writes through redis-py's pipeline (the contract suite's
``redis-pipeline`` backend), and says so once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from checkpointq.store import redis_hooks
from tests.support.servers import RedisServer


@pytest.fixture(autouse=True)
def _fresh_verdict() -> Iterator[None]:
    redis_hooks.refusal.cache_clear()
    redis_hooks._announce_pipeline.cache_clear()
    yield
    redis_hooks.refusal.cache_clear()
    redis_hooks._announce_pipeline.cache_clear()


def test_the_hand_sent_path_is_proven_on_the_installed_redis_py() -> None:
    # on the lowest and highest redis-py supported (scripts/test-matrix, main suite)
    assert redis_hooks.refusal() is None


def test_an_unproven_redis_py_writes_through_the_pipeline_and_says_so_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a redis-py line the hand-sent path is not proven on
    monkeypatch.setattr(redis, "__version__", "9.0.0")
    assert redis_hooks.refusal() == "redis-py 9.0.0 is not a line it is proven on"
    client = redis_server.client()
    try:
        # When commands are sent twice, an error reply among them
        for _ in range(2):
            replies = redis_hooks.round_trip(
                client, [("SET", "k", "v"), ("INCR", "k"), ("GET", "k")]
            )
            # Then each reply is in its place, the error reply as its exception
            assert replies[0] is True and replies[2] == b"v"
            assert isinstance(replies[1], redis.ResponseError)
    finally:
        client.close()
    # And one line says why, once
    lines = [r for r in caplog.records if "hand-sent path is off" in r.getMessage()]
    assert len(lines) == 1


def _outcome(run: Any) -> Any:
    """What ``run()`` returned, errors as (type, text); or what it raised: its type, its
    command's number and its text."""
    try:
        replies = run()
    except redis.RedisError as exc:
        return ("raised", type(exc), str(exc).split(" (", 1)[0], _text(exc))
    return [(type(r), _text(r)) if isinstance(r, Exception) else r for r in replies]


def _text(exc: Exception) -> str:
    """An error's text, past redis-py's "Command # <n> (...) of pipeline caused error: "."""
    return str(exc).rsplit("caused error: ", 1)[-1]


@pytest.mark.parametrize(
    "commands",
    [
        [("ZREM", "index", "t1", "t2"), ("HDEL", "hash", "t1", "t2")],
        # a script the broker does not hold: its error in its place, the others applied
        [("ZREM", "index", "t1"), ("HDEL", "hash", "t1"), ("EVALSHA", "0" * 40, 1, "k", "a")],
        # a command refused when queued: EXEC is aborted, the refusal raised
        [("ZREM", "index", "t1"), ("HDEL", "hash")],
        # the broker full (noeviction): a write that may grow it refused when queued
        [("ZREM", "index", "t1"), ("SET", "grow", "x" * 100)],
    ],
    ids=["acks", "noscript", "refused-when-queued", "out-of-memory"],
)
def test_a_hand_sent_transaction_returns_and_raises_what_redis_pys_pipeline_does(
    redis_server: RedisServer, commands: list[tuple[Any, ...]]
) -> None:
    client = redis_server.client()
    try:
        full = any(c[0] == "SET" for c in commands)

        def setup() -> None:
            client.config_set("maxmemory", 0)
            client.flushall()
            client.zadd("index", {"t1": 1, "t2": 2})
            client.hset("hash", mapping={"t1": "m1", "t2": "m2"})
            if full:
                client.config_set("maxmemory-policy", "noeviction")
                client.config_set("maxmemory", 1)

        def pipelined() -> list[Any]:
            pipe: Any
            with client.pipeline() as pipe:  # (execute_command is untyped in redis-py's hints)
                for command in commands:
                    pipe.execute_command(*command)
                replies: list[Any] = pipe.execute(raise_on_error=False)
                return replies

        # Given the same keys, when the same commands go through redis-py's pipeline and by
        # hand
        setup()
        expected, left = _outcome(pipelined), (client.zrange("index", 0, -1), client.hkeys("hash"))
        setup()
        got = _outcome(lambda: redis_hooks.transaction(client.connection_pool, commands))
        # Then the replies (or the error raised) and what they left are the same
        assert got == expected
        assert (client.zrange("index", 0, -1), client.hkeys("hash")) == left
        # And the connection went back to the pool in step: the next command is answered
        client.config_set("maxmemory", 0)
        assert redis_hooks.transaction(client.connection_pool, [("PING",)]) == [b"PONG"]
    finally:
        client.config_set("maxmemory", 0)
        client.close()
