"""The Redis Cluster layout: Go's data keys, one slot per session's scripts, even spread,
paging and sweeping across every node, migration from the earlier sharded layout. The
contract suite itself runs on the cluster through ``store_env``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from checkpointq.store import InvalidInput, RedisStore, StoreUnavailable
from checkpointq.store.keys import ClusterKeySpace, KeySpace, ShardedKeySpace, slot_tags
from checkpointq.store.serde import serialize_checkpoint
from checkpointq.store.urls import is_cluster_url
from tests.support.checkpoints import make_checkpoint
from tests.support.cluster import LocalCluster
from tests.support.servers import free_port

#: Prefixes of the stores built here: "cu<n>", apart from the conftest's cluster_store ("cl<n>").
_prefixes = itertools.count()
# The per-slot tags are computed once per process (~110k CRC16s): here, not inside the first
# Hypothesis example, whose deadline a loaded machine would otherwise exceed.
slot_tags()
BRACE_IDS = ["{", "}", "{}", "}{", "{x}", "a{b}c", "{17290}:x", "}:{", "{{a}}", "x}:fence:y"]


def _slot(key: str) -> int:
    return key_slot(key.encode())


# -- the layout, without a cluster --------------------------------------------------------


@given(session_id=st.text(min_size=1, max_size=40))
def test_data_key_is_gos_and_the_rest_of_the_session_shares_its_slot(session_id: str) -> None:
    keys = ClusterKeySpace("agentorca-session")
    session = keys.session(session_id)
    assert session.data == f"agentorca-session:{session_id}"
    expected = _slot(session.data)
    assert {_slot(session.fence), _slot(session.index)} == {expected}
    assert keys.shard(session_id) == expected
    assert session.fence == keys.fence(session_id) and session.index in keys.index_keys()


@given(first=st.text(min_size=1, max_size=20), second=st.text(min_size=1, max_size=20))
def test_no_two_sessions_share_a_data_or_fence_key(first: str, second: str) -> None:
    keys = ClusterKeySpace("p")
    if first != second:
        assert keys.data(first) != keys.data(second)
        assert keys.fence(first) != keys.fence(second)
    assert keys.session_id_from_data_key(keys.data(first)) == first


def test_every_slot_has_a_tag_and_an_index_of_its_own() -> None:
    tags = slot_tags()
    assert all(tag.isdigit() for tag in tags)
    assert [key_slot(tag.encode()) for tag in tags] == list(range(REDIS_CLUSTER_HASH_SLOTS))
    indexes = ClusterKeySpace("p").index_keys()
    assert [_slot(index) for index in indexes] == list(range(REDIS_CLUSTER_HASH_SLOTS))
    # The earlier layout's index names are not reused: its indexes cannot be mistaken for ours.
    old = ShardedKeySpace("p", 1024)
    assert not {old.index(shard) for shard in range(1024)} & set(indexes)


def test_single_redis_layout_is_unchanged_go_layout() -> None:
    keys = KeySpace()
    assert keys.session("s{1}").as_list() == [
        "agentorca-session:s{1}",
        "agentorca-session.cq:fence:s{1}",
        "agentorca-session.cq:deadlines",
    ]
    assert keys.index_keys() == ["agentorca-session.cq:deadlines"]


@pytest.mark.parametrize(
    ("url", "cluster"),
    [
        ("redis+cluster://h:1,h:2/0", True),
        ("rediss+cluster://:pw@h:1", True),
        ("redis://h:1/0?cluster=true", True),
        ("redis://h:1/0?cluster=false", False),
        ("redis://h:1/0", False),
        ("unix:///tmp/redis.sock", False),
    ],
)
def test_cluster_is_chosen_by_scheme_or_option(url: str, cluster: bool) -> None:
    assert is_cluster_url(url) is cluster


# -- on a real 3-master cluster ----------------------------------------------------------


def test_both_url_spellings_build_a_cluster_store(redis_cluster: LocalCluster) -> None:
    port = redis_cluster.nodes[1].port
    for url in (redis_cluster.url, f"redis://127.0.0.1:{port}/0?cluster=true"):
        store = RedisStore.from_url(url, prefix=f"cu{next(_prefixes)}")
        try:
            assert isinstance(store.client, RedisCluster)
            assert isinstance(store.keys, ClusterKeySpace)
            assert store.save(make_checkpoint("s1"), seq=1).applied
            assert store.load("s1") == make_checkpoint("s1")
        finally:
            store.close()


def test_unreachable_cluster_is_reported_as_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable):
        RedisStore.from_url(f"redis+cluster://127.0.0.1:{free_port()}", socket_timeout=0.5)


def test_ids_with_braces_keep_to_their_own_session(cluster_store: RedisStore) -> None:
    # Given sessions whose ids look like hash tags or like other sessions' key suffixes
    for version, session_id in enumerate(BRACE_IDS, start=1):
        assert cluster_store.save(make_checkpoint(session_id, version=version), seq=1).applied
    # When half of them are deleted
    for session_id in BRACE_IDS[::2]:
        assert cluster_store.delete(session_id, seq=2)
    # Then the others are untouched, and every script ran in one slot (no CROSSSLOT)
    for version, session_id in enumerate(BRACE_IDS, start=1):
        loaded = cluster_store.load(session_id)
        if session_id in BRACE_IDS[::2]:
            assert loaded is None
        else:
            assert loaded is not None and loaded.version == version
    assert sorted(cluster_store.list()) == sorted(BRACE_IDS[1::2])


def test_sessions_spread_evenly_over_all_three_masters(
    redis_cluster: LocalCluster, cluster_store: RedisStore
) -> None:
    ids = [f"user-{i}" for i in range(3000)]
    for session_id in ids:
        cluster_store.save(make_checkpoint(session_id, messages=0), seq=1)
    prefix = cluster_store.keys.prefix
    per_master = []
    for master in redis_cluster.masters_info():
        probe = redis_cluster.node(master.port).client()
        try:
            per_master.append(sum(1 for _ in probe.scan_iter(match=f"{prefix}:*", count=1000)))
        finally:
            probe.close()
    assert sum(per_master) == len(ids)
    assert len(per_master) == 3 and all(900 <= n <= 1100 for n in per_master), per_master


def test_paging_walks_every_slot_on_every_node_once(cluster_store: RedisStore) -> None:
    ids = {f"p{i}" for i in range(400)}
    for session_id in ids:
        cluster_store.save(make_checkpoint(session_id, messages=0), seq=1)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = cluster_store.list_page(cursor, count=37)
        seen.extend(page.session_ids)
        pages += 1
        if page.cursor is None:
            break
        slot, _, inner = page.cursor.partition(":")
        assert 0 <= int(slot) < REDIS_CLUSTER_HASH_SLOTS and int(inner) >= 0
        cursor = page.cursor
    assert sorted(seen) == sorted(ids)
    assert pages >= len(ids) // 37


@pytest.mark.parametrize("cursor", ["x", "16384:0", "-1:0", "3:-5", "a:b"])
def test_foreign_cursor_is_invalid_input(cluster_store: RedisStore, cursor: str) -> None:
    with pytest.raises(InvalidInput, match="cursor"):
        cluster_store.list_page(cursor)


def test_sweep_expires_due_sessions_on_every_node_exactly_once(
    redis_cluster: LocalCluster, cluster_store: RedisStore
) -> None:
    # Given 300 sessions over all slots, and a clock past their deadline
    ids = {f"e{i}" for i in range(300)}
    for session_id in ids:
        cluster_store.save(make_checkpoint(session_id, messages=0), seq=1)
    later = cluster_store.clock() + cluster_store.options.ttl_seconds + 1
    # When sweeps of at most 70 run until one finds nothing
    sweeps: list[list[str]] = []
    while not sweeps or sweeps[-1]:
        sweeps.append(cluster_store.expire_stale(now=later, limit=70))
    # Then each sweep kept its limit and every session expired exactly once
    expired = [session_id for sweep in sweeps for session_id in sweep]
    assert all(len(sweep) <= 70 for sweep in sweeps)
    assert sorted(expired) == sorted(ids)
    assert len(sweeps) == 1 + -(-len(ids) // 70)
    assert cluster_store.list() == []
    for master in redis_cluster.masters_info():
        probe = redis_cluster.node(master.port).client()
        try:
            assert not list(probe.scan_iter(match=f"{cluster_store.keys.prefix}:*"))
        finally:
            probe.close()


def test_reconciliation_scans_every_primary_and_fixes_the_index(
    cluster_store: RedisStore,
) -> None:
    # Given 200 sessions over every node, 50 whose index entry was lost and 50 whose value
    # was deleted directly,
    ids = [f"r{i}" for i in range(200)]
    for session_id in ids:
        cluster_store.save(make_checkpoint(session_id, messages=0), seq=1)
    client = cluster_store.client
    for session_id in ids[:50]:
        client.zrem(cluster_store.keys.session(session_id).index, session_id)
    for session_id in ids[50:100]:
        client.delete(cluster_store.keys.data(session_id))
    # when reconciliation runs to the end of a pass in small slices,
    adopted: list[str] = []
    dropped: list[str] = []
    while True:
        report = cluster_store.reconcile(budget=250)
        adopted += report.adopted
        dropped += report.dropped
        if report.completed_pass:
            break
    # then the lost entries are back, the gone values' entries are dropped,
    assert sorted(adopted) == sorted(ids[:50])
    assert sorted(dropped) == sorted(ids[50:100])
    assert sorted(cluster_store.list()) == sorted(ids[:50] + ids[100:])
    # and reindex (the same pass, to completion) finds nothing left to do.
    assert cluster_store.reindex() == 0


def test_go_and_checkpointq_share_the_cluster_on_gos_keys(cluster_store: RedisStore) -> None:
    # Given a session Go's RedisStore wrote (SET <prefix>:<id>, no index), and one of ours
    client = cluster_store.client
    prefix = cluster_store.keys.prefix
    client.set(f"{prefix}:from-go", serialize_checkpoint(make_checkpoint("from-go")), ex=3600)
    assert cluster_store.save(make_checkpoint("from-us", version=4), seq=1).applied
    # Then each side reads the other's at the same key, and reindex adopts Go's
    assert cluster_store.load("from-go") == make_checkpoint("from-go")
    assert client.get(f"{prefix}:from-us") is not None
    assert cluster_store.reindex() == 1
    assert sorted(cluster_store.list()) == ["from-go", "from-us"]


def _write_sharded_session(
    store: RedisStore, old: ShardedKeySpace, shard: int, session_id: str, seq: int
) -> None:
    """A session as the earlier cluster layout kept it (all three keys in the shard's slot)."""
    client = store.client
    value = store.codec.encode(serialize_checkpoint(make_checkpoint(session_id, version=seq)))
    client.set(old.data(shard, session_id), value, px=3_600_000)
    client.hset(old.fence(shard, session_id), mapping={"seq": seq, "deleted": "0"})
    client.zadd(old.index(shard), {session_id: int(store.clock() * 1000) + 3_600_000})


def test_migration_moves_sharded_sessions_to_gos_keys(cluster_store: RedisStore) -> None:
    # Given sessions of the earlier sharded layout, one of them already re-saved (newer) here
    old = ShardedKeySpace(cluster_store.keys.prefix, 64)
    ids = [f"m{i}" for i in range(50)]
    for i, session_id in enumerate(ids):
        _write_sharded_session(cluster_store, old, i % 64, session_id, seq=10)
    assert cluster_store.save(make_checkpoint("m0", version=99), seq=11).applied
    # When the migration runs (twice: it is idempotent)
    assert cluster_store.migrate_sharded_layout(shards=64, batch=7) == len(ids) - 1
    assert cluster_store.migrate_sharded_layout(shards=64) == 0
    # Then every session is at Go's key with its value, TTL and seq; the newer save won
    for i, session_id in enumerate(ids):
        loaded = cluster_store.load(session_id)
        assert loaded == make_checkpoint(session_id, version=99 if i == 0 else 10)
        fence = cluster_store.fence(session_id)
        assert fence is not None and fence.seq == (11 if i == 0 else 10)
        assert cluster_store.client.pttl(cluster_store.keys.data(session_id)) > 3_000_000
        assert not cluster_store.client.exists(
            old.data(i % 64, session_id), old.fence(i % 64, session_id)
        )
    assert sorted(cluster_store.list()) == sorted(ids)
    assert not any(cluster_store.client.zcard(old.index(shard)) for shard in range(64))
    # and a later older save stays refused by the carried-over seq
    assert not cluster_store.save(make_checkpoint("m5", version=1), seq=9).applied


def test_migration_is_refused_on_a_single_redis_layout() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(InvalidInput, match="cluster"):
        store.migrate_sharded_layout()
