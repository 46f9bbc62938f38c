"""BatchingClient: coalesces requests into ``apply_batch`` messages, in order, on time."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from checkpointq.store import InMemoryStore
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.messages import APPLY_BATCH, DELETE, SAVE, envelope_body
from checkpointq.tasks.producer.batching import BatchingClient
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, free_port, wait_until

pytestmark = pytest.mark.integration

QUEUE = "checkpoints"


def _batches(client: redis.Redis) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(headers, items) of every message in the queue, oldest first."""
    out = []
    for raw in reversed(client.lrange(QUEUE, 0, -1)):
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(envelope_body(message))
        out.append(
            (message["headers"], args[0] if message["headers"]["task"] == APPLY_BATCH else args)
        )
    return out


@pytest.fixture
def plain(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[CheckpointClient]:
    client = CheckpointClient(redis_server.url, InMemoryStore(), queue=QUEUE)
    yield client
    client.close()


def test_requests_within_a_window_travel_in_one_message_in_order(
    plain: CheckpointClient, redis_client: redis.Redis
) -> None:
    # Given a batching client with a window far longer than the test
    batching = BatchingClient(plain, window_ms=60_000)
    # When it saves two sessions and deletes one, then flushes
    first = batching.save(make_checkpoint("a", version=1))
    second = batching.save(make_checkpoint("b", version=2))
    third = batching.delete("a")
    assert redis_client.llen(QUEUE) == 0  # still in the window
    batching.flush()
    # Then one apply_batch message carries the three items, in order, with their seqs
    ((headers, items),) = _batches(redis_client)
    assert headers["task"] == APPLY_BATCH and headers["id"] == first.task_id == third.task_id
    assert [i["op"] for i in items] == ["save", "save", "delete"]
    assert [i["seq"] for i in items] == [first.seq, second.seq, third.seq]
    assert items[1]["checkpoint"]["sessionId"] == "b" and items[2]["session_id"] == "a"
    assert (first.task, third.task) == (SAVE, DELETE)
    batching.close()


def test_a_request_is_published_when_its_window_passes_without_a_flush(
    plain: CheckpointClient, redis_client: redis.Redis
) -> None:
    # Given a 20 ms window
    with BatchingClient(plain, window_ms=20) as batching:
        batching.save(make_checkpoint("timely"))
        # Then the flusher publishes it on its own
        wait_until(lambda: redis_client.llen(QUEUE) == 1, timeout=10, message="the flusher")


def test_a_full_batch_is_published_at_once_by_the_caller(
    plain: CheckpointClient, redis_client: redis.Redis
) -> None:
    with BatchingClient(plain, window_ms=60_000, max_items=3) as batching:
        for n in range(7):
            batching.delete(f"d{n}")
        # Two full batches left synchronously; the seventh request waits in the window
        assert [len(items) for _, items in _batches(redis_client)] == [3, 3]
    # And close published the rest
    assert [len(items) for _, items in _batches(redis_client)] == [3, 3, 1]


def test_batches_stay_under_max_bytes_and_an_oversize_request_goes_alone(
    plain: CheckpointClient, redis_client: redis.Redis
) -> None:
    with BatchingClient(plain, window_ms=60_000, max_bytes=4_000) as batching:
        for n in range(6):
            batching.save(make_checkpoint(f"m{n}", messages=4, content_size=200))
        big = batching.save(make_checkpoint("big", messages=4, content_size=2_000))
    messages = _batches(redis_client)
    assert all(len(json.dumps(items)) < 4_000 for h, items in messages if h["task"] == APPLY_BATCH)
    singles = [h for h, _ in messages if h["task"] == SAVE]
    assert [h["id"] for h in singles] == [big.task_id]
    batched = [
        i["checkpoint"]["sessionId"]
        for h, items in messages
        if h["task"] == APPLY_BATCH
        for i in items
    ]
    assert batched == [f"m{n}" for n in range(6)]


def test_threads_sharing_a_client_lose_and_duplicate_nothing(
    plain: CheckpointClient, redis_client: redis.Redis
) -> None:
    # Given eight threads saving through one batching client
    with BatchingClient(plain, window_ms=2, max_items=16) as batching:

        def produce(thread: int) -> None:
            for n in range(40):
                batching.save(make_checkpoint(f"t{thread}-{n}"))

        threads = [threading.Thread(target=produce, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # Then every request is in exactly one message, no message over the limit, seqs unique
    items = [i for _, batch in _batches(redis_client) for i in batch]
    assert sorted(i["checkpoint"]["sessionId"] for i in items) == sorted(
        f"t{t}-{n}" for t in range(8) for n in range(40)
    )
    assert all(len(batch) <= 16 for _, batch in _batches(redis_client))
    assert len({i["seq"] for i in items}) == len(items)
    # And within a thread, later requests carry later seqs
    for thread in range(8):
        mine = [i for i in items if i["checkpoint"]["sessionId"].startswith(f"t{thread}-")]
        by_n = sorted(mine, key=lambda i: int(i["checkpoint"]["sessionId"].split("-")[1]))
        assert [i["seq"] for i in by_n] == sorted(i["seq"] for i in mine)


def test_a_batch_the_broker_refused_is_reported_on_the_next_call() -> None:
    # Given a client of a broker nobody listens on, with a short publish retry policy
    client = CheckpointClient(f"redis://127.0.0.1:{free_port()}/0", InMemoryStore(), queue=QUEUE)
    assert client._publisher is not None
    client._publisher.retry_policy = {"max_retries": 1, "interval_start": 0, "interval_step": 0}
    batching = BatchingClient(client, window_ms=1)
    batching.save(make_checkpoint("lost"))
    # When the flusher fails to publish it
    wait_until(lambda: batching._error is not None, timeout=30, message="the publish to fail")
    # Then the next call raises BrokerUnavailable (without queueing its own request), once
    with pytest.raises(BrokerUnavailable):
        batching.delete("next")
    batching.close()  # nothing pending: the delete was refused, not queued
