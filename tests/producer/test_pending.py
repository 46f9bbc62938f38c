"""Pending records: written with each push, merged into loads and lists by seq, settled by
the worker's script; against real redis-servers (two clients play two API replicas)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from checkpointq.store import ConversationMessage, RedisStore
from checkpointq.store.base import StoreOptions
from checkpointq.store.errors import CheckpointTooLarge, StoreUnavailable
from checkpointq.store.keys import KeySpace
from checkpointq.tasks.errors import BrokerUnavailable, PendingRecordMissing, SeqRefused
from checkpointq.tasks.producer.batching import BatchingClient
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.pending import (
    DELETE_OP,
    SAVE_OP,
    EpochWatch,
    RecordWrite,
    Settlement,
    _answering,
    settle_command,
    settle_source,
)
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, free_port

pytestmark = pytest.mark.integration

QUEUE = "checkpoints"
KEYS = KeySpace()


def _replica(broker_url: str, store_url: str, **options: object) -> CheckpointClient:
    store = RedisStore.from_url(store_url, options=StoreOptions(**options))  # type: ignore[arg-type]
    return CheckpointClient(broker_url, store, queue=QUEUE)


@pytest.fixture
def one_redis(
    redis_server: RedisServer, redis_client: redis.Redis
) -> Iterator[tuple[CheckpointClient, CheckpointClient]]:
    """Two replicas on one Redis that is broker and store; no worker consumes."""
    a, b = (
        _replica(redis_server.url, redis_server.url),
        _replica(redis_server.url, redis_server.url),
    )
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def two_redis(
    redis_server: RedisServer, redis_client: redis.Redis, store_server: RedisServer
) -> Iterator[tuple[CheckpointClient, CheckpointClient]]:
    """Two replicas with the broker and the store on separate Redis servers."""
    store_server.client().flushall()
    a, b = (
        _replica(redis_server.url, store_server.url),
        _replica(redis_server.url, store_server.url),
    )
    yield a, b
    a.close()
    b.close()


@pytest.fixture(params=["one_redis", "two_redis"])
def replicas(request: pytest.FixtureRequest) -> tuple[CheckpointClient, CheckpointClient]:
    pair: tuple[CheckpointClient, CheckpointClient] = request.getfixturevalue(request.param)
    return pair


def test_a_queued_save_is_what_another_replica_loads(
    replicas: tuple[CheckpointClient, CheckpointClient],
) -> None:
    a, b = replicas
    # Given a durable session at version 5
    a.store.save(make_checkpoint("s", version=5, messages=5), seq=100)
    # When replica A saves version 6 and no worker applies it
    handle = a.save(make_checkpoint("s", version=6, messages=6))
    # Then replica B loads version 6, fenced at A's seq, and lists the session
    cp, fence = b.load_with_fence("s")
    assert cp is not None and cp.version == 6 and len(cp.conversation_history) == 6
    assert fence is not None and fence.seq == handle.seq and fence.request_id == handle.task_id
    assert b.list() == ["s"]
    # And B's next save sorts after A's
    assert (b.save(make_checkpoint("s", version=7)).seq or 0) > fence.seq
    assert b.store.load("s").version == 5  # type: ignore[union-attr]  # nothing applied


def test_a_queued_delete_hides_the_stored_session(
    replicas: tuple[CheckpointClient, CheckpointClient],
) -> None:
    a, b = replicas
    a.store.save(make_checkpoint("s", version=5), seq=100)
    a.store.save(make_checkpoint("other", version=1), seq=100)
    handle = a.delete("s")
    cp, fence = b.load_with_fence("s")
    assert cp is None and fence is not None and fence.deleted and fence.seq == handle.seq
    assert b.list() == ["other"]


def test_a_pending_save_of_a_new_session_is_listed(
    replicas: tuple[CheckpointClient, CheckpointClient],
) -> None:
    a, b = replicas
    a.save(make_checkpoint("new", version=1))
    assert b.list() == ["new"]
    assert b.load("new") is not None


@pytest.mark.parametrize("op", ["save", "delete"])
def test_a_request_applied_between_the_listing_and_the_fences_is_listed_as_applied(
    replicas: tuple[CheckpointClient, CheckpointClient],
    monkeypatch: pytest.MonkeyPatch,
    op: str,
) -> None:
    a, b = replicas
    # Given a stored session, and a queued save of a new one or delete of the stored one
    a.store.save(make_checkpoint("old", version=1), seq=100)
    handle = a.save(make_checkpoint("new", version=1)) if op == "save" else a.delete("old")
    assert handle.seq is not None
    listing = b.store.list

    def worker_applies_it_after_the_listing() -> list[str]:
        listed = listing()
        if op == "save":
            a.store.save(make_checkpoint("new", version=1), seq=handle.seq)
        else:
            a.store.delete("old", seq=handle.seq)
        return listed

    # When a worker applies it after B's list read the store but before it read the fences
    monkeypatch.setattr(b.store, "list", worker_applies_it_after_the_listing)
    # Then B lists the session as the request left it (the fence, newer than the listing)
    assert b.list() == (["new", "old"] if op == "save" else [])


def test_the_store_answers_once_it_holds_the_records_request_or_a_newer_one(
    replicas: tuple[CheckpointClient, CheckpointClient],
) -> None:
    a, b = replicas
    handle = a.save(make_checkpoint("s", version=6))
    assert handle.seq is not None
    # A worker applied a newer request (its record already gone or never written)
    a.store.save(make_checkpoint("s", version=9), seq=handle.seq + 1)
    cp, fence = b.load_with_fence("s")
    assert cp is not None and cp.version == 9 and fence is not None and fence.seq == handle.seq + 1
    # And a stored delete newer than the record hides it
    a.store.delete("s", seq=handle.seq + 2)
    assert b.load("s") is None and b.list() == []


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-message"])
def test_the_entry_holds_the_value_exactly_as_the_store_will(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis, staged: bool
) -> None:
    a, _ = one_redis
    a.stage_saves = staged
    checkpoint = make_checkpoint("s", version=3, messages=150)  # over the 100-message cap
    handle = a.save(checkpoint)
    # One entry per request, named by its id; its value beside it, by session and request
    entries = redis_client.hgetall(KEYS.pending_requests("s"))
    assert entries == {handle.task_id.encode(): f"{handle.seq} save".encode()}
    value = redis_client.get(KEYS.pending_value("s", handle.task_id))
    assert value == a.store.encode(checkpoint).value
    loaded = a.load("s")
    assert loaded is not None and len(loaded.conversation_history) == 100
    # They live until the request's deadline (its seq + the TTL), and the index says so
    assert handle.seq is not None
    deadline_ms = handle.seq // 1000 + int(a.store.options.ttl_seconds * 1000)
    for key in (KEYS.pending_requests("s"), KEYS.pending_value("s", handle.task_id)):
        assert redis_client.pexpiretime(key) == deadline_ms
    assert redis_client.zscore(KEYS.pending_index(), "s") == deadline_ms


def test_a_save_the_worker_could_never_store_is_refused_at_once(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a store whose budget is smaller than one incompressible message
    client = _replica(redis_server.url, redis_server.url, max_value_bytes=4096)
    try:
        noise = ConversationMessage(role="user", content=os.urandom(16 * 1024).hex())
        big = make_checkpoint("s").model_copy(update={"conversation_history": [noise]})
        # When it is saved, Then save() raises the worker's own error, and nothing is queued
        with pytest.raises(CheckpointTooLarge, match="stored-size budget"):
            client.save(big)
        assert redis_client.llen(QUEUE) == 0
        assert not redis_client.exists(KEYS.pending_requests("s"))
    finally:
        client.close()


def test_a_load_on_one_redis_is_one_script_call(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    a, b = one_redis
    a.save(make_checkpoint("s", version=1))
    assert b.pending_records is not None and b.pending_records.one_redis
    b.load("s")  # the script is cached from here on
    redis_client.config_resetstat()
    b.load("s")
    stats = redis_client.info("commandstats")
    calls = {name: int(v["calls"]) for name, v in stats.items() if "config" not in name}
    # One EVALSHA; the rest are read_pending.lua's own (counted as well): the broker's time,
    # the entries, the earlier-layout record and the fence, the pending value and the epoch
    # (the stored value is not read: the pending save answers), the pending mark, the ring's
    # token of the mark b saw (its first load taught it one) and of the current mark, and
    # the session's index entry, count and number of entries (is one missing?)
    assert calls == {
        "cmdstat_evalsha": 1,
        "cmdstat_time": 1,
        "cmdstat_hgetall": 1,
        "cmdstat_hmget": 2,
        "cmdstat_get": 2,
        "cmdstat_hget": 4,
        "cmdstat_zscore": 1,
        "cmdstat_hlen": 1,
    }


def test_a_load_whose_broker_is_down_says_so_instead_of_serving_the_store(
    store_server: RedisServer,
) -> None:
    store_server.client().flushall()
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"
    client = _replica(dead_broker, store_server.url)
    try:
        client.store.save(make_checkpoint("s", version=5), seq=1)
        with pytest.raises(BrokerUnavailable, match="pending records"):
            client.load("s")
        with pytest.raises(BrokerUnavailable):
            client.list()
    finally:
        client.close()


def test_a_load_whose_one_redis_is_down_raises_store_unavailable() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    client = _replica(url, url)
    try:
        with pytest.raises(StoreUnavailable):
            client.load("s")
    finally:
        client.close()


def test_a_broker_that_lost_its_records_is_counted_and_loads_fall_back_to_the_store(
    two_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    a, b = two_redis
    a.store.save(make_checkpoint("s", version=5), seq=100)
    a.save(make_checkpoint("s", version=6))
    assert b.load("s").version == 6  # type: ignore[union-attr]
    assert b.epoch_changes == 0
    # When the broker loses everything (a restart without persistence)
    redis_client.flushall()
    # Then B's load reads the store and counts the loss once
    assert b.load("s").version == 5  # type: ignore[union-attr]
    assert b.load("s").version == 5  # type: ignore[union-attr]
    assert b.epoch_changes == 1
    # And a new epoch begun by A's next save is not another loss
    a.save(make_checkpoint("s", version=7))
    assert b.load("s").version == 7  # type: ignore[union-attr]
    assert b.epoch_changes == 1


def test_a_batch_writes_each_items_record_under_its_request_id(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    a, b = one_redis
    batching = BatchingClient(a, window_ms=60_000)
    try:
        first = batching.save(make_checkpoint("x", version=1))
        second = batching.save(make_checkpoint("x", version=2))
        gone = batching.delete("y")
        batching.flush()
        entries = redis_client.hgetall(KEYS.pending_requests("x"))
        assert sorted(entries) == sorted([first.request.encode(), second.request.encode()])
        (gone_entry,) = redis_client.hvals(KEYS.pending_requests("y"))
        assert gone_entry == f"{gone.seq} delete".encode()
        assert first.request != second.request and gone.request.endswith(":2")
        assert b.load("x").version == 2  # type: ignore[union-attr]
        assert b.load("y") is None and b.list() == ["x"]
    finally:
        batching.close()


def test_settling_removes_exactly_the_settled_requests_entry(redis_client: redis.Redis) -> None:
    # Given a session with a save and a delete stamped alike (issue 31, hole 2), each with
    # its entry, and a record of the earlier layout naming another request
    settle = redis_client.register_script(settle_source())
    redis_client.hset(KEYS.pending_requests("s"), mapping={"save": "20 save", "del": "20 delete"})
    redis_client.set(KEYS.pending_value("s", "save"), b"value")
    redis_client.hset(KEYS.pending("t"), mapping={"seq": 5, "op": "delete", "req": "old"})
    redis_client.zadd(KEYS.pending_index(), {"s": 2**50, "t": 2**50, "expired": 1})
    # When the save settles, and a request of "t" that is not the record's
    keys, args = settle_command(
        KEYS, [Settlement("s", "save", 20), Settlement("t", "other", 5, True)]
    )
    assert settle(keys=keys, args=args) == 1
    # Then the delete's entry stays (it is still on its way), the save's value is gone,
    # and "t"'s record stays; the expired index entry goes
    assert redis_client.hgetall(KEYS.pending_requests("s")) == {b"del": b"20 delete"}
    assert not redis_client.exists(KEYS.pending_value("s", "save"))
    assert redis_client.hget(KEYS.pending("t"), "req") == b"old"
    assert redis_client.zrange(KEYS.pending_index(), 0, -1) == [b"s", b"t"]
    # And once the delete and "t"'s own request settle, nothing is left
    keys, args = settle_command(
        KEYS, [Settlement("s", "del", 20, True), Settlement("t", "old", 5, True)]
    )
    assert settle(keys=keys, args=args) == 2
    assert not redis_client.exists(KEYS.pending_requests("s"), KEYS.pending("t"))
    assert redis_client.zcard(KEYS.pending_index()) == 0


def test_a_settle_that_carries_another_requests_id_settles_nothing_of_it(
    redis_client: redis.Redis,
) -> None:
    # Given a pending save with its value, and a message of its own session that carries its
    # request id with another stamp (a faulty producer's, which the worker dead-letters)
    settle = redis_client.register_script(settle_source())
    redis_client.hset(KEYS.pending_requests("s"), "victim", "20 save")
    redis_client.set(KEYS.pending_value("s", "victim"), b"value")
    redis_client.hset(KEYS.pending("s"), mapping={"seq": 20, "op": "save", "req": "victim"})
    # When the worker settles that message: another seq, another op, or no seq that parses
    for wrong in (Settlement("s", "victim", 21), Settlement("s", "victim", 20, True)):
        keys, args = settle_command(KEYS, [wrong])
        assert settle(keys=keys, args=args) == 0
    keys, args = settle_command(KEYS, [Settlement("s", "victim", None)])
    assert settle(keys=keys, args=args) == 0
    # Then the victim's entry, its record and its value all stay, for its own message
    assert redis_client.hgetall(KEYS.pending_requests("s")) == {b"victim": b"20 save"}
    assert redis_client.get(KEYS.pending_value("s", "victim")) == b"value"
    assert redis_client.hget(KEYS.pending("s"), "req") == b"victim"
    # And its own settle takes all of them
    keys, args = settle_command(KEYS, [Settlement("s", "victim", 20)])
    assert settle(keys=keys, args=args) == 2
    assert not redis_client.exists(
        KEYS.pending_requests("s"), KEYS.pending_value("s", "victim"), KEYS.pending("s")
    )


def test_the_epoch_watch_counts_each_loss_once() -> None:
    watch = EpochWatch()
    for epoch in (None, b"a", b"a", None, None, b"b", b"c", b"c"):
        watch.observe(epoch)
    # a -> lost (1), lost -> b is the new epoch, b -> c (2)
    assert watch.changes == 2


def test_a_broker_at_maxmemory_refuses_the_push_whole(
    two_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given a session with a pending save, and a broker that then refuses writes (a staged
    # save's value SET first: its refusal is the error raised)
    a, _ = two_redis
    first = a.save(make_checkpoint("oom", version=1))
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", max(1024 * 1024, used // 2))
    try:
        # When the next save of the session is pushed
        with pytest.raises(BrokerUnavailable, match="maxmemory"):
            a.save(make_checkpoint("oom", version=2))
        # Then nothing of it was written: one message queued, the first save's entry alone
        assert redis_client.llen(QUEUE) == 1
        assert redis_client.hkeys(KEYS.pending_requests("oom")) == [first.task_id.encode()]
        checkpoint = a.load("oom")
        assert checkpoint is not None and checkpoint.version == 1
    finally:
        redis_client.config_set("maxmemory", 0)


def test_publish_refuses_a_request_id_pending_in_its_session_as_another_request(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given a pending save of a session
    a, _ = one_redis
    records = a.pending_records
    assert records is not None
    handle = a.save(make_checkpoint("s", version=1))
    assert handle.seq is not None
    value = redis_client.get(KEYS.pending_value("s", handle.task_id))
    assert isinstance(value, bytes)

    def push(seq: int, op: str = SAVE_OP) -> None:
        write = RecordWrite("s", seq, op, handle.task_id, b"" if op == DELETE_OP else value)
        records.push(QUEUE, b"message", [write])

    # When the same request is published again (a retry whose first push landed), it is
    # taken: one more message, the same entry
    push(handle.seq)
    assert redis_client.llen(QUEUE) == 2
    # But under the same id another seq, or another op, is another request: refused at once
    # (a faulty producer reusing the id), and the entry and its value stay the first one's
    with pytest.raises(SeqRefused, match="request ids must be unique"):
        push(handle.seq + 1)
    with pytest.raises(SeqRefused, match="request ids must be unique"):
        push(handle.seq, DELETE_OP)
    assert redis_client.llen(QUEUE) == 2
    entries = redis_client.hgetall(KEYS.pending_requests("s"))
    assert entries == {handle.task_id.encode(): f"{handle.seq} save".encode()}
    assert redis_client.get(KEYS.pending_value("s", handle.task_id)) == value
    # And the same id in another session is another session's business
    records.push(QUEUE, b"message", [RecordWrite("t", handle.seq + 1, DELETE_OP, handle.task_id)])


def test_a_pending_save_is_judged_by_the_store_reads_time() -> None:
    # Given a pending save's entry, read from a broker of its own (alive then)
    seq = 1_800_000_000_000_000
    fields = (str(seq).encode(), b"save", b"req", b"value")
    ttl_ms = 60_000
    # When the store read comes before its deadline, it answers with its value
    live = _answering(fields, None, ttl_ms, seq // 1000 + ttl_ms - 1)
    assert live is not None and live.value == b"value" and not live.lapsed
    # But when the store read comes at or after its deadline (a newer fence may have expired
    # in between), it answers as lapsed: absent, never its value (the model's finding 1)
    late = _answering(fields, None, ttl_ms, seq // 1000 + ttl_ms)
    assert late is not None and late.lapsed and late.as_fence().lapsed


def _count(redis_client: redis.Redis, session_id: str) -> int:
    return int(redis_client.hget(KEYS.pending_counts(), session_id) or 0)


def _settle(redis_client: redis.Redis, *settled: Settlement) -> None:
    keys, args = settle_command(KEYS, settled)
    redis_client.register_script(settle_source())(keys=keys, args=args)


def test_a_duplicate_settle_spends_no_other_requests_count(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given two pending saves of a session, the second's entry deleted by hand
    a, _ = one_redis
    first = a.save(make_checkpoint("s", version=1))
    second = a.save(make_checkpoint("s", version=2))
    redis_client.hdel(KEYS.pending_requests("s"), second.task_id)
    assert _count(redis_client, "s") == 2
    # When the first settles, and then again (a redelivered duplicate)
    _settle(redis_client, Settlement("s", first.task_id, first.seq))
    _settle(redis_client, Settlement("s", first.task_id, first.seq))
    # Then the second is still counted: loads refuse while it is queued
    assert _count(redis_client, "s") == 1
    with pytest.raises(PendingRecordMissing):
        a.load("s")
    # And its own settle spends it, once: loads answer again
    _settle(redis_client, Settlement("s", second.task_id, second.seq))
    _settle(redis_client, Settlement("s", second.task_id, second.seq))
    assert not redis_client.hexists(KEYS.pending_counts(), "s")
    assert not redis_client.exists(KEYS.pending_counted("s"))
    assert a.load("s") is None  # (nothing applied the saves here)


def test_a_settle_of_a_request_the_count_does_not_include_spends_nothing(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given a pending save whose entry was deleted by hand
    a, _ = one_redis
    handle = a.save(make_checkpoint("s", version=1))
    redis_client.delete(KEYS.pending_requests("s"))
    # When a request of the session whose records are gone settles (published before the
    # broker lost its data, or expired), or one under the save's id with another stamp
    assert handle.seq is not None
    _settle(redis_client, Settlement("s", "gone", handle.seq - 1))
    _settle(redis_client, Settlement("s", handle.task_id, handle.seq, True))
    # Then the save is still counted, its value kept: loads refuse
    assert _count(redis_client, "s") == 1
    assert redis_client.exists(KEYS.pending_value("s", handle.task_id))
    with pytest.raises(PendingRecordMissing):
        a.load("s")


def test_a_request_published_again_after_its_entry_was_lost_is_counted_once(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given a pending delete whose entry was deleted by hand
    a, _ = one_redis
    records = a.pending_records
    assert records is not None
    handle = a.delete("s")
    assert handle.seq is not None
    redis_client.delete(KEYS.pending_requests("s"))
    # When it is published again (same id, same stamp: a retry, a recovery)
    records.push(QUEUE, b"message", [RecordWrite("s", handle.seq, DELETE_OP, handle.task_id)])
    # Then it is counted once, and its settle spends it
    assert _count(redis_client, "s") == 1
    _settle(redis_client, Settlement("s", handle.task_id, handle.seq, True))
    assert not redis_client.hexists(KEYS.pending_counts(), "s")
    # But another request under its id, while it is counted with its entry gone, is refused
    handle = a.delete("s")
    assert handle.seq is not None
    redis_client.delete(KEYS.pending_requests("s"))
    with pytest.raises(SeqRefused, match="request ids must be unique"):
        records.push(QUEUE, b"m", [RecordWrite("s", handle.seq + 1, DELETE_OP, handle.task_id)])


def test_a_count_from_a_publish_before_the_counted_requests_is_still_spent(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given two requests counted by an earlier release's publish (an entry, a count, no
    # counted field), both entries deleted by hand
    a, _ = one_redis
    seq = a.delete("s").seq
    assert seq is not None
    redis_client.delete(KEYS.pending_requests("s"), KEYS.pending_counted("s"))
    redis_client.hset(KEYS.pending_counts(), "s", 2)
    # When one settles, then again (a duplicate), then the other
    _settle(redis_client, Settlement("s", "old-1", seq, True))
    assert _count(redis_client, "s") == 1
    with pytest.raises(PendingRecordMissing):
        a.load("s")
    # Then the rule before the counted requests spends what is left of the old count: a
    # duplicate may spend it early, as it did before (docs/reliability.md)
    _settle(redis_client, Settlement("s", "old-1", seq, True))
    assert not redis_client.hexists(KEYS.pending_counts(), "s")
    # And no more than it holds
    _settle(redis_client, Settlement("s", "old-2", seq, True))
    assert not redis_client.hexists(KEYS.pending_counts(), "s")


def test_a_count_left_by_entries_that_expired_is_reset_by_the_next_publish(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given a session whose pending entries expired with their deadline (a worker that never
    # settled them), their count left behind
    a, _ = one_redis
    a.save(make_checkpoint("s", version=1))
    redis_client.delete(KEYS.pending_requests("s"), KEYS.pending_counted("s"))
    redis_client.zadd(KEYS.pending_index(), {"s": 1})
    assert _count(redis_client, "s") == 1
    # When the session is saved again
    handle = a.save(make_checkpoint("s", version=2))
    # Then the old count is gone and the new request counted once: loads answer it
    assert _count(redis_client, "s") == 1
    loaded = a.load("s")
    assert loaded is not None and loaded.version == 2
    # And both of its keys live until its deadline, as its index entry says
    due = redis_client.zscore(KEYS.pending_index(), "s")
    assert handle.seq is not None and due == handle.seq // 1000 + _ttl_ms(a)
    for key in (KEYS.pending_requests("s"), KEYS.pending_counted("s")):
        assert redis_client.pexpiretime(key) == due


def test_a_publish_after_the_last_settle_gives_both_keys_its_deadline(
    one_redis: tuple[CheckpointClient, CheckpointClient], redis_client: redis.Redis
) -> None:
    # Given a session whose worker settled everything it had (both of its keys gone)
    a, _ = one_redis
    first = a.save(make_checkpoint("s", version=1))
    assert first.seq is not None
    _settle(redis_client, Settlement("s", first.task_id, first.seq))
    assert not redis_client.exists(KEYS.pending_requests("s"), KEYS.pending_counted("s"))
    # When it is saved again, twice (its keys new, then there)
    second = a.save(make_checkpoint("s", version=2))
    third = a.save(make_checkpoint("s", version=3))
    # Then each key lives until the latest request's deadline, and both are counted
    assert third.seq is not None and second.seq is not None
    due = third.seq // 1000 + _ttl_ms(a)
    for key in (KEYS.pending_requests("s"), KEYS.pending_counted("s")):
        assert redis_client.pexpiretime(key) == due
    assert _count(redis_client, "s") == 2
    loaded = a.load("s")
    assert loaded is not None and loaded.version == 3


def _ttl_ms(client: CheckpointClient) -> int:
    records = client.pending_records
    assert records is not None
    return records.ttl_ms
