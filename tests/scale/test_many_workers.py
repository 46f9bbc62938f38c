"""Four workers on one queue keep every guarantee of one: ordering by ``seq``, tombstones,
each expired session swept once.

The load is pushed as raw protocol 2 envelopes (docs/protocol.md), all at once (a RENAME of
a staging list onto the queue), so that the workers race for every session.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from checkpointq.store.base import StoreOptions
from checkpointq.store.keys import KeySpace
from checkpointq.store.redis import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.messages import DELETE, EXPIRE_STALE, SAVE
from checkpointq.worker.ops.health import live_workers
from tests.scale.conftest import Fleet, RedisQueueProbe, wait_drained
from tests.scale.load import all_applied, expected_state, mismatches, mixed_load
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import QUEUE

pytestmark = pytest.mark.integration

WORKERS = 4
STAGING = "scale-staging"


@pytest.fixture(scope="module")
def fleet(broker_server: RedisServer, store_server: RedisServer) -> Iterator[Fleet]:
    fleet = Fleet.of(broker_url=broker_server.url, store_url=store_server.url, concurrency=1)
    try:
        yield fleet.start_workers(WORKERS)
    finally:
        fleet.stop()


@pytest.fixture
def store(fleet: Fleet, store_client: redis.Redis) -> Iterator[RedisStore]:
    store = RedisStore.from_url(fleet.settings.resolved_store_url or "")
    yield store
    store.close()


def push_all_at_once(broker: redis.Redis, envelopes: list[str]) -> None:
    pipe = broker.pipeline(transaction=False)
    for envelope in envelopes:
        pipe.lpush(STAGING, envelope)
    pipe.execute()
    broker.rename(STAGING, QUEUE)


def tasks_run_per_worker(store_client: redis.Redis, keys: KeySpace) -> dict[str, int]:
    """Requests each worker has finished, from the totals in its heartbeat."""
    return {
        beat["worker"]: sum(beat["totals"]["requests"].values())
        for beat in live_workers(store_client, keys)
    }


def test_shuffled_duplicated_load_ends_exact(
    fleet: Fleet, broker_server: RedisServer, store: RedisStore, store_client: redis.Redis
) -> None:
    # Given 100 sessions x 6 saves and deletes, each request three times, shuffled
    load = mixed_load("many", sessions=100, per_session=6, seed=11, duplicates=3)
    envelopes = []
    for request in load:
        if request.version is None:
            envelopes.append(protocol2(DELETE, [request.session_id], {"seq": request.seq}))
        else:
            cp = make_checkpoint(request.session_id, version=request.version)
            envelopes.append(protocol2(SAVE, [checkpoint_to_wire(cp)], {"seq": request.seq}))
    keys = KeySpace(fleet.settings.key_prefix)
    wait_until(
        lambda: len(tasks_run_per_worker(store_client, keys)) == WORKERS,
        timeout=10,
        message="a heartbeat from every worker",
    )
    before = tasks_run_per_worker(store_client, keys)
    # When they land on the queue at once and four workers race for them
    broker = broker_server.client()
    push_all_at_once(broker, envelopes)
    expected = expected_state(load)
    wait_until(lambda: all_applied(store, expected), timeout=90, message="the load applied")
    wait_drained(RedisQueueProbe(broker_server.client), timeout=60)
    # Then per session the highest seq won, and deleted sessions stay deleted
    assert mismatches(store, expected) == []
    # and every worker took part
    wait_until(
        lambda: (
            sum(tasks_run_per_worker(store_client, keys).values())
            == sum(before.values()) + len(load)
        ),
        timeout=10,
        message="heartbeats counting every request",
    )
    after = tasks_run_per_worker(store_client, keys)
    shares = sorted(after[name] - before[name] for name in before)
    print(f"requests per worker: {shares} of {len(load)}")
    assert all(share > 0 for share in shares), shares
    broker.close()


def test_concurrent_sweeps_expire_each_session_once(
    fleet: Fleet, broker_server: RedisServer, store: RedisStore, store_client: redis.Redis
) -> None:
    keys = KeySpace(fleet.settings.key_prefix)
    # Given 300 sessions saved with a lifetime that is already over
    short = RedisStore(store_client, options=StoreOptions(ttl_seconds=0.001))
    for i in range(300):
        short.save(make_checkpoint(f"stale-{i}"), seq=1_000 + i)
    wait_until(lambda: short.load("stale-299") is None, timeout=10, message="expiry")
    # When eight sweeps are queued at once for four workers
    broker = broker_server.client()
    push_all_at_once(broker, [protocol2(EXPIRE_STALE, [], {}) for _ in range(8)])
    broker.close()
    wait_drained(RedisQueueProbe(broker_server.client), timeout=60)
    wait_until(lambda: store_client.zcard(keys.index()) == 0, timeout=30, message="swept")
    # Then each session was expired, and announced, exactly once
    events: Any = store_client.xrange(keys.events())
    expired = Counter(
        fields[b"session_id"].decode() for _, fields in events if fields[b"type"] == b"expired"
    )
    assert set(expired) == {f"stale-{i}" for i in range(300)}
    assert set(expired.values()) == {1}
