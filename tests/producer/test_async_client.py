"""The asyncio producer: the sync client's requests and records on ``redis.asyncio``, against
real redis-servers (no worker consumes here: tests/worker/test_async_e2e.py has one).

Each test runs its own event loop (``asyncio.run``); sync clients play other replicas."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
import redis

from checkpointq import (
    AsyncBatchingClient,
    AsyncCheckpointClient,
    CheckpointError,
    InvalidInput,
    RedisStore,
)
from checkpointq.store.errors import InvalidCheckpoint, StoreNotConfigured
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.worker.settings import InvalidSettings, Settings
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration

QUEUE = "checkpoints"


def _sync(broker_url: str, store_url: str) -> CheckpointClient:
    return CheckpointClient(broker_url, RedisStore.from_url(store_url), queue=QUEUE)


def _async(broker_url: str, store_url: str, **options: Any) -> AsyncCheckpointClient:
    return AsyncCheckpointClient(broker_url, RedisStore.from_url(store_url), **options)


@pytest.fixture(params=["one_redis", "two_redis"])
def urls(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    redis_client: redis.Redis,
) -> Iterator[tuple[str, str]]:
    """(broker URL, store URL): one Redis for both, or a second one for the store."""
    if request.param == "one_redis":
        yield redis_server.url, redis_server.url
        return
    store_server: RedisServer = request.getfixturevalue("store_server")
    store_server.client().flushall()
    yield redis_server.url, store_server.url


def _run(
    broker_url: str, store_url: str, body: Callable[[AsyncCheckpointClient], Awaitable[None]]
) -> None:
    async def main() -> None:
        async with _async(broker_url, store_url) as client:
            await body(client)

    asyncio.run(main())


def test_an_async_save_is_what_sync_and_async_replicas_load(urls: tuple[str, str]) -> None:
    # Given an async client and a sync replica, no worker,
    # When the async client saves,
    # Then both load the save (from its pending record) and list the session.
    broker_url, store_url = urls
    replica = _sync(broker_url, store_url)

    async def body(client: AsyncCheckpointClient) -> None:
        handle = await client.save(make_checkpoint("async-a", version=3))
        assert handle.seq is not None and handle.session_id == "async-a"
        loaded = await client.load("async-a")
        assert loaded is not None and loaded.version == 3
        other = replica.load("async-a")
        assert other is not None and other.version == 3
        assert "async-a" in await client.list()
        assert (await client.pending_record("async-a")) is not None

    try:
        _run(broker_url, store_url, body)
    finally:
        replica.close()


def test_publishes_go_hand_sent_not_through_the_pipeline(urls: tuple[str, str]) -> None:
    # Given an async client whose broker pipeline must not be used (redis_hooks_aio)
    async def body(client: AsyncCheckpointClient) -> None:
        client.broker.pipeline = None  # type: ignore[assignment,method-assign]
        # When it saves, deletes, refreshes and sweeps
        saved = await client.save(make_checkpoint("hand-sent"))
        await client.refresh("hand-sent")
        await client.sweep()
        # Then each was published, and the save loads
        loaded = await client.load("hand-sent")
        assert loaded is not None and saved.seq is not None
        await client.delete("hand-sent")
        assert await client.load("hand-sent") is None

    _run(*urls, body)


def test_a_dict_and_a_model_save_alike_and_load_returns_the_model(urls: tuple[str, str]) -> None:
    broker_url, store_url = urls

    async def body(client: AsyncCheckpointClient) -> None:
        await client.save({"sessionId": "async-dict", "version": 2, "metadata": {}})
        loaded = await client.load("async-dict")
        assert loaded is not None and loaded.session_id == "async-dict" and loaded.version == 2
        with pytest.raises(InvalidCheckpoint):
            await client.save({"version": 2})

    _run(broker_url, store_url, body)


def test_an_async_delete_hides_a_sync_save_and_orders_after_its_load(
    urls: tuple[str, str],
) -> None:
    # Given a session a sync replica saved,
    # When the async client loads it and then deletes it,
    # Then the delete sorts after the loaded fence and every replica reads the session gone.
    broker_url, store_url = urls
    replica = _sync(broker_url, store_url)
    saved = replica.save(make_checkpoint("async-del", version=1))

    async def body(client: AsyncCheckpointClient) -> None:
        checkpoint, fence = await client.load_with_fence("async-del")
        assert checkpoint is not None and fence is not None and fence.seq == saved.seq
        handle = await client.delete("async-del")
        assert handle.seq is not None and handle.seq > fence.seq
        assert await client.load("async-del") is None
        assert "async-del" not in await client.list()

    try:
        _run(broker_url, store_url, body)
        assert replica.load("async-del") is None
    finally:
        replica.close()


def _queued_sessions(broker: redis.Redis) -> list[str]:
    """The session named by each message on the queue (its argsrepr), oldest first."""
    names = []
    for raw in reversed(broker.lrange(QUEUE, 0, -1)):
        argsrepr = orjson.loads(raw)["headers"]["argsrepr"]
        names.append(argsrepr.split("'")[1])
    return names


def test_a_cancelled_save_was_accepted_whole_or_not_at_all(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given saves cancelled after 0 to 40 turns of the event loop (before, while and after
    # their script call is on the wire; every third while the broker holds writes for 20 ms,
    # so that the call is still unanswered when the cancellation comes),
    # When each session's pending record and the queue are read,
    # Then a session has its message exactly when it has its record: never one alone.
    url = redis_server.url
    attempts = 120

    async def main() -> list[bool]:
        async with _async(url, url) as client:
            for n in range(attempts):
                if n % 3 == 0:
                    redis_client.client_pause(20, all=False)
                task = asyncio.create_task(client.save(make_checkpoint(f"cancel-{n}")))
                for _ in range(n % 41):
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                redis_client.client_unpause()
            # The connection a cancellation dropped is replaced: the client goes on working.
            await client.save(make_checkpoint("after-cancel"))
            assert await client.load("after-cancel") is not None
            return [await client.pending_record(f"cancel-{n}") is not None for n in range(attempts)]

    recorded = asyncio.run(main())
    queued = set(_queued_sessions(redis_client))
    accepted = [n for n in range(attempts) if f"cancel-{n}" in queued]
    assert [n for n in range(attempts) if recorded[n]] == accepted
    assert 0 < len(accepted) < attempts, "both fates should occur"


def test_a_silent_broker_raises_broker_unavailable_without_blocking_the_loop() -> None:
    # Given a broker that accepts connections and never answers,
    # When a save is awaited beside a ticking coroutine,
    # Then the save raises BrokerUnavailable and the ticker kept running meanwhile.
    # A listening socket that never accepts: the kernel completes each connection, and no
    # byte ever comes back.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        policy = {"max_retries": 0}

        async def main() -> tuple[int, float]:
            client = AsyncCheckpointClient(url, RedisStore.from_url(url), retry_policy=policy)
            ticks = 0
            stop = asyncio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.01)

            ticking = asyncio.create_task(ticker())
            started = time.monotonic()
            try:
                with pytest.raises(BrokerUnavailable):
                    await client.save(make_checkpoint("silent"))
            finally:
                stop.set()
                await ticking
                await client.close()
            return ticks, time.monotonic() - started

        ticks, took = asyncio.run(main())
    # ~1 s of socket timeout: a blocked loop would have ticked once or twice.
    assert ticks > 10 * took, (ticks, took)


def test_unsupported_brokers_and_missing_settings_raise_checkpoint_errors() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0")
    with pytest.raises(InvalidInput, match="Redis brokers only"):
        AsyncCheckpointClient("amqp://guest@127.0.0.1//", store)
    with pytest.raises(StoreNotConfigured) as raised:
        # (what Settings() holds where no broker is configured and no `up` runs)
        AsyncCheckpointClient.from_settings(cast(Settings, SimpleNamespace(broker_url=None)))
    assert isinstance(raised.value, CheckpointError)
    # and a refused setting (pydantic's ValidationError before)
    with pytest.raises(InvalidSettings, match="unsupported broker URL scheme") as refused:
        Settings(broker_url="ftp://127.0.0.1/")
    assert isinstance(refused.value, CheckpointError) and "ftp://127.0.0.1" not in str(
        refused.value
    )
    # the sync client too (it raised a bare ValueError before)
    with pytest.raises(StoreNotConfigured, match="no broker URL"):
        CheckpointClient.from_settings(cast(Settings, SimpleNamespace(broker_url=None)))


def test_concurrent_batched_saves_travel_in_one_message_and_a_cancelled_one_goes_too(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given an AsyncBatchingClient with a 50 ms window and no worker,
    # When 10 handlers save at once, and an 11th is cancelled while it waits for the batch,
    # Then one apply_batch message carries all 11, each handle names its own item, and every
    # session loads its save from its pending record (the cancelled one's too).
    url = redis_server.url

    async def main() -> list[Handle]:
        async with AsyncBatchingClient(_async(url, url), window_ms=50) as batching:
            cancelled = asyncio.create_task(batching.save(make_checkpoint("batched-10")))
            saves = asyncio.gather(
                *(batching.save(make_checkpoint(f"batched-{n}")) for n in range(10))
            )
            await _cancel_soon(cancelled)
            handles = await saves
            for n in range(11):
                loaded = await batching.load(f"batched-{n}")
                assert loaded is not None and loaded.session_id == f"batched-{n}"
            return handles

    handles = asyncio.run(main())
    (message,) = redis_client.lrange(QUEUE, 0, -1)
    assert orjson.loads(message)["headers"]["task"] == "checkpoint.apply_batch"
    assert {h.task_id for h in handles} == {handles[0].task_id}
    assert sorted(h.request for h in handles) == sorted(
        f"{handles[0].task_id}:{i}" for i in range(1, 11)
    )


async def _cancel_soon(task: asyncio.Task[Any]) -> None:
    await asyncio.sleep(0.005)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_loads_from_a_store_refusing_writes_are_answered_though_no_identity_can_be_made(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a session saved, then the Redis (broker and store) out of memory, refusing writes,
    # When fresh clients (whose store check must make the store's identity) load it,
    # Then they answer from the pending record: the check waits for a later read.
    url = redis_server.url
    writer = _sync(url, url)
    writer.save(make_checkpoint("oom-load", version=4))
    writer.close()
    redis_client.delete(RedisStore.from_url(url).keys.identity())
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)
    try:
        reader = _sync(url, url)
        try:
            loaded = reader.load("oom-load")
            assert loaded is not None and loaded.version == 4
            assert not reader.store_check.agreed
        finally:
            reader.close()

        async def main() -> int | None:
            async with _async(url, url) as client:
                checkpoint = await client.load("oom-load")
                return None if checkpoint is None else checkpoint.version

        assert asyncio.run(main()) == 4
    finally:
        redis_client.config_set("maxmemory", 0)


def test_concurrent_loads_and_saves_on_one_redis_find_no_broker_loss(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given one Redis for broker and store, and many handlers taking turns concurrently
    # (each load's reply races with other handlers' publishes on other connections)
    async def main() -> int:
        async with _async(redis_server.url, redis_server.url) as client:

            async def handler(n: int) -> None:
                for turn in range(15):
                    await client.load(f"racing-{n}")
                    await client.save(make_checkpoint(f"racing-{n}", version=turn + 1))

            await asyncio.gather(*(handler(n) for n in range(40)))
            return client.epoch_changes

    # Then no load took the others' publishes for a broker gone back in time (a false
    # loss republishes the whole recovery window)
    assert asyncio.run(main()) == 0


def test_a_kept_publishing_connection_the_broker_closed_is_replaced_within_the_save(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given an async client whose kept publishing connection the broker has closed
    async def main() -> bool:
        async with _async(redis_server.url, redis_server.url) as client:
            await client.save(make_checkpoint("kept-1"))
            ((kept_id,),) = [await client.round_trip([("CLIENT", "ID")])]
            assert redis_client.client_kill_filter(_id=kept_id) == 1
            # When it saves again, Then the save succeeds (on a new connection) and loads
            await client.save(make_checkpoint("kept-2"))
            return await client.load("kept-2") is not None

    assert asyncio.run(main())
