"""Staged saves on the producer's side, against a real redis-server: the value goes to the
broker once, under the request's id, beside a small message that names it; publish.lua keeps
it as long as the message may wait and refuses a message whose value is missing; settle.lua
deletes it with its request. Given / When / Then."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
import redis

from checkpointq.store import ConversationMessage, InMemoryStore
from checkpointq.store.base import StoreOptions
from checkpointq.store.errors import CheckpointTooLarge
from checkpointq.store.keys import KeySpace
from checkpointq.store.scripts import script_source
from checkpointq.store.serde import serialize_checkpoint
from checkpointq.tasks.messages import SAVE_STAGED, envelope_body
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.clock import wall_clock_us
from checkpointq.tasks.producer.pending import Settlement, settle_command, settle_source
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration

QUEUE = "checkpoints"
KEYS = KeySpace()


def _messages(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in reversed(client.lrange(QUEUE, 0, -1))]


def test_a_staged_message_is_a_send_task_message_that_names_the_request(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a 90-message checkpoint saved staged, and the same request by Celery's send_task
    checkpoint = make_checkpoint("shape", version=4, messages=90)
    with CheckpointClient(redis_server.url, InMemoryStore(), queue=QUEUE) as client:
        handle = client.save(checkpoint)
        client._celery_app().send_task(
            SAVE_STAGED, args=["shape"], kwargs={"seq": handle.seq}, queue=QUEUE
        )
    fast, stock = _messages(redis_client)
    # Then both envelopes have the same fields and the same body, which carries no checkpoint
    assert fast.keys() == stock.keys() and fast["headers"].keys() == stock["headers"].keys()
    assert fast["headers"]["task"] == stock["headers"]["task"] == SAVE_STAGED
    assert json.loads(envelope_body(fast)) == json.loads(envelope_body(stock))
    assert json.loads(envelope_body(fast))[:2] == [["shape"], {"seq": handle.seq}]
    assert len(base64.b64decode(fast["body"])) < 200 and len(json.dumps(fast)) < 2048
    # And the checkpoint went to the broker once, under its session and request, as JSON
    value = redis_client.get(KEYS.pending_value("shape", handle.task_id))
    assert value == serialize_checkpoint(checkpoint)


def test_the_handle_of_a_staged_save_names_the_task_that_was_sent(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a client that stages its saves (the default on a Redis broker)
    with CheckpointClient(redis_server.url, InMemoryStore(), queue=QUEUE) as client:
        # When it saves
        handle = client.save(make_checkpoint("named", version=1))
    (sent,) = _messages(redis_client)
    # Then the handle names the task Flower, events and spans show: the message's own
    assert handle.task == sent["headers"]["task"] == SAVE_STAGED
    assert handle.task_id == sent["headers"]["id"]


def test_the_staged_value_lives_as_long_as_its_message_may(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    store = InMemoryStore()
    with CheckpointClient(redis_server.url, store, queue=QUEUE) as client:
        older = client.save(make_checkpoint("ttl", version=1))
        newer = client.save(make_checkpoint("ttl", version=2))
    # Then each request's value lives until its deadline (seq + TTL), not the staging
    # wait; each request has its own entry and its own value
    ttl_ms = int(store.options.ttl_seconds * 1000)
    for handle in (older, newer):
        assert handle.seq is not None
        key = KEYS.pending_value("ttl", handle.task_id)
        assert redis_client.pexpiretime(key) == handle.seq // 1000 + ttl_ms
    entries = redis_client.hgetall(KEYS.pending_requests("ttl"))
    assert sorted(entries) == sorted([older.task_id.encode(), newer.task_id.encode()])


def test_a_checkpoint_that_could_outgrow_the_budget_is_staged_as_the_store_encodes_it(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a store whose budget is below a checkpoint's JSON (so only compression can tell)
    store = InMemoryStore(StoreOptions(max_value_bytes=1024))
    checkpoint = make_checkpoint("budget", version=1, messages=40)
    assert len(serialize_checkpoint(checkpoint)) > 1024
    with CheckpointClient(redis_server.url, store, queue=QUEUE) as client:
        handle = client.save(checkpoint)
    # Then its value is the store's own encoding: compressed, trimmed if it had to be
    value = redis_client.get(KEYS.pending_value("budget", handle.task_id))
    assert value == store.encode(checkpoint).value and len(value) <= 1024
    # And an incompressible one that cannot fit is refused at once, as the worker would
    noise = ConversationMessage(role="user", content=os.urandom(8 * 1024).hex())
    too_large = checkpoint.model_copy(update={"conversation_history": [noise]})
    with (
        CheckpointClient(redis_server.url, store, queue=QUEUE) as client,
        pytest.raises(CheckpointTooLarge, match="stored-size budget"),
    ):
        client.save(too_large)
    assert redis_client.llen(QUEUE) == 1


def test_publish_refuses_a_staged_message_whose_value_is_missing(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given publish.lua called for a staged request without its value SET first
    source = script_source("publish", "checkpointq.tasks")
    keys = [QUEUE, KEYS.pending_index(), KEYS.pending_epoch(), KEYS.pending_mark()]
    keys.append(KEYS.pending_counts())
    keys.append(KEYS.pending_requests("s"))
    keys.append(KEYS.pending_value("s", "req"))
    keys.append(KEYS.pending_counted("s"))
    now_us = wall_clock_us()
    args: list[bytes | str | int] = [b"message", 60_000, "token", now_us, 300_000_000, "", 0, ""]
    args += ["s", now_us, "staged", "req", b""]
    # Then it refuses before any write: no message, no entry
    with pytest.raises(redis.ResponseError, match=r"staged value .* is missing"):
        redis_client.eval(source, len(keys), *keys, *args)
    assert redis_client.llen(QUEUE) == 0 and not redis_client.exists(KEYS.pending_requests("s"))


def test_settle_deletes_the_settled_requests_value_and_no_other(
    redis_client: redis.Redis,
) -> None:
    # Given two staged values of one session, each with its entry
    for request in ("older", "newer"):
        redis_client.set(KEYS.pending_value("s", request), b"{}")
        redis_client.hset(KEYS.pending_requests("s"), request, "2 save")
    settle = redis_client.register_script(settle_source())
    # When the newer request settles
    keys, args = settle_command(KEYS, [Settlement("s", "newer", 2)])
    assert settle(keys=keys, args=args) == 1
    # Then its value and its entry go; the older request's stay for its message
    assert not redis_client.exists(KEYS.pending_value("s", "newer"))
    assert redis_client.hkeys(KEYS.pending_requests("s")) == [b"older"]
    assert redis_client.exists(KEYS.pending_value("s", "older"))
