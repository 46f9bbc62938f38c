"""The cluster sweep and its hint: an empty sweep reads one small sorted set, not 16384
slot indexes; what the hint cannot know is found by the periodic full pass (or, for a
deadline reconciliation wrote, by the next sweep).

Times are given to ``expire_stale(now=...)`` rather than waited for: the hint's decisions
depend only on the deadlines and on that ``now``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from checkpointq.store import RedisStore, StoreOptions
from checkpointq.store.redis import HINT_SKEW_MS, INDEXES_PER_CALL
from tests.support.checkpoints import make_checkpoint
from tests.support.cluster import LocalCluster
from tests.support.servers import wait_until

HOUR = 3600.0


def _store_like(
    store: RedisStore, clock: Callable[[], float] = time.time, **options: Any
) -> RedisStore:
    """Another store on ``store``'s cluster and prefix, e.g. another worker's, with its own
    options and clock."""
    return RedisStore(
        store.client, prefix=store.keys.prefix, options=StoreOptions(**options), clock=clock
    )


@contextmanager
def _commands_run(cluster: LocalCluster) -> Iterator[Counter[str]]:
    """Every command the masters ran inside the block, by name (INFO commandstats; Redis 7
    counts the commands a script runs too), without the counting's own."""
    masters = [node.client() for node in cluster.nodes]
    try:
        for master in masters:
            master.config_resetstat()
        seen: Counter[str] = Counter()
        yield seen
        for master in masters:
            for name, stats in master.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                if command not in ("info", "config|resetstat"):
                    seen[command] += int(stats["calls"])
    finally:
        for master in masters:
            master.close()


def _count_due_calls(store: RedisStore) -> list[int]:
    """Count the store's ``due.lua`` calls (one slot-index read each) from now on."""
    calls: list[int] = []
    due = store.scripts.due

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return due(*args, **kwargs)  # type: ignore[arg-type]

    object.__setattr__(store.scripts, "due", counting)
    return calls


