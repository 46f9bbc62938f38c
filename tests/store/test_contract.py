"""The store contract: every store (memory, fakeredis, real Redis) passes these tests.

Written as Given / When / Then; each test is named after the behaviour it proves.
"""

from __future__ import annotations

import base64
import hashlib

import pytest

from checkpointq.store import (
    CheckpointStore,
    CheckpointTooLarge,
    CorruptCheckpoint,
    InvalidInput,
    InvalidSessionId,
)
from checkpointq.store.base import MAX_SEQ, SessionCounts
from tests.store.conftest import StoreEnv
from tests.support.checkpoints import make_checkpoint

# -- saving and loading -------------------------------------------------------------------


def test_saved_checkpoint_loads_back_equal(store: CheckpointStore) -> None:
    cp = make_checkpoint("s1", version=3, last_run_ref="run-7")
    result = store.save(cp, seq=100)
    assert result.applied
    assert result.ref == f"{store.ref_scheme}://s1/v3"
    assert store.load("s1") == cp


def test_ref_scheme_matches_backend(store_env: StoreEnv) -> None:
    store = store_env.store()
    expected = "memory" if store_env.backend == "memory" else "session"
    assert store.save(make_checkpoint("s1", version=2)).ref == f"{expected}://s1/v2"


def test_loading_unknown_session_returns_none(store: CheckpointStore) -> None:
    assert store.load("nobody") is None


def test_unknown_fields_survive_a_round_trip(store: CheckpointStore) -> None:
    cp = make_checkpoint("s1").model_validate(
        {
            "sessionId": "s1",
            "version": 1,
            "futureField": {"nested": [1, 2.5, None, True]},
            "metadata": {"totalTokens": 3, "region": "eu"},
            "conversationHistory": [{"role": "user", "content": "x", "toolCalls": [{"id": 9}]}],
        },
        by_alias=True,
        by_name=False,
    )
    store.save(cp, seq=1)
    loaded = store.load("s1")
    assert loaded is not None
    assert loaded.extra_fields == {"futureField": {"nested": [1, 2.5, None, True]}}
    assert loaded.metadata.extra_fields == {"region": "eu"}
    assert loaded.conversation_history[0].extra_fields == {"toolCalls": [{"id": 9}]}


# -- fencing by seq -----------------------------------------------------------------------


