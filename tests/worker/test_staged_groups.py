"""A coalesced group's staged saves (tasks/coalesced.py), in a pool process's place, against a
real redis-server as broker and store: their values are read in one round trip, each up to
its share of the group's byte budget; a larger one, or one that is gone, is left to the task
path, and the others apply. Given / When / Then."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
import redis

from checkpointq.store import RedisStore
from checkpointq.store.keys import KeySpace
from checkpointq.store.serde import serialize_checkpoint
from checkpointq.tasks import coalesced, messages, runtime
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.producer.pending import Settlement, Settler
from checkpointq.tasks.runtime import Runtime
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration

KEYS = KeySpace()
SEQ = 1_000


@pytest.fixture
def store(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[RedisStore]:
    """A pool process's runtime, with a group budget of 256 KiB: a 64 KiB share each for 4."""
    store = RedisStore(redis_client)
    rt = Runtime(
        store=store,
        redis=redis_client,
        keys=KEYS,
        dead_letters=DeadLetters(redis_client, KEYS),
        group_value_bytes=256 * 1024,
        pending=Settler(redis_server.client(), KEYS),
    )
    runtime.install(rt)
    yield store
    runtime.reset()


def _staged(client: redis.Redis, session_id: str, messages_in_history: int) -> coalesced.Request:
    """A staged save's request as the main process hands it over, its value on the broker."""
    value = serialize_checkpoint(make_checkpoint(session_id, messages=messages_in_history))
    client.set(KEYS.pending_value(session_id, f"req-{session_id}"), value)
    body = messages.save_staged_body(orjson.dumps(session_id), SEQ)
    return (messages.SAVE_STAGED, f"req-{session_id}", body, {}, {})


def test_staged_values_within_their_share_apply_in_one_group(
    store: RedisStore, redis_client: redis.Redis
) -> None:
    # Given four staged saves of a few KB each
    group = [_staged(redis_client, f"small-{n}", 10) for n in range(4)]
    # When a pool process applies the group
    done = coalesced.apply_requests(group)
    # Then each is applied, and reported for settling with its value
    assert done == [Settlement(f"small-{n}", f"req-small-{n}", SEQ) for n in range(4)]
    assert [store.load(f"small-{n}") is not None for n in range(4)] == [True] * 4


def test_a_value_over_its_share_of_the_group_budget_is_left_to_the_task_path(
    store: RedisStore, redis_client: redis.Redis
) -> None:
    # Given a group of four whose second value is larger than its 64 KiB share, and whose
    # third value is gone
    group = [
        _staged(redis_client, "share-0", 10),
        _staged(redis_client, "share-1", 2000),  # ~95 KB of JSON
        _staged(redis_client, "share-2", 10),
        _staged(redis_client, "share-3", 10),
    ]
    assert redis_client.strlen(KEYS.pending_value("share-1", "req-share-1")) > 64 * 1024
    redis_client.delete(KEYS.pending_value("share-2", "req-share-2"))
    # When the group is applied
    done = coalesced.apply_requests(group)
    # Then the others apply, and those two are left to the task path (which reads the large
    # one alone, within the message limit, and tells a redelivery from a lost value)
    assert [d is not None for d in done] == [True, False, False, True]
    assert store.load("share-1") is None and store.load("share-0") is not None
