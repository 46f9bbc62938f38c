"""A master of the cluster is killed (``kill -9``) while saves arrive; its replica takes over.

What this proves: every failure during the failover reaches the caller as StoreUnavailable
(the worker retries those), the same store object works again once the replica is promoted,
and sessions on the healthy masters are never lost. What it measures, and reports rather than
asserts: how long saves failed, and how many acknowledged saves of the killed master's slots
did not survive, because Redis replicates asynchronously (a save acknowledged by the master
but not yet streamed to the replica dies with the master).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from redis.crc import key_slot

from checkpointq.store import RedisStore, StoreUnavailable
from tests.support.checkpoints import make_checkpoint
from tests.support.cluster import ClusterNodeInfo, LocalCluster
from tests.support.servers import wait_until

#: Short enough that a dead master is noticed in about a second.
NODE_TIMEOUT_MS = 1000


@pytest.fixture(scope="module")
def failover_cluster() -> Iterator[LocalCluster]:
    """Three masters with a replica each, torn down after this module (it gets damaged)."""
    cluster = LocalCluster(masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS).start()
    yield cluster
    cluster.cleanup()


@dataclass
class SaveLog:
    """Saves as the caller saw them."""

    acknowledged: list[str] = field(default_factory=list)
    unavailable: list[float] = field(default_factory=list)  # monotonic time of each error
    failed: list[str] = field(default_factory=list)
    count: int = 0

    def save_next(self, store: RedisStore) -> bool:
        session_id = f"fo-{self.count}"
        self.count += 1
        try:
            store.save(make_checkpoint(session_id, messages=1), seq=self.count)
        except StoreUnavailable:
            self.unavailable.append(time.monotonic())
            self.failed.append(session_id)
            return False
        self.acknowledged.append(session_id)
        return True


def _promoted(cluster: LocalCluster, replica: ClusterNodeInfo) -> Callable[[], bool]:
    def check() -> bool:
        return any(node.port == replica.port and node.slots for node in cluster.masters_info())

    return check


def test_master_killed_while_saves_arrive_replica_takes_over(
    failover_cluster: LocalCluster, record_property: Callable[[str, object], None]
) -> None:
    # Given a store on the cluster, built from its URL as deployments build it (so with the
    # cluster client's retries as checkpointq.store.cluster sets them on every redis-py), and
    # a master whose replica is in sync
    store = RedisStore.from_url(failover_cluster.url, prefix="fo")
    victim = failover_cluster.masters_info()[0]
    replica = next(n for n in failover_cluster.topology() if n.master_id == victim.node_id)
    log = SaveLog()
    for _ in range(300):
        assert log.save_next(store)

    # When the master is killed while saves keep arriving
    failover_cluster.node(victim.port).stop(kill=True)
    killed_at = time.monotonic()
    promoted = _promoted(failover_cluster, replica)
    promoted_at: float | None = None
    saves_after_promotion = 0
    last_check = 0.0
    while saves_after_promotion < 300:
        assert time.monotonic() - killed_at < 30, "the replica was never promoted"
        ok = log.save_next(store)
        if promoted_at is None and time.monotonic() - last_check > 0.05:
            last_check = time.monotonic()
            if promoted():
                promoted_at = last_check
        elif promoted_at is not None and ok:
            saves_after_promotion += 1

    # Then the replica serves the slots and every acknowledged save is checked
    wait_until(failover_cluster.is_healthy, timeout=20, message="cluster healthy again")
    lost = [sid for sid in log.acknowledged if store.load(sid) is None]
    on_victim = [sid for sid in log.failed if victim.owns(key_slot(store.keys.data(sid).encode()))]
    victim_lost = [sid for sid in lost if victim.owns(key_slot(store.keys.data(sid).encode()))]
    outage = (log.unavailable[-1] - log.unavailable[0]) if log.unavailable else 0.0
    figures = {
        "saves_attempted": log.count,
        "saves_acknowledged": len(log.acknowledged),
        "store_unavailable_errors": len(log.unavailable),
        "errors_on_healthy_masters": len(log.failed) - len(on_victim),
        "seconds_kill_to_promotion": round((promoted_at or killed_at) - killed_at, 2),
        "seconds_of_failed_saves": round(outage, 2),
        "acknowledged_then_lost": len(lost),
    }
    for name, value in figures.items():
        record_property(name, value)
    print(f"\nfailover figures: {figures}")  # the figures docs/scaling.md quotes

    # Only the killed master's slots can lose acknowledged writes (asynchronous replication)
    assert lost == victim_lost
    # The outage was seen, and reported as StoreUnavailable (anything else would have raised)
    assert log.unavailable, "no save failed: the failover was not exercised"
    # The same store object works again, for the taken-over slots too
    after = store.save(make_checkpoint("after-failover"), seq=1)
    assert after.applied and store.load("after-failover") is not None
    assert store.refresh("after-failover") and store.delete("after-failover", seq=2)
    # (a limit above every save tried, so that the sweep's count is the store's, whatever
    # the number of saves the loop made while the failover lasted)
    swept = store.expire_stale(
        now=store.clock() + store.options.ttl_seconds + 1, limit=log.count + 1
    )
    assert len(swept) == len(log.acknowledged) - len(lost)
    store.close()