def test_older_save_arriving_late_does_not_overwrite_newer(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1", version=2), seq=200)
    result = store.save(make_checkpoint("s1", version=1), seq=100)
    assert not result.applied
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 2


def test_same_request_applied_twice_is_idempotent(store: CheckpointStore) -> None:
    cp = make_checkpoint("s1", version=4)
    assert store.save(cp, seq=50).applied
    assert store.save(cp, seq=50).applied
    assert store.load("s1") == cp


def test_same_version_saved_twice_keeps_the_later_request(store: CheckpointStore) -> None:
    # The Go API server saves a version without, then with, lastRunRef.
    store.save(make_checkpoint("s1", version=5), seq=10)
    store.save(make_checkpoint("s1", version=5, last_run_ref="run-5"), seq=11)
    loaded = store.load("s1")
    assert loaded is not None and loaded.last_run_ref == "run-5"


def test_new_conversation_reusing_an_id_restarts_at_version_one(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1", version=9), seq=10)
    assert store.save(make_checkpoint("s1", version=1), seq=20).applied
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 1


def test_late_save_does_not_resurrect_deleted_session(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1"), seq=10)
    assert store.delete("s1", seq=30)
    assert not store.save(make_checkpoint("s1", version=2), seq=20).applied
    assert store.load("s1") is None
    assert "s1" not in store.list()


def test_newer_save_after_delete_recreates_session(store: CheckpointStore) -> None:
    store.delete("s1", seq=30)
    assert store.save(make_checkpoint("s1", version=1), seq=31).applied
    assert store.load("s1") is not None


def test_delete_wins_over_save_with_equal_seq_in_either_order(store: CheckpointStore) -> None:
    store.save(make_checkpoint("a"), seq=5)
    store.delete("a", seq=5)
    store.delete("b", seq=5)
    store.save(make_checkpoint("b"), seq=5)
    assert store.load("a") is None
    assert store.load("b") is None


def test_stale_delete_leaves_newer_save_in_place(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1"), seq=50)
    assert not store.delete("s1", seq=40)
    assert store.load("s1") is not None


def test_deleting_unknown_session_is_applied(store: CheckpointStore) -> None:
    assert store.delete("ghost", seq=1)
    assert store.load("ghost") is None


def test_requests_without_seq_are_stamped_with_now(store: CheckpointStore) -> None:
    first = store.save(make_checkpoint("s1", version=1))
    second = store.save(make_checkpoint("s1", version=2))
    assert first.applied and second.applied
    assert 0 < first.seq <= second.seq <= MAX_SEQ
    fence = store.fence("s1")
    assert fence is not None and fence.seq == second.seq and not fence.deleted


def test_fence_reports_last_applied_request(store: CheckpointStore) -> None:
    assert store.fence("s1") is None
    store.save(make_checkpoint("s1"), seq=7)
    store.delete("s1", seq=9)
    fence = store.fence("s1")
    assert fence is not None and (fence.seq, fence.deleted) == (9, True)


def test_fence_says_whether_the_value_is_live(store: CheckpointStore) -> None:
    store.save(make_checkpoint("saved"), seq=1)
    store.save(make_checkpoint("deleted"), seq=1)
    store.delete("deleted", seq=2)
    saved, deleted = store.fence("saved"), store.fence("deleted")
    assert saved is not None and saved.live
    assert deleted is not None and not deleted.live
    store.expire_stale(now=store.clock() + store.options.ttl_seconds + 1)
    expired = store.fence("saved")
    assert expired is not None and not expired.live


@pytest.mark.parametrize("seq", [-1, MAX_SEQ + 1, 1.5, True, "12"])
def test_invalid_seq_is_rejected(store: CheckpointStore, seq: object) -> None:
    with pytest.raises(InvalidInput, match="seq"):
        store.save(make_checkpoint("s1"), seq=seq)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="seq"):
        store.delete("s1", seq=seq)  # type: ignore[arg-type]


# -- TTL, refresh and expiry -----------------------------------------------------------------


def test_session_past_its_ttl_is_invisible_before_any_sweep(store_env: StoreEnv) -> None:
    store = store_env.store(ttl_seconds=1.0)
    store.save(make_checkpoint("s1"), seq=1)
    assert store.list() == ["s1"]
    store_env.pass_time(1.3)
    assert store.load("s1") is None
    assert store.list() == []


def test_refresh_extends_lifetime_without_rewriting(store_env: StoreEnv) -> None:
    store = store_env.store(ttl_seconds=2.0)
    cp = make_checkpoint("s1", version=6)
    store.save(cp, seq=1)
    store_env.pass_time(1.2)
    assert store.refresh("s1")
    store_env.pass_time(1.2)  # 2.4 s after the save, 1.2 s after the refresh
    assert store.load("s1") == cp
    assert store.list() == ["s1"]
    fence = store.fence("s1")
    assert fence is not None and fence.seq == 1


def test_every_save_extends_lifetime(store_env: StoreEnv) -> None:
    store = store_env.store(ttl_seconds=2.0)
    store.save(make_checkpoint("s1", version=1), seq=1)
    store_env.pass_time(1.2)
    store.save(make_checkpoint("s1", version=2), seq=2)
    store_env.pass_time(1.2)
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 2


def test_refreshing_absent_or_deleted_session_returns_false(store: CheckpointStore) -> None:
    assert not store.refresh("nobody")
    store.save(make_checkpoint("s1"), seq=1)
    store.delete("s1", seq=2)
    assert not store.refresh("s1")


def test_sweep_expires_only_stale_sessions_and_returns_their_ids(store_env: StoreEnv) -> None:
    short = store_env.store(ttl_seconds=1.0)
    for i in range(5):
        short.save(make_checkpoint(f"old-{i}"), seq=1)
    store_env.pass_time(1.3)
    short.save(make_checkpoint("fresh"), seq=2)
    assert sorted(short.expire_stale()) == [f"old-{i}" for i in range(5)]
    assert short.list() == ["fresh"]
    assert short.expire_stale() == []


def test_sweep_respects_its_limit_and_the_next_sweep_carries_on(store_env: StoreEnv) -> None:
    store = store_env.store(ttl_seconds=1.0)
    for i in range(7):
        store.save(make_checkpoint(f"s{i}"), seq=1)
    store_env.pass_time(1.3)
    first = store.expire_stale(limit=4)
    second = store.expire_stale(limit=4)
    assert len(first) == 4 and len(second) == 3
    assert sorted(first + second) == sorted(f"s{i}" for i in range(7))


def test_sweep_with_explicit_now_expires_what_is_due_then(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1"), seq=1)
    assert store.expire_stale(now=store.clock() + 1) == []
    assert store.expire_stale(now=store.clock() + store.options.ttl_seconds + 1) == ["s1"]
    assert store.load("s1") is None


def test_fence_outlives_expiry_so_a_late_older_save_stays_refused(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1", version=2), seq=20)
    store.expire_stale(now=store.clock() + store.options.ttl_seconds + 1)
    assert not store.save(make_checkpoint("s1", version=1), seq=10).applied
    assert store.save(make_checkpoint("s1", version=3), seq=30).applied


# -- listing ---------------------------------------------------------------------------


def test_list_pages_through_every_live_session_exactly_once(store: CheckpointStore) -> None:
    ids = {f"s{i:03d}" for i in range(250)}
    for session_id in ids:
        store.save(make_checkpoint(session_id, messages=0), seq=1)
    store.delete("s000", seq=2)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = store.list_page(cursor, count=50)
        seen.extend(page.session_ids)
        pages += 1
        if page.cursor is None:
            break
        cursor = page.cursor
    assert set(seen) == ids - {"s000"}
    assert sorted(store.list()) == sorted(ids - {"s000"})
    assert pages > 1 or len(seen) == 249


# -- size limits -----------------------------------------------------------------------


def test_a_cursor_the_store_never_returned_is_invalid_input(store: CheckpointStore) -> None:
    store.save(make_checkpoint("listed"))
    with pytest.raises(InvalidInput, match="not a cursor"):
        store.list_page("not-a-cursor!", count=10)


def test_history_is_capped_to_most_recent_messages(store_env: StoreEnv) -> None:
    store = store_env.store(history_cap=100)
    result = store.save(make_checkpoint("s1", messages=150), seq=1)
    assert result.trimmed == 50
    loaded = store.load("s1")
    assert loaded is not None
    assert len(loaded.conversation_history) == 100
    assert loaded.conversation_history[0].content.startswith("message 50 ")


def test_oversize_checkpoint_drops_oldest_messages_to_fit_budget(store_env: StoreEnv) -> None:
    store = store_env.store(max_value_bytes=4096, compression_level=1)
    cp = make_checkpoint("s1", messages=40, content_size=2000)
    cp = cp.model_copy(
        update={
            "conversation_history": [
                m.model_copy(update={"content": f"{i} " + _noise(i, 1500)})
                for i, m in enumerate(cp.conversation_history)
            ]
        }
    )
    result = store.save(cp, seq=1)
    assert result.applied and 0 < result.trimmed < 40
    assert result.stored_bytes <= 4096
    loaded = store.load("s1")
    assert loaded is not None
    assert loaded.conversation_history[-1].content.startswith("39 ")
    assert len(loaded.conversation_history) == 40 - result.trimmed


def test_checkpoint_whose_last_message_alone_is_too_big_is_rejected(
    store_env: StoreEnv,
) -> None:
    store = store_env.store(max_value_bytes=1024)
    cp = make_checkpoint("s1", messages=1)
    cp = cp.model_copy(
        update={
            "conversation_history": [
                cp.conversation_history[0].model_copy(update={"content": _noise(1, 20_000)})
            ]
        }
    )
    with pytest.raises(CheckpointTooLarge, match="most recent message"):
        store.save(cp, seq=1)
    assert store.load("s1") is None


def _noise(seed: int, length: int) -> str:
    """Text that zstd cannot shrink much (a cheap deterministic generator)."""
    state = seed * 2654435761 % 2**32 or 1
    chars = []
    for _ in range(length):
        state = (state * 1103515245 + 12345) % 2**31
        chars.append(chr(33 + state % 94))
    return "".join(chars)


# -- session ids -----------------------------------------------------------------------

HOSTILE_IDS = ["*", "?", "[a-z]", "{x}", "a:b", "..", "../etc", "s1*", "\U0001f916", "x" * 256]


def test_ids_with_glob_and_separator_characters_only_touch_their_own_session(
    store: CheckpointStore,
) -> None:
    store.save(make_checkpoint("s1", version=1), seq=1)
    for i, session_id in enumerate(HOSTILE_IDS):
        store.save(make_checkpoint(session_id, version=i + 2), seq=1)
    for i, session_id in enumerate(HOSTILE_IDS):
        loaded = store.load(session_id)
        assert loaded is not None and loaded.version == i + 2
    for session_id in HOSTILE_IDS:
        assert store.delete(session_id, seq=2)
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 1
    assert store.list() == ["s1"]


#: Ids Go accepts and writes (any non-empty string): each must save, load, list, refresh,
#: delete and expire here too.
GO_IDS = ["tab\there", "ls\u2028ps\u2029", "x" * 300, "nul\x00", "bidi\u202eevil", "a b\n"]


def test_ids_go_accepts_work_everywhere(store: CheckpointStore) -> None:
    for i, session_id in enumerate(GO_IDS):
        assert store.save(make_checkpoint(session_id, version=i + 1), seq=1).applied
    assert sorted(store.list()) == sorted(GO_IDS)
    for i, session_id in enumerate(GO_IDS):
        loaded = store.load(session_id)
        assert loaded is not None and loaded.version == i + 1
        assert store.refresh(session_id)
    assert store.delete(GO_IDS[0], seq=2)
    assert sorted(store.list()) == sorted(GO_IDS[1:])
    later = store.clock() + store.options.ttl_seconds + 1
    assert sorted(store.expire_stale(now=later)) == sorted(GO_IDS[1:])
    assert store.list() == []


def _incompressible(size: int, seed: str) -> str:
    """``size`` characters of base64 from a hash chain: PostgreSQL compresses an index
    entry before it judges its size, so a repetitive id would fit where this one cannot."""
    out, block = "", seed.encode()
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += base64.b64encode(block).decode()
    return out[:size]


#: Ids longer than a btree entry may be (about 2,700 bytes): a Redis key holds them, and so
#: must every store (issue 39: PostgreSQL refused them as "index row size 6016").
LONG_IDS = [
    _incompressible(6000, "a"),
    "\u00e9\x00" + _incompressible(5997, "b"),
    _incompressible(100_000, "c"),
]


def test_long_session_ids_work_on_every_store(store: CheckpointStore) -> None:
    # Given sessions whose ids are 6,000 bytes (one with NULs and two-byte characters) and
    # 100,000 bytes, When each is saved, read, refreshed, listed, deleted and swept
    for i, session_id in enumerate(LONG_IDS):
        assert store.save(make_checkpoint(session_id, version=i + 1), seq=10).applied
    # Then every store holds each as any other id
    assert sorted(store.list()) == sorted(LONG_IDS)
    for i, session_id in enumerate(LONG_IDS):
        loaded = store.load(session_id)
        assert loaded is not None and loaded.version == i + 1
        assert loaded.session_id == session_id
        fence = store.fence(session_id)
        assert fence is not None and fence.seq == 10
        assert store.refresh(session_id)
    assert store.delete(LONG_IDS[0], seq=11)
    assert not store.save(make_checkpoint(LONG_IDS[0], version=9), seq=10).applied
    assert store.load(LONG_IDS[0]) is None
    assert sorted(store.list()) == sorted(LONG_IDS[1:])
    later = store.clock() + store.options.ttl_seconds + 1
    assert sorted(store.expire_stale(now=later)) == sorted(LONG_IDS[1:])


@pytest.mark.parametrize("bad_id", ["", "a\ud800b", 42])
def test_unacceptable_session_ids_are_rejected_everywhere(
    store: CheckpointStore, bad_id: object
) -> None:
    for call in (store.load, store.delete, store.refresh, store.fence):
        with pytest.raises(InvalidSessionId):
            call(bad_id)  # type: ignore[arg-type]


# -- corrupt data ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\x01not json", b"\x28\xb5\x2f\xfdbroken frame", b'{"version": "three"}', b"{"],
)
def test_corrupt_value_fails_that_session_only(store_env: StoreEnv, garbage: bytes) -> None:
    store = store_env.store()
    store.save(make_checkpoint("good"), seq=1)
    store.save(make_checkpoint("bad"), seq=1)
    store_env.corrupt(store, "bad", garbage)
    with pytest.raises(CorruptCheckpoint, match="'bad'"):
        store.load("bad")
    assert store.load("good") is not None
    assert sorted(store.list()) == ["bad", "good"]
    later = store.clock() + store.options.ttl_seconds + 60
    assert sorted(store.expire_stale(now=later)) == ["bad", "good"]


def test_tombstone_is_forgotten_after_its_ttl(store_env: StoreEnv) -> None:
    store = store_env.store(tombstone_ttl_seconds=1.0)
    store.delete("s1", seq=50)
    assert not store.save(make_checkpoint("s1"), seq=40).applied
    store_env.pass_time(1.3)
    store.expire_stale()
    assert store.fence("s1") is None
    assert store.save(make_checkpoint("s1"), seq=40).applied


def test_count_sessions_tells_live_from_expired_not_yet_swept(store: CheckpointStore) -> None:
    assert store.count_sessions() == SessionCounts(0, 0)
    for session_id in ("a", "b", "c"):
        store.save(make_checkpoint(session_id), seq=1)
    store.delete("c", seq=2)
    assert store.count_sessions() == SessionCounts(live=2, expired=0)
    later = store.clock() + store.options.ttl_seconds + 1
    assert store.count_sessions(now=later) == SessionCounts(live=0, expired=2)
    store.expire_stale(now=later)
    assert store.count_sessions(now=later) == SessionCounts(0, 0)
