"""Staged saves: a large value goes to a staging key of its own and save.lua renames it onto
the data key (``RedisStore._save_direct``). The contract suite runs every behaviour through
this path too (backend ``redis-staged``); these tests cover what is particular to it: no
staging key outlives its save, whatever the outcome, and a refused staging write is the
same error as a refused save."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from redis.crc import key_slot

from checkpointq.store import RedisStore, StoreOptions, StoreUnavailable
from checkpointq.store.base import DeleteOp, SaveOp, SaveResult
from checkpointq.store.keys import ClusterKeySpace
from checkpointq.store.redis import STAGE_FROM_BYTES, STAGING_TTL_MS
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer

TTL_SECONDS = 3600


def _staged_store(client: redis.Redis, prefix: str = "st") -> RedisStore:
    store = RedisStore(client, prefix=prefix, options=StoreOptions(ttl_seconds=TTL_SECONDS))
    store.stage_from_bytes = 0
    return store


def _staging_keys(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter(match="*:staging:*"))


@pytest.fixture(params=["redis", "fakeredis"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    if request.param == "fakeredis":
        fake: redis.Redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        yield fake
        return
    real: redis.Redis = request.getfixturevalue("real_redis")
    yield real


def test_a_large_checkpoint_is_staged_and_a_small_one_is_not(real_redis: redis.Redis) -> None:
    # Given a store as configured, watching which commands reach Redis
    store = RedisStore(real_redis, prefix="st")
    big = make_checkpoint("big", messages=40, content_size=2_000)
    assert len(store.encode(big).value) < STAGE_FROM_BYTES  # "x" runs compress very well
    real_redis.config_resetstat()
    # When a small checkpoint is saved, then one whose stored value reaches the threshold
    store.save(make_checkpoint("small"), seq=1)
    assert "cmdstat_rename" not in real_redis.info("commandstats")
    store.stage_from_bytes = len(store.encode(big).value)
    assert store.save(big, seq=1).applied
    # Then only the second went through a staging key, and it left none behind
    assert real_redis.info("commandstats")["cmdstat_rename"]["calls"] == 1
    assert _staging_keys(real_redis) == []
    assert store.load("big") == big


def test_a_staged_save_keeps_the_session_ttl_not_the_staging_ttl(client: redis.Redis) -> None:
    store = _staged_store(client)
    assert store.save(make_checkpoint("s1"), seq=1).applied
    assert client.pttl(store.keys.data("s1")) > STAGING_TTL_MS
    assert client.pttl(store.keys.data("s1")) <= TTL_SECONDS * 1000
    expires = client.hget(store.keys.fence("s1"), "expires")
    assert expires is not None and int(expires) == client.pexpiretime(store.keys.data("s1"))
    assert _staging_keys(client) == []


def test_a_stale_staged_save_deletes_its_staging_key(client: redis.Redis) -> None:
    # Given a session saved at seq 5, then deleted at seq 6
    store = _staged_store(client)
    assert store.save(make_checkpoint("s1", version=5), seq=5).applied
    # When older saves arrive, and one racing the tombstone
    assert not store.save(make_checkpoint("s1", version=4), seq=4).applied
    assert store.delete("s1", seq=6)
    assert not store.save(make_checkpoint("s1", version=6), seq=6).applied
    # Then none applied and none left its staging key
    assert store.load("s1") is None
    assert _staging_keys(client) == []
    assert store.list() == []


def test_a_staged_batch_leaves_no_staging_key_and_reports_each_item(client: redis.Redis) -> None:
    store = _staged_store(client)
    results = store.apply_batch(
        [
            SaveOp(make_checkpoint("a", version=1), 10),
            SaveOp(make_checkpoint("a", version=0), 9),  # stale
            DeleteOp("b", 3),
            SaveOp(make_checkpoint("b", version=1), 2),  # behind the tombstone
            SaveOp(make_checkpoint("c", version=1), 1),
        ]
    )
    applied = [r.applied if isinstance(r, SaveResult) else r for r in results]
    assert applied == [True, False, True, False, True]
    assert sorted(store.list()) == ["a", "c"]
    assert _staging_keys(client) == []


def test_concurrent_staged_saves_of_one_session_keep_the_newest(real_redis: redis.Redis) -> None:
    # Given many threads saving one session at once, each with its own seq
    store = _staged_store(real_redis)
    seqs = list(range(1, 41))

    def save(seq: int) -> None:
        store.save(make_checkpoint("s1", version=seq), seq=seq)

    threads = [threading.Thread(target=save, args=(seq,)) for seq in seqs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then the newest won, whatever the order, and no staging key is left
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == max(seqs)
    assert _staging_keys(real_redis) == []


@pytest.mark.parametrize("staged", [False, True], ids=["as-argument", "staged"])
def test_a_save_reloads_a_flushed_script(real_redis: redis.Redis, staged: bool) -> None:
    store = _staged_store(real_redis)
    store.stage_from_bytes = 0 if staged else 1 << 30
    real_redis.script_flush()
    assert store.save(make_checkpoint("s1"), seq=1).applied
    assert store.load("s1") == make_checkpoint("s1")
    assert _staging_keys(real_redis) == []


def test_the_script_refuses_a_missing_staged_value_and_changes_nothing(
    real_redis: redis.Redis,
) -> None:
    # Given a saved session, and a save whose staging key is gone (expired, or refused)
    store = _staged_store(real_redis)
    assert store.save(make_checkpoint("s1", version=1), seq=1).applied
    staging = store.keys.staging("s1", "gone")
    keys, args = store._save_call("s1", b"", 2, "", staging=staging)
    # When its script runs
    with pytest.raises(redis.ResponseError, match="staged value missing"):
        store.scripts.save(keys=keys, args=args)
    # Then the session and its fence are as they were
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 1
    fence = store.fence("s1")
    assert fence is not None and fence.seq == 1


@pytest.mark.parametrize("staged", [False, True], ids=["as-argument", "staged"])
def test_a_save_refused_for_memory_is_store_unavailable_and_leaves_nothing(staged: bool) -> None:
    # Given a Redis at its maxmemory with eviction off, holding one saved session
    server = RedisServer().start()
    try:
        client = server.client()
        store = RedisStore(client, prefix="oom")
        store.stage_from_bytes = 0 if staged else 1 << 30
        assert store.save(make_checkpoint("s1", version=1), seq=1).applied
        client.set("ballast", b"x" * (2 * 1024 * 1024))
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1024 * 1024)
        # When a newer save arrives
        with pytest.raises(StoreUnavailable, match="OutOfMemoryError"):
            store.save(make_checkpoint("s1", version=2), seq=2)
        # Then nothing changed and no staging key is left; once memory is back, it applies
        loaded = store.load("s1")
        assert loaded is not None and loaded.version == 1
        assert _staging_keys(client) == []
        client.config_set("maxmemory", 0)
        assert store.save(make_checkpoint("s1", version=2), seq=2).applied
        assert _staging_keys(client) == []
        client.close()
    finally:
        server.cleanup()


def test_a_staging_key_shares_its_sessions_slot_and_names_no_session() -> None:
    keys = ClusterKeySpace("agentorca-session")
    for session_id in ["s1", "{user-7}:chat", "x" * 300, "staging:s1"]:
        staging = keys.staging(session_id, "ab12")
        assert key_slot(staging.encode()) == key_slot(keys.data(session_id).encode())
        assert staging.startswith("agentorca-session.cq:{")
        assert session_id not in staging.split(":staging:")[0]
        assert staging != keys.fence(session_id)


def test_a_cluster_batch_stages_large_values_in_their_slots(cluster_store: RedisStore) -> None:
    cluster_store.stage_from_bytes = 0
    ops = [SaveOp(make_checkpoint(f"s{n}", version=n), n + 1) for n in range(30)]
    results = cluster_store.apply_batch(ops)
    assert all(isinstance(r, SaveResult) and r.applied for r in results)
    assert sorted(cluster_store.list()) == sorted(f"s{n}" for n in range(30))
    for n in range(30):
        assert cluster_store.load(f"s{n}") == make_checkpoint(f"s{n}", version=n)
    leftover = [
        key
        for node in cluster_store.client.get_primaries()
        for key in cluster_store.client.get_redis_connection(node).scan_iter(match="*:staging:*")
    ]
    assert leftover == []


@pytest.mark.parametrize("staged", [False, True], ids=["as-argument", "staged"])
def test_a_batch_reloads_flushed_scripts_and_applies_every_item(
    real_redis: redis.Redis, staged: bool
) -> None:
    # Given a store whose scripts Redis has forgotten (a restart, SCRIPT FLUSH)
    store = _staged_store(real_redis)
    store.stage_from_bytes = 0 if staged else 1 << 30
    assert store.save(make_checkpoint("b", version=1), seq=1).applied
    real_redis.script_flush()
    # When a batch of saves and a delete arrives
    results = store.apply_batch(
        [
            SaveOp(make_checkpoint("a", version=1), 10),
            DeleteOp("b", 2),
            SaveOp(make_checkpoint("a", version=2), 11),
        ]
    )
    # Then every item applied, in order, and nothing was left behind
    applied = [r.applied if isinstance(r, SaveResult) else r for r in results]
    assert applied == [True, True, True]
    loaded = store.load("a")
    assert loaded is not None and loaded.version == 2
    assert store.list() == ["a"]
    assert _staging_keys(real_redis) == []
