"""The Redis Cluster layout: one slot per session's scripts, even spread, paging and sweeping
across every node. The contract suite itself runs on the cluster through ``store_env``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from checkpointq.store import InvalidInput, RedisStore, StoreUnavailable
from checkpointq.store.cluster import is_cluster_url
from checkpointq.store.keys import ClusterKeySpace, KeySpace, shard_tags
from tests.support.checkpoints import make_checkpoint
from tests.support.cluster import LocalCluster
from tests.support.servers import free_port

_prefixes = itertools.count()
BRACE_IDS = ["{", "}", "{}", "}{", "{x}", "a{b}c", "{17290}:x", "}:{", "{{a}}", "x}:fence:y"]


@pytest.fixture
def cluster_store(redis_cluster: LocalCluster) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis_cluster.url, prefix=f"cl{next(_prefixes)}")
    yield store
    store.close()


def _slot(key: str) -> int:
    return key_slot(key.encode())


# -- the layout, without a cluster --------------------------------------------------------


@given(session_id=st.text(min_size=1, max_size=40))
def test_every_key_of_a_session_lands_in_its_shards_slot(session_id: str) -> None:
    keys = ClusterKeySpace("agentorca-session", 1024)
    session = keys.session(session_id)
    expected = keys.shard(session_id) * REDIS_CLUSTER_HASH_SLOTS // 1024
    assert {_slot(session.data), _slot(session.fence), _slot(session.index)} == {expected}


@given(first=st.text(min_size=1, max_size=20), second=st.text(min_size=1, max_size=20))
def test_no_two_sessions_share_a_data_or_fence_key(first: str, second: str) -> None:
    keys = ClusterKeySpace("p", 64)
    if first != second:
        assert keys.data(first) != keys.data(second)
        assert keys.fence(first) != keys.fence(second)
    assert keys.session_id_from_data_key(keys.data(first)) == first


def test_shards_sit_evenly_over_the_slots_so_three_masters_hold_a_third_each() -> None:
    tags = shard_tags(1024)
    slots = [key_slot(tag.encode()) for tag in tags]
    assert slots == [shard * 16 for shard in range(1024)]
    thirds = [sum(1 for slot in slots if low <= slot <= high) for low, high in _THIRDS]
    assert max(thirds) - min(thirds) <= 1


_THIRDS = [(0, 5460), (5461, 10922), (10923, 16383)]


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
        store = RedisStore.from_url(url, prefix=f"cl{next(_prefixes)}", shards=64)
        try:
            assert isinstance(store.client, RedisCluster)
            assert isinstance(store.keys, ClusterKeySpace) and store.keys.shards == 64
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


def test_paging_walks_every_shard_on_every_node_once(cluster_store: RedisStore) -> None:
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
        shard, _, inner = page.cursor.partition(":")
        assert 0 <= int(shard) < 1024 and int(inner) >= 0
        cursor = page.cursor
    assert sorted(seen) == sorted(ids)
    assert pages >= len(ids) // 37


@pytest.mark.parametrize("cursor", ["x", "2000:0", "-1:0", "3:-5", "a:b"])
def test_foreign_cursor_is_invalid_input(cluster_store: RedisStore, cursor: str) -> None:
    with pytest.raises(InvalidInput, match="cursor"):
        cluster_store.list_page(cursor)


def test_sweep_expires_due_sessions_on_every_node_exactly_once(
    redis_cluster: LocalCluster, cluster_store: RedisStore
) -> None:
    # Given 300 sessions over all shards, and a clock past their deadline
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
