"""End to end with Redis Sentinel as the broker, through a broker failover.

A master, a replica and three sentinels started for the module; the store is a separate
private Redis (a Sentinel broker cannot double as the store). The failover test kills the
master with SIGKILL while a client keeps saving, and reports what was lost: Redis
replicates asynchronously, so a message the master acknowledged but had not yet streamed to
its replica dies with it. What the test asserts is what can be guaranteed: every publish
either returned or raised ``BrokerUnavailable``, every request published once the promotion
was seen is applied, nothing appears that was not sent, and the same client and workers
carry on without a restart.

``CHECKPOINTQ_FAILOVER_ROUNDS=5 pytest tests/scale/test_sentinel.py -k failover -s`` runs
several failovers in a row (the killed master rejoins as a replica each time) and prints the
figures of each round.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from tests.scale.conftest import (
    RESUMED,
    Fleet,
    RedisQueueProbe,
    store_out_of_memory,
    wait_drained,
)
from tests.support.checkpoints import make_checkpoint
from tests.support.sentinel import MASTER_NAME, SentinelGroup
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import QUEUE

pytestmark = pytest.mark.integration

#: Saves that must succeed after each promotion before a round ends.
AFTER_PROMOTION = 150


@pytest.fixture(scope="module")
def group(sentinel_group: SentinelGroup) -> SentinelGroup:
    """The module's group (``conftest.sentinel_group``), killed and healed by the tests."""
    return sentinel_group


@pytest.fixture(scope="module")
def fleet(group: SentinelGroup, store_server: RedisServer) -> Iterator[Fleet]:
    fleet = Fleet.of(
        broker_url=group.broker_url, sentinel_master=MASTER_NAME, store_url=store_server.url
    )
    try:
        yield fleet.start_workers(1)
    finally:
        fleet.stop()


def broker_probe(group: SentinelGroup) -> RedisQueueProbe:
    return RedisQueueProbe(lambda: group.current_master().client())


def test_saves_through_the_client_are_applied(
    client: CheckpointClient, group: SentinelGroup
) -> None:
    # Given a client publishing through the sentinels
    handles = [client.save(make_checkpoint(f"sentinel-{i}", version=i + 1)) for i in range(20)]
    handles.append(client.delete("sentinel-3"))
    # Then every request is applied by the worker, which found the master the same way
    for handle in handles:
        client.wait_durable(handle, timeout=20)
    assert client.load("sentinel-3") is None
    assert client.load("sentinel-19").version == 20  # type: ignore[union-attr]
    wait_drained(broker_probe(group))


def test_a_store_out_of_memory_pauses_the_worker_and_saves_wait_in_the_sentinel_broker(
    client: CheckpointClient, fleet: Fleet, group: SentinelGroup, store_client: redis.Redis
) -> None:
    # Given a worker that applied a save through the sentinels' master
    client.wait_durable(client.save(make_checkpoint("sentinel-oom-0")), timeout=30)
    broker = group.current_master().client()
    # When the store runs out of memory, and the worker has paused
    with store_out_of_memory(store_client, fleet):
        # Then saves published meanwhile wait in the queue: none taken (not in "unacked"),
        # none taken and retried
        handles = [
            client.save(make_checkpoint(f"sentinel-oom-{i}", version=i)) for i in range(1, 21)
        ]
        wait_until(lambda: broker.llen(QUEUE) == 20, timeout=30, message="20 saves queued")
        assert broker.hlen("unacked") == 0
        assert client.store.load("sentinel-oom-20") is None
    # When an operator raises the limit, the worker resumes by itself and every save
    # applies: none lost, none dead-lettered
    for handle in handles:
        client.wait_durable(handle, timeout=60)
    wait_drained(broker_probe(group))
    assert DeadLetters(store_client, KeySpace(fleet.settings.key_prefix)).count() == 0
    assert RESUMED in fleet.logs()
    broker.close()


@dataclass
class Publisher:
    """Saves fresh sessions from a thread until stopped; remembers what happened to each."""

    client: CheckpointClient
    prefix: str
    published: list[tuple[float, Handle]] = field(default_factory=list)
    refused: list[tuple[float, str]] = field(default_factory=list)
    unexpected: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            session = f"{self.prefix}-{i}"
            i += 1
            try:
                handle = self.client.save(make_checkpoint(session))
            except BrokerUnavailable:
                self.refused.append((time.monotonic(), session))
            except BaseException as exc:  # reported by the test, never swallowed
                self.unexpected.append(exc)
                return
            else:
                self.published.append((time.monotonic(), handle))

    def published_since(self, moment: float) -> int:
        return sum(1 for when, _ in list(self.published) if when > moment)


def applied(client: CheckpointClient, handle: Handle) -> bool:
    fence = client.store.fence(handle.session_id)
    return fence is not None and handle.seq is not None and fence.seq >= handle.seq


def test_broker_failover_while_saves_arrive(
    client: CheckpointClient, group: SentinelGroup, store_client: redis.Redis
) -> None:
    rounds = int(os.environ.get("CHECKPOINTQ_FAILOVER_ROUNDS", "1"))
    for round_no in range(1, rounds + 1):
        print(failover_round(client, group, Publisher(client, prefix=f"failover-{round_no}")))
    # Finally the same client and worker still work
    client.wait_durable(client.save(make_checkpoint("after-failover")), timeout=30)


def failover_round(client: CheckpointClient, group: SentinelGroup, publisher: Publisher) -> str:
    """One failover under load, its guarantees asserted; returns the figures as a line."""
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        # Given saves flowing through the sentinels' master
        wait_until(lambda: len(publisher.published) >= 100, timeout=30, message="saves")
        # When the master is killed and the sentinels promote the replica
        killed_at = time.monotonic()
        old = group.fail_master()
        wait_until(
            lambda: group.promoted(old),
            timeout=30,
            interval=0.05,
            message="the replica's promotion",
        )
        promoted_at = time.monotonic()
        # and the client keeps saving
        wait_until(
            lambda: (
                publisher.published_since(promoted_at) >= AFTER_PROMOTION
                or bool(publisher.unexpected)
            ),
            timeout=60,
            message="saves after the promotion",
        )
    finally:
        publisher.stop.set()
        thread.join(timeout=30)
    # Then every publish either returned or raised BrokerUnavailable
    assert publisher.unexpected == []
    # and every request published after the promotion was seen is applied
    after = [h for when, h in publisher.published if when > promoted_at]
    wait_until(
        lambda: all(applied(client, h) for h in after),
        timeout=60,
        message="the saves published after the promotion to be applied",
    )
    wait_drained(broker_probe(group), timeout=60)
    # (measured, not asserted: what the dead master took with it)
    lost = [(when, h) for when, h in publisher.published if not applied(client, h)]
    assert all(when <= promoted_at for when, _ in lost)
    # and nothing appears that nobody sent
    sent = {h.session_id for _, h in publisher.published} | {s for _, s in publisher.refused}
    stored = {s for s in client.store.list() if s.startswith(publisher.prefix)}
    assert stored <= sent
    # The killed server rejoins as a replica, ready for another round
    old.start()
    wait_until(group.is_ready, timeout=60, interval=0.1, message="the group to heal")
    refused_at = [when for when, _ in publisher.refused]
    window = max(refused_at) - min(refused_at) if refused_at else 0.0
    return (
        f"{publisher.prefix}: published {len(publisher.published)}, "
        f"refused (BrokerUnavailable) {len(publisher.refused)} over {window:.2f}s, "
        f"kill -> promotion seen {promoted_at - killed_at:.2f}s, "
        f"acknowledged then lost {len(lost)}"
    )
