"""Mixed writers: the Go ``RedisStore`` saving and deleting on our keys, behind our back.

Go's ``Save`` is ``SET <prefix>:<id> zstd(json) EX 30d`` and its ``Delete`` a plain ``DEL``:
neither touches our fence or deadline index. These tests write "as Go does" with raw
commands on a real redis-server (tests/go/ does the same with a real Go program).
"""

from __future__ import annotations

import time

import redis
import zstandard

from checkpointq.store import RedisStore, StoreOptions, serialize_checkpoint
from tests.support.checkpoints import make_checkpoint
from tests.support.clocks import FakeClock

GO_TTL_SECONDS = 30 * 24 * 60 * 60


def go_save(client: redis.Redis, store: RedisStore, session_id: str, version: int) -> None:
    """What Go's ``RedisStore.Save`` does: the zstd JSON, a 30-day TTL, no index update."""
    value = zstandard.ZstdCompressor(level=3).compress(
        serialize_checkpoint(make_checkpoint(session_id, version=version))
    )
    client.set(store.keys.data(session_id), value, ex=GO_TTL_SECONDS)


def test_sweep_never_deletes_a_checkpoint_go_saved_after_us(real_redis: redis.Redis) -> None:
    # Given a session saved through checkpointq with a 1-hour TTL,
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock, options=StoreOptions(ttl_seconds=3600))
    store.save(make_checkpoint("mixed", version=1), seq=1)
    # and then re-saved by Go (SET EX 30 d, no index update),
    go_save(real_redis, store, "mixed", version=2)
    # when our clock passes checkpointq's old deadline and the sweep runs,
    clock.now += 3600 + 1
    swept = store.expire_stale()
    # then Go's newer checkpoint survives, listed, and indexed at its own deadline.
    assert swept == []
    fence = store.fence("mixed")
    assert fence is not None and fence.live
    loaded = store.load("mixed")
    assert loaded is not None and loaded.version == 2
    assert store.list() == ["mixed"]
    score = real_redis.zscore(store.keys.index(), "mixed")
    assert score is not None
    assert score > (clock.now + GO_TTL_SECONDS - 60) * 1000
    # and a second sweep at the same time leaves it alone too.
    assert store.expire_stale() == []
    assert real_redis.exists(store.keys.data("mixed"))