def test_full_pass_reads_every_slot_in_a_few_calls_per_node(cluster_store: RedisStore) -> None:
    # Given sessions on every node, none due, and no hint yet (a new deployment)
    for i in range(30):
        cluster_store.save(make_checkpoint(f"n{i}", messages=0), seq=1)
    calls = _count_due_calls(cluster_store)
    # When a sweep finds nothing to expire
    assert cluster_store.expire_stale() == []
    # Then, being a full pass, it read every slot's index in a few calls per node
    per_node = -(-5462 // INDEXES_PER_CALL)
    assert REDIS_CLUSTER_HASH_SLOTS // INDEXES_PER_CALL <= len(calls) <= 3 * per_node
    # And it recorded every slot in the hint, and when the next full pass is due
    assert cluster_store.client.zcard(cluster_store.keys.sweep_hint()) == (
        REDIS_CLUSTER_HASH_SLOTS + 1
    )


def test_empty_sweep_after_a_full_pass_touches_only_the_hint(
    redis_cluster: LocalCluster, cluster_store: RedisStore
) -> None:
    # Given sessions on every node, none due, and a full pass done
    for i in range(30):
        cluster_store.save(make_checkpoint(f"n{i}", messages=0), seq=1)
    assert cluster_store.expire_stale() == []
    # When the next sweep finds nothing due
    with _commands_run(redis_cluster) as seen:
        assert cluster_store.expire_stale() == []
    # Then it ran one script on one node, reading the hint only (ZSCORE of its full-pass
    # member, ZRANGE of what is due)
    assert seen == Counter({"evalsha": 1, "zscore": 1, "zrange": 1})


def test_sweep_reads_only_the_slots_the_hint_names_and_expires_their_due(
    cluster_store: RedisStore,
) -> None:
    # Given sessions saved with a 1 h TTL and one with 10 h, then a full pass that recorded
    # their deadlines (the next one due in 3 h)
    short = _store_like(cluster_store, ttl_seconds=HOUR)
    long = _store_like(cluster_store, ttl_seconds=10 * HOUR)
    ids = [f"due{i}" for i in range(5)]
    for session_id in ids:
        assert short.save(make_checkpoint(session_id), seq=1).applied
    assert long.save(make_checkpoint("later"), seq=1).applied
    sweeper = _store_like(cluster_store, ttl_seconds=10 * HOUR, sweep_full_pass_seconds=3 * HOUR)
    t0 = time.time()
    assert sweeper.expire_stale(now=t0) == []
    calls = _count_due_calls(sweeper)
    # When a sweep runs after their deadlines, before the next full pass
    expired = sweeper.expire_stale(now=t0 + 2 * HOUR)
    # Then they are expired, from one read of their few slots per node
    assert sorted(expired) == ids
    assert len(calls) <= 3
    assert cluster_store.load("later") is not None


def test_stale_session_the_hint_cannot_know_is_expired_by_the_next_full_pass(
    cluster_store: RedisStore,
) -> None:
    # Given a worker whose full pass recorded every empty slot as due no earlier than
    # its TTL (10 h) from now, with the next full pass due in 60 s
    sweeper = _store_like(cluster_store, ttl_seconds=10 * HOUR, sweep_full_pass_seconds=60)
    t0 = time.time()
    assert sweeper.expire_stale(now=t0) == []
    # And a session then saved by a worker configured with a lower TTL (1 s)
    lowered = _store_like(cluster_store, ttl_seconds=1)
    assert lowered.save(make_checkpoint("short-lived"), seq=1).applied
    # When sweeps run after its deadline: before, then after, the full pass is due
    before_full_pass = sweeper.expire_stale(now=t0 + 30)
    at_full_pass = sweeper.expire_stale(now=t0 + 61)
    # Then the hint alone misses it, and the full pass expires it (bounded lateness)
    assert before_full_pass == []
    assert at_full_pass == ["short-lived"]


def _deadline(store: RedisStore, session_id: str) -> float:
    """The session's deadline in its slot's index, in seconds."""
    score = store.client.zscore(store.keys.session(session_id).index, session_id)
    assert score is not None
    return float(score) / 1000


def test_deadline_of_a_writer_whose_clock_is_a_little_behind_is_found_on_time(
    cluster_store: RedisStore,
) -> None:
    # Given a full pass by a worker with a 1 h TTL, the next full pass not for a day
    sweeper = _store_like(cluster_store, ttl_seconds=HOUR, sweep_full_pass_seconds=24 * HOUR)
    assert sweeper.expire_stale() == []
    # And a session saved by a writer whose clock is behind, by less than the skew margin
    behind = HINT_SKEW_MS / 1000 / 2
    writer = _store_like(cluster_store, clock=lambda: time.time() - behind, ttl_seconds=HOUR)
    assert writer.save(make_checkpoint("skewed"), seq=1).applied
    # When a sweep runs just after its (earlier) deadline
    expired = sweeper.expire_stale(now=_deadline(cluster_store, "skewed") + 0.002)
    # Then it is expired then, not at the next full pass
    assert expired == ["skewed"]


def test_deadline_of_a_writer_whose_clock_is_far_behind_is_found_by_the_full_pass(
    cluster_store: RedisStore,
) -> None:
    # Given a full pass by a worker with a 1 h TTL, the next one due in 58 min
    sweeper = _store_like(cluster_store, ttl_seconds=HOUR, sweep_full_pass_seconds=58 * 60)
    t0 = time.time()
    assert sweeper.expire_stale(now=t0) == []
    # And a session saved by a writer whose clock is 5 min behind, beyond the skew margin
    behind = 5 * 60.0
    assert behind > HINT_SKEW_MS / 1000
    writer = _store_like(cluster_store, clock=lambda: time.time() - behind, ttl_seconds=HOUR)
    assert writer.save(make_checkpoint("skewed"), seq=1).applied
    # When sweeps run after its deadline: before, then after, the full pass is due
    before_full_pass = sweeper.expire_stale(now=_deadline(cluster_store, "skewed") + 1)
    at_full_pass = sweeper.expire_stale(now=t0 + 58 * 60 + 1)
    # Then the hint alone misses it, and the full pass expires it (bounded lateness)
    assert before_full_pass == []
    assert at_full_pass == ["skewed"]


def test_reconciliation_marks_the_slot_of_an_adopted_short_deadline_due(
    cluster_store: RedisStore,
) -> None:
    # Given a full pass by a worker with a 10 h TTL, the next full pass not for a day
    sweeper = _store_like(cluster_store, ttl_seconds=10 * HOUR, sweep_full_pass_seconds=24 * HOUR)
    t0 = time.time()
    assert sweeper.expire_stale(now=t0) == []
    # And a value Go wrote alone with a 1.5 s TTL, adopted by reconciliation
    data = cluster_store.keys.data("from-go")
    value = cluster_store.encode(make_checkpoint("from-go")).value
    cluster_store.client.set(data, value, px=1500)
    assert cluster_store.reindex() == 1
    # When Redis has expired the value, and a sweep runs, long before the next full pass
    wait_until(lambda: not cluster_store.client.exists(data), timeout=10, message="Go's TTL")
    expired = sweeper.expire_stale()
    # Then its entry is expired (and announced by the sweep task) now
    assert expired == ["from-go"]
    assert cluster_store.list() == []


def test_missing_hint_means_a_full_pass(cluster_store: RedisStore) -> None:
    # Given a full pass done, then the hint lost (e.g. a failover before it replicated)
    assert cluster_store.expire_stale() == []
    cluster_store.client.delete(cluster_store.keys.sweep_hint())
    calls = _count_due_calls(cluster_store)
    # When the next sweep runs
    assert cluster_store.expire_stale() == []
    # Then it read every slot again
    assert len(calls) >= REDIS_CLUSTER_HASH_SLOTS // INDEXES_PER_CALL
