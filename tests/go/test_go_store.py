"""checkpointq beside a real Go program storing as the Go checkpoint package's RedisStore
(tests/go/gostore: encoding/json, klauspost zstd, SET EX 30 d / GET / DEL / SCAN), on one
private redis-server: each reads what the other wrote, and mixed writers lose nothing."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import zstandard

from checkpointq.store import RedisStore, StoreOptions, serialize_checkpoint
from checkpointq.store.encryption import Keyring, generate_key
from checkpointq.store.serde import checkpoint_to_wire
from tests.support.checkpoints import make_checkpoint
from tests.support.clocks import FakeClock
from tests.support.gostore import GoStore, GoStoreError

GO_TTL_SECONDS = 30 * 24 * 60 * 60

#: Every field set, HTML-escaped characters, non-ASCII, and a cost Go formats from +Inf.
FULL: dict[str, Any] = {
    "sessionId": "sess-42",
    "version": 7,
    "conversationHistory": [
        {"role": "user", "content": "<b>Hi</b> & bye ☃"},
        {"role": "assistant", "content": "Hello!", "traceEntries": '[{"tool":"search"}]'},
    ],
    "metadata": {
        "totalMessages": 2,
        "totalTokens": 1234,
        "totalCostUSD": "0.012300",
        "startTime": "2026-12-02T08:30:00Z",
        "lastMessageTime": "2026-12-02T08:31:05Z",
    },
    "lastRunRef": "agentrun-sess-42-7",
}

#: Session ids Go accepts (any non-empty string) that a stricter rule used to refuse.
ODD_IDS = ["tab\there", "line\u2028separator", "x" * 300, "bidi\u202eevil", "a b"]


def _document(session_id: str, version: int = 1, cost: str = "") -> dict[str, Any]:
    meta = {"totalMessages": 1, "totalCostUSD": cost} if cost else {"totalMessages": 1}
    return {
        "sessionId": session_id,
        "version": version,
        "conversationHistory": [{"role": "user", "content": f"v{version}"}],
        "metadata": meta,
    }


def _go_and_our_bytes(
    go_store: GoStore, real_redis: redis.Redis, document: dict[str, Any]
) -> tuple[bytes, bytes]:
    """The JSON Go stored for ``document``, and ours for the checkpoint we load from it."""
    go_store.save(document)
    raw = real_redis.get(f"agentorca-session:{document['sessionId']}")
    assert isinstance(raw, bytes)
    go_json = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 20)
    loaded = RedisStore(real_redis).load(document["sessionId"])
    assert loaded is not None
    return go_json, serialize_checkpoint(loaded)


def test_we_read_byte_for_byte_what_go_wrote(go_store: GoStore, real_redis: redis.Redis) -> None:
    go_json, ours = _go_and_our_bytes(go_store, real_redis, FULL)
    # Our serializer writes exactly the bytes Go's json.Marshal wrote (escapes included).
    assert ours == go_json
    assert 0 < real_redis.ttl("agentorca-session:sess-42") <= GO_TTL_SECONDS


def test_times_before_year_1000_are_written_as_go_writes_them(
    go_store: GoStore, real_redis: redis.Redis
) -> None:
    early = {**FULL, "metadata": {"startTime": "0005-06-07T08:09:10Z"}}
    go_json, ours = _go_and_our_bytes(go_store, real_redis, early)
    assert b'"startTime":"0005-06-07T08:09:10Z"' in go_json
    assert ours == go_json


@pytest.mark.parametrize("staged", [False, True], ids=["as-argument", "staged"])
def test_go_reads_what_we_wrote(go_store: GoStore, real_redis: redis.Redis, staged: bool) -> None:
    store = RedisStore(real_redis)
    if staged:  # the path of large values: through a staging key renamed onto Go's key
        store.stage_from_bytes = 0
    cp = store.save(make_checkpoint("ours", version=3), seq=1)
    assert cp.applied
    mine = store.load("ours")
    assert mine is not None
    assert go_store.load("ours") == checkpoint_to_wire(mine)
    assert go_store.list() == ["ours"]
    assert real_redis.keys("*staging*") == []


def test_any_cost_string_passes_both_ways(go_store: GoStore, real_redis: redis.Redis) -> None:
    store = RedisStore(real_redis)
    for i, cost in enumerate(["+Inf", "NaN", "-Inf"]):
        go_store.save(_document(f"go-{i}", cost=cost))
        loaded = store.load(f"go-{i}")
        assert loaded is not None and loaded.metadata.total_cost_usd == cost
        store.save(make_checkpoint(f"py-{i}").model_copy(update={"metadata": loaded.metadata}))
        from_go = go_store.load(f"py-{i}")
        assert from_go is not None and from_go["metadata"]["totalCostUSD"] == cost


def test_ids_go_wrote_load_list_refresh_delete_and_expire(
    go_store: GoStore, real_redis: redis.Redis
) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    for i, session_id in enumerate(ODD_IDS):
        go_store.save(_document(session_id, version=i + 1))
    assert go_store.list() == sorted(ODD_IDS)
    # Adopted by reconciliation, listed, and every one of them loads.
    assert sorted(store.reconcile(10_000).adopted) == sorted(ODD_IDS)
    assert sorted(store.list()) == sorted(ODD_IDS)
    for i, session_id in enumerate(ODD_IDS):
        loaded = store.load(session_id)
        assert loaded is not None and loaded.version == i + 1
    # Refreshed by us (the deadline becomes ours), deleted, expired.
    assert all(store.refresh(session_id) for session_id in ODD_IDS)
    assert store.delete(ODD_IDS[0])
    assert go_store.load(ODD_IDS[0]) is None
    clock.advance(store.options.ttl_seconds + 1)
    assert sorted(store.expire_stale()) == sorted(ODD_IDS[1:])
    assert go_store.list() == [] and store.list() == []


def test_sweep_keeps_the_checkpoint_go_saved_after_us(
    go_store: GoStore, real_redis: redis.Redis
) -> None:
    # Given a session saved through checkpointq (1 h TTL), then re-saved by Go,
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock, options=StoreOptions(ttl_seconds=3600))
    store.save(make_checkpoint("mixed", version=1), seq=1)
    go_store.save(_document("mixed", version=2))
    # when our old deadline passes and the sweep runs,
    clock.advance(3600 + 1)
    assert store.expire_stale() == []
    # then Go's newer checkpoint survives, for Go and for us, and stays listed.
    from_go = go_store.load("mixed")
    assert from_go is not None and from_go["version"] == 2
    loaded = store.load("mixed")
    assert loaded is not None and loaded.version == 2
    assert store.list() == ["mixed"]


def test_a_go_delete_leaves_list_and_the_fence_after_reconciliation(
    go_store: GoStore, real_redis: redis.Redis
) -> None:
    store = RedisStore(real_redis)
    store.save(make_checkpoint("bye"), seq=1)
    go_store.delete("bye")
    assert store.list() == ["bye"]  # until reconciliation runs
    report = store.reconcile(10_000)
    assert report.dropped == ["bye"]
    assert store.list() == []
    fence = store.fence("bye")
    assert fence is not None and not fence.live


def test_go_only_sessions_are_listed_and_swept_at_their_own_deadline(
    go_store: GoStore, real_redis: redis.Redis
) -> None:
    clock = FakeClock()
    store = RedisStore(real_redis, clock=clock)
    go_store.save(_document("go-only", version=5))
    assert store.list() == []
    assert store.reindex() == 1
    assert store.list() == ["go-only"]
    score = real_redis.zscore(store.keys.index(), "go-only")
    assert score is not None and score > (clock.now + GO_TTL_SECONDS - 60) * 1000
    # The sweep past our own TTL (but before Go's) leaves it alone: it is Go's value.
    clock.advance(store.options.ttl_seconds / 2)
    assert store.expire_stale() == []
    from_go = go_store.load("go-only")
    assert from_go is not None and from_go["version"] == 5


def test_the_go_store_fails_on_an_encrypted_value_and_its_clear_writes_stay_readable(
    go_store: GoStore, real_redis: redis.Redis
) -> None:
    # Given a deployment with encryption at rest (docs/security.md) beside the upstream Go store
    keys = Keyring.parse("k1:" + generate_key())
    store = RedisStore(real_redis, options=StoreOptions(encryption=keys))
    assert store.save(make_checkpoint("sealed", version=2), seq=1).applied
    # When the Go store reads a sealed value, Then it fails (it cannot decrypt), changing nothing
    with pytest.raises(GoStoreError):
        go_store.load("sealed")
    assert store.load("sealed") == make_checkpoint("sealed", version=2)
    # And what the Go store writes in clear still loads with the keys (rekey seals it later)
    go_store.save(_document("go-clear", version=5))
    loaded = store.load("go-clear")
    assert loaded is not None and loaded.version == 5
