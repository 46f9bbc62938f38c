"""End to end with the store on a Redis Cluster: a real worker, the CLI's sweep and beat.

A local 3-master cluster (``tests/support/cluster.py``) holds the store; the broker is a
plain Redis, which also keeps beat's schedule (RedBeat cannot use a cluster). Tests keep
apart by session-id prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from checkpointq.store.base import StoreOptions
from checkpointq.store.keys import ClusterKeySpace
from checkpointq.store.redis import RedisStore
from checkpointq.tasks.producer.client import CheckpointClient
from tests.scale.conftest import Fleet, RedisQueueProbe, wait_drained
from tests.support.celery_processes import REPO, CeleryProcess
from tests.support.checkpoints import make_checkpoint
from tests.support.cluster import LocalCluster
from tests.support.servers import RedisServer, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(masters=3).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="module")
def fleet(cluster: LocalCluster, broker_server: RedisServer) -> Iterator[Fleet]:
    fleet = Fleet.of(
        broker_url=broker_server.url,
        store_url=cluster.url,
        sweep_interval_seconds=0.5,
    )
    try:
        yield fleet.start_workers(1)
    finally:
        fleet.stop()


@pytest.fixture
def client(fleet: Fleet) -> Iterator[CheckpointClient]:
    with CheckpointClient.from_settings(fleet.settings) as client:
        yield client


def stale_sessions(fleet: Fleet, prefix: str, count: int) -> list[str]:
    """Sessions saved straight to the cluster store with a lifetime already over, as the
    next sweep (a full pass) finds them."""
    url = fleet.settings.resolved_store_url or ""
    store = RedisStore.from_url(url, options=StoreOptions(ttl_seconds=0.001))
    ids = [f"{prefix}-{i}" for i in range(count)]
    try:
        for seq, session in enumerate(ids, start=1):
            store.save(make_checkpoint(session), seq=seq)
        wait_until(lambda: store.load(ids[-1]) is None, timeout=10, message="expiry")
        # A 1 ms TTL is far below the worker's, which the sweep hint cannot know of until
        # the next full pass (docs/scaling.md): drop the hint, so the next sweep is one.
        store.client.delete(store.keys.sweep_hint())
    finally:
        store.close()
    return ids


def indexed(client: CheckpointClient, ids: list[str]) -> int:
    """How many of ``ids`` the slots' deadline indexes still hold."""
    store = client.store
    assert isinstance(store, RedisStore) and isinstance(store.keys, ClusterKeySpace)
    return sum(1 for s in ids if store.client.zscore(store.keys.session(s).index, s) is not None)


def test_worker_applies_saves_and_deletes_to_the_cluster(client: CheckpointClient) -> None:
    # Given a client whose store is the cluster (one deadline index per slot)
    assert isinstance(client.store, RedisStore) and client.store.keys.shards == 16384
    handles = [client.save(make_checkpoint(f"cl-{i}", version=i + 1)) for i in range(30)]
    handles += [client.delete(f"cl-{i}") for i in range(0, 30, 3)]
    # Then the worker applies every request in the slot of the session's Go data key
    for handle in handles:
        client.wait_durable(handle, timeout=20)
    assert client.load("cl-0") is None and client.load("cl-1").version == 2  # type: ignore[union-attr]
    listed = {s for s in client.list() if s.startswith("cl-")}
    assert listed == {f"cl-{i}" for i in range(30) if i % 3}


def test_health_and_stats_read_heartbeats_and_counts_from_the_cluster(
    client: CheckpointClient, fleet: Fleet
) -> None:
    # Given live sessions on the cluster and the worker's heartbeat there
    client.wait_durable(client.save(make_checkpoint("cl-health")), timeout=20)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "checkpointq.worker.cli", *args],
            env=fleet.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    # Then health finds the store and the worker through the cluster client
    health = cli("health", "--json")
    assert health.returncode == 0, health.stdout + health.stderr
    assert json.loads(health.stdout)["checks"]["worker"]["ok"] is True
    # and stats counts sessions over every slot
    stats = cli("stats", "--json")
    assert stats.returncode == 0, stats.stderr
    snapshot: dict[str, Any] = json.loads(stats.stdout)
    assert snapshot["live_sessions"] >= 1 and snapshot["workers"] == 1


def test_sweep_task_and_cli_expire_across_all_slots(
    client: CheckpointClient, fleet: Fleet, broker_server: RedisServer
) -> None:
    # Given stale sessions spread over the cluster's slots
    by_task = stale_sessions(fleet, "cl-stale-task", 60)
    # When the worker runs a sweep
    client.sweep()
    wait_drained(RedisQueueProbe(broker_server.client))
    # Then every one is gone from the slots' indexes
    assert indexed(client, by_task) == 0
    # And `checkpointq sweep` does the same from the command line
    by_cli = stale_sessions(fleet, "cl-stale-cli", 40)
    done = subprocess.run(
        [sys.executable, "-m", "checkpointq.worker.cli", "sweep", "--json"],
        env=fleet.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["outcome"] == "swept" and report["expired"] == 40
    assert indexed(client, by_cli) == 0


def test_beat_sweeps_a_cluster_store_from_the_broker_redis(
    client: CheckpointClient, fleet: Fleet, broker_server: RedisServer
) -> None:
    # Given beat, whose schedule lives on the broker Redis (the store is a cluster)
    assert fleet.settings.resolved_beat_url == broker_server.url
    beat = CeleryProcess("beat", fleet.env).start(timeout=60)
    try:
        # When sessions go stale
        ids = stale_sessions(fleet, "cl-stale-beat", 50)
        # Then beat's sweeps expire them without anyone asking
        wait_until(lambda: indexed(client, ids) == 0, timeout=30, message="beat's sweep")
        broker = broker_server.client()
        # (RedBeat's prefix ends with ":", hence the double colon)
        prefix = ClusterKeySpace(fleet.settings.key_prefix).beat_prefix()
        assert broker.exists(f"{prefix}:lock", f"{prefix}:schedule") == 2
        broker.close()
    finally:
        code = beat.stop()
        print(f"--- beat (exit {code}) ---\n{beat.log()}")
