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

GO_TTL_SECONDS = 30 * 24 * 60 * 60


class SteppedClock:
    """Our store's clock, moved by hand; Redis keeps real time (and so real TTLs)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def go_save(client: redis.Redis, store: RedisStore, session_id: str, version: int) -> None:
    """What Go's ``RedisStore.Save`` does: the zstd JSON, a 30-day TTL, no index update."""
    value = zstandard.ZstdCompressor(level=3).compress(
        serialize_checkpoint(make_checkpoint(session_id, version=version))
    )
    client.set(store.keys.data(session_id), value, ex=GO_TTL_SECONDS)


def test_sweep_never_deletes_a_checkpoint_go_saved_after_us(real_redis: redis.Redis) -> None:
    # Given a session saved through checkpointq with a 1-hour TTL,
    clock = SteppedClock()
    store = RedisStore(real_redis, clock=clock, options=StoreOptions(ttl_seconds=3600))
    store.save(make_checkpoint("mixed", version=1), seq=1)
    # and then re-saved by Go (SET EX 30 d, no index update),
    go_save(real_redis, store, "mixed", version=2)
    # when our clock passes checkpointq's old deadline and the sweep runs,
    clock.now += 3600 + 1
    swept = store.expire_stale()
    # then Go's newer checkpoint survives, listed, and indexed at its own deadline.
    assert swept == []
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
    clock = SteppedClock()
    store = RedisStore(real_redis, clock=clock)
    go_save(real_redis, store, "ours-last", version=1)
    store.save(make_checkpoint("ours-last", version=2), seq=1)
    clock.now += store.options.ttl_seconds + 1
    assert store.expire_stale() == ["ours-last"]
    assert not real_redis.exists(store.keys.data("ours-last"))
    assert store.list() == []


def test_sweep_drops_the_entry_of_a_value_go_deleted(real_redis: redis.Redis) -> None:
    clock = SteppedClock()
    store = RedisStore(real_redis, clock=clock)
    store.save(make_checkpoint("go-deleted"), seq=1)
    real_redis.delete(store.keys.data("go-deleted"))  # Go's Delete
    clock.now += store.options.ttl_seconds + 1
    assert store.expire_stale() == ["go-deleted"]
    assert real_redis.zcard(store.keys.index()) == 0
    assert real_redis.hget(store.keys.fence("go-deleted"), "deadline") is None


def test_a_refresh_after_go_saved_makes_the_deadline_ours_again(real_redis: redis.Redis) -> None:
    clock = SteppedClock()
    store = RedisStore(real_redis, clock=clock)
    store.save(make_checkpoint("refreshed", version=1), seq=1)
    go_save(real_redis, store, "refreshed", version=2)
    assert store.refresh("refreshed")
    clock.now += store.options.ttl_seconds + 1
    # The refresh set the value's expiry to our deadline: expiring it there is what Redis
    # itself would do, so the sweep may delete it.
    assert store.expire_stale() == ["refreshed"]