def test_sweep_still_expires_what_we_wrote_last(real_redis: redis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    go_save(real_redis, store, "ours-last", version=1)
    store.save(make_checkpoint("ours-last", version=2), seq=1)
    clock.now += store.options.ttl_seconds + 1
    assert store.expire_stale() == ["ours-last"]
    assert not real_redis.exists(store.keys.data("ours-last"))
    assert store.list() == []


def test_sweep_drops_the_entry_of_a_value_go_deleted(real_redis: redis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    store.save(make_checkpoint("go-deleted"), seq=1)
    real_redis.delete(store.keys.data("go-deleted"))  # Go's Delete
    clock.now += store.options.ttl_seconds + 1
    assert store.expire_stale() == ["go-deleted"]
    assert real_redis.zcard(store.keys.index()) == 0
    assert real_redis.hget(store.keys.fence("go-deleted"), "deadline") is None


def test_a_refresh_after_go_saved_makes_the_deadline_ours_again(real_redis: redis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    store.save(make_checkpoint("refreshed", version=1), seq=1)
    go_save(real_redis, store, "refreshed", version=2)
    assert store.refresh("refreshed")
    clock.now += store.options.ttl_seconds + 1
    # The refresh set the value's expiry to our deadline: expiring it there is what Redis
    # itself would do, so the sweep may delete it.
    assert store.expire_stale() == ["refreshed"]


# -- continuous reconciliation -------------------------------------------------------------


def reconcile_until_pass_completes(store: RedisStore, budget: int = 1000) -> list[str]:
    """Run slices as beat would until one completes a pass; return every id adopted."""
    adopted: list[str] = []
    for _ in range(10_000):
        report = store.reconcile(budget)
        adopted += report.adopted
        if report.completed_pass:
            return adopted
    raise AssertionError("the reconciliation pass never completed")


def test_a_session_go_wrote_alone_is_adopted_and_listed(real_redis: redis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    go_save(real_redis, store, "go-only", version=3)
    assert store.list() == []
    assert reconcile_until_pass_completes(store) == ["go-only"]
    assert store.list() == ["go-only"]
    score = real_redis.zscore(store.keys.index(), "go-only")
    assert score is not None and score > (clock.now + GO_TTL_SECONDS - 60) * 1000
    # A second pass finds everything in order.
    assert reconcile_until_pass_completes(store) == []


def test_a_session_go_wrote_alone_is_swept_once_redis_expired_it(real_redis: redis.Redis) -> None:
    # Given a Go-written session with a short TTL, adopted by reconciliation,
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    real_redis.set(store.keys.data("short"), b'{"sessionId":"short","metadata":{}}', px=200)
    reconcile_until_pass_completes(store)
    assert store.list() == ["short"]
    # when Redis has expired it and the sweep runs past its deadline,
    deadline = time.monotonic() + 10
    while real_redis.exists(store.keys.data("short")):
        assert time.monotonic() < deadline, "Redis never expired the key"
        time.sleep(0.02)
    clock.now += 1
    # then the sweep reports it expired, and its entry is gone.
    assert store.expire_stale() == ["short"]
    assert real_redis.zcard(store.keys.index()) == 0


def test_a_session_go_deleted_leaves_list_and_its_fence_stops_recording_a_value(
    real_redis: redis.Redis,
) -> None:
    store = RedisStore(real_redis)
    store.save(make_checkpoint("go-del"), seq=1)
    store.save(make_checkpoint("kept"), seq=1)
    real_redis.delete(store.keys.data("go-del"))  # Go's Delete: a plain DEL
    report = store.reconcile(1000)
    assert report.dropped == ["go-del"] and report.completed_pass
    assert store.list() == ["kept"]
    gone, kept = store.fence("go-del"), store.fence("kept")
    assert gone is not None and not gone.live and not gone.deleted
    assert kept is not None and kept.live


def test_a_deadline_go_moved_is_fixed_to_the_values_own(real_redis: redis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock, options=StoreOptions(ttl_seconds=3600))
    store.save(make_checkpoint("moved"), seq=1)
    go_save(real_redis, store, "moved", version=2)
    report = store.reconcile(1000)
    assert report.moved == ["moved"]
    score = real_redis.zscore(store.keys.index(), "moved")
    assert score is not None and score > (clock.now + GO_TTL_SECONDS - 60) * 1000
    assert store.reconcile(1000).moved == []


def test_a_value_without_ttl_is_listed_and_never_swept(real_redis: redis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    real_redis.set(store.keys.data("forever"), b'{"sessionId":"forever","metadata":{}}')
    assert store.reindex() == 1
    clock.now += 10 * GO_TTL_SECONDS
    assert store.list() == ["forever"]
    assert store.expire_stale() == []
    assert store.reconcile(1000).as_json()["moved"] == 0


def test_slices_carry_on_from_the_cursor_kept_in_redis(real_redis: redis.Redis) -> None:
    # Given 2000 Go-only sessions beside 3000 unrelated keys,
    store = RedisStore(real_redis)
    pipe = real_redis.pipeline(transaction=False)
    for i in range(2000):
        pipe.set(store.keys.data(f"g{i}"), b"{}", ex=GO_TTL_SECONDS)
    for i in range(3000):
        pipe.set(f"unrelated:{i}", b"x")
    pipe.execute()
    # when slices of a small budget run, each from a fresh store object (as in different
    # worker processes),
    slices: list[list[str]] = []
    while True:
        report = RedisStore(real_redis).reconcile(500)
        slices.append(report.adopted)
        assert report.examined <= 4 * 500  # SCAN's COUNT is a hint; bounded all the same
        if report.completed_pass:
            break
    # then the pass took many slices and adopted every session once.
    adopted = [sid for part in slices for sid in part]
    assert len(slices) > 5
    assert sorted(adopted) == sorted(f"g{i}" for i in range(2000))
    assert len(store.list()) == 2000
