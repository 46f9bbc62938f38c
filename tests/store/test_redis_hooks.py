"""The hand-sent command path (store/redis_hooks.py) is used only on a redis-py it is proven
on; elsewhere the store writes through redis-py's pipeline (the contract suite's
``redis-pipeline`` backend), and says so once."""

from __future__ import annotations

from collections.abc import Iterator

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
