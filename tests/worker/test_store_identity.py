"""One deployment, one truth: a producer whose store is not the one the broker's workers
write to fails, naming both, instead of reading stale data (tests/worker/conftest.py: a real
worker, broker and store apart)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from checkpointq import AsyncCheckpointClient, CheckpointClient, RedisStore
from checkpointq.store.keys import KeySpace
from checkpointq.tasks.errors import StoreMismatch
from checkpointq.tasks.store_identity import PublishedStore
from checkpointq.worker.ops import health
from checkpointq.worker.settings import Settings
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration


def _announced(deployment: Deployment) -> PublishedStore:
    """The worker's announcement, once it made one (its first heartbeat)."""
    key = KeySpace(deployment.settings.key_prefix).published_store()
    broker = deployment.broker_client()
    try:
        wait_until(lambda: broker.get(key) is not None, timeout=30, message="an announcement")
        published = PublishedStore.decode(broker.get(key))
    finally:
        broker.close()
    assert published is not None
    return published


def _other_store(deployment: Deployment) -> RedisStore:
    """The broker's Redis as a store (what a second shell reads when it only knows the
    broker), in use since a minute ago: it has an identity of its own."""
    store = RedisStore.from_url(deployment.broker.url)
    store.client.set(store.keys.identity(), f"{uuid.uuid4()}@{int(time.time() * 1000) - 60_000}")
    return store


def test_a_producer_on_another_store_fails_at_once_naming_both(deployment: Deployment) -> None:
    # Given a worker writing to the store Redis, and a producer whose store is the broker's
    # Redis (with an identity of its own),
    # When the producer loads, lists and waits,
    # Then each raises StoreMismatch naming both stores and both identities.
    published = _announced(deployment)
    store = _other_store(deployment)
    mine = store.identity()
    client = CheckpointClient(deployment.broker.url, store, queue=deployment.settings.queue)
    try:
        with pytest.raises(StoreMismatch) as raised:
            client.load("identity-a")
        message = str(raised.value)
        for part in (mine, published.identity, repr(store), published.store):
            assert part in message
        with pytest.raises(StoreMismatch):
            client.list()
        handle = client.save(make_checkpoint("identity-a"))  # the workers' store takes it
        with pytest.raises(StoreMismatch):
            client.wait_durable(handle, timeout=5)
    finally:
        client.close()

    async def main() -> None:
        async with AsyncCheckpointClient(deployment.broker.url, _other_store(deployment)) as a:
            with pytest.raises(StoreMismatch):
                await a.load("identity-a")

    asyncio.run(main())


def test_a_producer_on_the_workers_store_agrees_and_checks_no_more(
    deployment: Deployment,
) -> None:
    _announced(deployment)
    client = deployment.checkpoint_client()
    try:
        assert client.load("identity-b") is None
        assert client.store_check.agreed
    finally:
        client.close()


def test_a_store_emptied_since_the_announcement_is_not_called_another(
    deployment: Deployment,
) -> None:
    # Given an announcement, then the store emptied (its identity gone with it),
    # When a producer on that store loads (making the store a new identity),
    # Then it reads without error: the announcement predates the identity it compares with.
    _announced(deployment)
    deployment.store_client().flushall()
    client = deployment.checkpoint_client()
    try:
        assert client.load("identity-c") is None
    finally:
        client.close()


def test_health_says_when_this_configuration_reads_another_store(
    deployment: Deployment,
) -> None:
    _announced(deployment)
    _other_store(deployment).close()
    values = deployment.settings.model_dump()
    values["store_url"] = deployment.broker.url
    report = health.check(Settings(**values))
    (one_store,) = [c for c in report.checks if c.name == "one store"]
    assert not one_store.ok and "identity" in one_store.detail, one_store
    assert not report.ok
