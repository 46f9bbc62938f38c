"""The asyncio client keeps what #41 and #44 promise the sync one, through the shared core
(``requests.Requests``, ``pending.RecordCalls``): sealed staged saves with encryption on, a
refusal where a batch would carry a checkpoint in clear, loads and lists that refuse when a
pending record is missing, and a broker gone back in time found and recovered from.
Real redis-server, no worker (tests/faults/test_broker_faults.py has the sync side with one)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from checkpointq import (
    AsyncBatchingClient,
    AsyncCheckpointClient,
    ConversationMessage,
    EncryptionError,
    Keyring,
    PendingRecordMissing,
    RedisStore,
    StoreOptions,
)
from checkpointq.store.encryption import generate_key
from checkpointq.tasks.messages import SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.pending import MARK_TOKEN_SLOTS, ring_field
from tests.support.checkpoints import make_checkpoint
from tests.support.redis_contents import everything_in
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration

SECRET = "the-patient-said-a-very-private-thing"


@pytest.fixture
def broker(redis_server: RedisServer, redis_client: redis.Redis) -> RedisServer:
    """The private redis-server, emptied (by ``redis_client``) for the test."""
    return redis_server


def test_an_encrypted_async_client_puts_no_clear_byte_on_the_broker(broker: RedisServer) -> None:
    ring = Keyring.parse(f"k1:{generate_key()}")
    store = RedisStore.from_url(broker.url, options=StoreOptions(encryption=ring))
    checkpoint = make_checkpoint("sealed-async", version=2).model_copy(
        update={"conversation_history": [ConversationMessage(role="user", content=SECRET)]}
    )

    async def main() -> None:
        # stage_saves=False is overridden: an encrypted save is always staged, sealed
        async with AsyncCheckpointClient(broker.url, store, stage_saves=False) as client:
            assert client.encrypted and client.stage_saves
            handle = await client.save(checkpoint)
            assert handle.task == SAVE_STAGED
            client.stage_saves = False  # and so is it when turned off later
            assert (await client.save(checkpoint)).task == SAVE_STAGED
            loaded = await client.load("sealed-async")
            assert loaded is not None and loaded.conversation_history[0].content == SECRET
            with pytest.raises(EncryptionError, match="in clear"):
                AsyncBatchingClient(client)

    asyncio.run(main())
    raw = everything_in(broker.client())
    assert b"sealed-async" in raw  # the session's keys are there: the scan saw them
    assert SECRET.encode() not in raw


def test_an_async_load_and_list_refuse_when_a_pending_record_is_missing(
    broker: RedisServer,
) -> None:
    store = RedisStore.from_url(broker.url)

    async def main() -> None:
        async with AsyncCheckpointClient(broker.url, store) as client:
            await client.save(make_checkpoint("gone-async", version=1))
            # When an operator deletes the session's pending entries (its message stays)
            await client.reader.delete(client.records.keys.pending_requests("gone-async"))
            # Then the load refuses rather than serve the store's older state (none here)
            with pytest.raises(PendingRecordMissing, match="missing on the broker"):
                await client.load("gone-async")
            with pytest.raises(PendingRecordMissing, match="missing on"):
                await client.list()

    asyncio.run(main())


def test_an_async_client_finds_a_broker_gone_back_in_time_and_republishes(
    broker: RedisServer,
) -> None:
    store = RedisStore.from_url(broker.url)
    sessions = [f"back-{n}" for n in range(3)]
    queue_client = broker.client()

    async def main() -> None:
        async with AsyncCheckpointClient(broker.url, store) as client:
            for session_id in sessions:
                await client.save(make_checkpoint(session_id, version=1))
            assert await client.load(sessions[0]) is not None
            mark_key = client.records.keys.pending_mark()
            mark = int(queue_client.hget(mark_key, "n") or 0)
            queued = queue_client.llen("checkpoints")
            # When the broker comes back with a mark below the one this client saw (a
            # crash inside its fsync window, a failover to a lagging replica)
            queue_client.hset(mark_key, "n", mark - 2)
            # Then its next load counts the loss once and republishes its window
            assert await client.load(sessions[1]) is not None
            assert client.epoch_changes == 1
            assert client.records.republished == len(sessions)
            assert queue_client.llen("checkpoints") == queued + len(sessions)
            # And a sync replica sees the turned epoch as that loss, not a new one of its own
            replica = CheckpointClient(broker.url, RedisStore.from_url(broker.url))
            try:
                assert replica.load(sessions[2]) is not None
            finally:
                replica.close()

    asyncio.run(main())


def test_an_async_client_finds_a_loss_unaware_publishes_covered_up_by_the_marks_token(
    broker: RedisServer,
) -> None:
    store = RedisStore.from_url(broker.url)
    raw = broker.client()

    async def main() -> None:
        async with AsyncCheckpointClient(broker.url, store) as client:
            await client.save(make_checkpoint("token-a", version=1))
            await client.save(make_checkpoint("token-b", version=1))
            mark_key = client.records.keys.pending_mark()
            mark = int(raw.hget(mark_key, "n") or 0)
            # When the broker lost this client's last publish and another client's publish,
            # unaware, took its mark again (the counter alone shows nothing)
            raw.hset(mark_key, ring_field(mark), f"{mark}:0123456789abcdef")
            # Then its next load counts the loss once and republishes its window
            assert await client.load("token-a") is not None
            assert client.epoch_changes == 1
            assert client.records.republished == 2

    asyncio.run(main())


def test_a_publish_finds_a_loss_by_its_mark_token_and_turns_the_epoch(
    broker: RedisServer,
) -> None:
    raw = broker.client()
    client = CheckpointClient(broker.url, RedisStore.from_url(broker.url))
    records = client.pending_records
    assert records is not None
    mark_key, epoch_key = records.keys.pending_mark(), records.keys.pending_epoch()
    try:
        client.save(make_checkpoint("token-c", version=1))
        client.save(make_checkpoint("token-d", version=1))
        mark, epoch = int(raw.hget(mark_key, "n") or 0), raw.get(epoch_key)
        # When another publish, unaware of a loss, took this client's last mark again
        raw.hset(mark_key, ring_field(mark), f"{mark}:0123456789abcdef")
        # Then this client's next publish (publish.lua) finds it: the epoch turns, the loss
        # is counted once, recorded for health, and the window republished
        client.save(make_checkpoint("token-c", version=2))
        assert raw.get(epoch_key) != epoch
        assert client.epoch_changes == 1
        assert records.republished == 3
        lost = raw.hmget(mark_key, "losses", "lost_seen", "lost_mark")
        assert lost == [b"1", str(mark).encode(), b"-1"]
    finally:
        client.close()


def test_publishes_that_write_no_token_and_an_overwritten_slot_are_no_loss(
    broker: RedisServer,
) -> None:
    raw = broker.client()
    client = CheckpointClient(broker.url, RedisStore.from_url(broker.url))
    records = client.pending_records
    assert records is not None
    mark_key = records.keys.pending_mark()
    try:
        client.save(make_checkpoint("token-e", version=1))
        mark = int(raw.hget(mark_key, "n") or 0)
        # When clients from before the token publish (the counter advances, no ring slot)
        raw.hincrby(mark_key, "n", 5)
        # Then this client's load and publish find no loss: its mark's slot is its own
        assert client.load("token-e") is not None
        client.save(make_checkpoint("token-e", version=2))
        assert client.epoch_changes == 0
        # And a slot overwritten by a mark 65536 publishes on tells nothing either
        mark = int(raw.hget(mark_key, "n") or 0)
        raw.hset(mark_key, ring_field(mark), f"{mark + MARK_TOKEN_SLOTS}:0123456789abcdef")
        assert client.load("token-e") is not None
        client.save(make_checkpoint("token-e", version=3))
        assert client.epoch_changes == 0 and records.republished == 0
    finally:
        client.close()
