"""The fence names the request that won, so a producer can tell its own request's outcome.

Part of the store contract (every store passes these). Given / When / Then.
"""

from __future__ import annotations

from checkpointq.store import CheckpointStore
from checkpointq.store.base import DeleteOp, Fence, SaveOp
from tests.support.checkpoints import make_checkpoint


def test_fence_names_the_request_that_won(store: CheckpointStore) -> None:
    # When two saves apply in turn
    store.save(make_checkpoint("s1", version=1), seq=10, request_id="a")
    store.save(make_checkpoint("s1", version=2), seq=20, request_id="b")
    # Then the fence names the second, and a delete's tombstone names the delete
    assert store.fence("s1") == Fence(20, False, "b", live=True)
    store.delete("s1", seq=30, request_id="c")
    assert store.fence("s1") == Fence(30, True, "c")


def test_load_with_fence_returns_the_value_and_the_fence_together(store: CheckpointStore) -> None:
    # Given a saved session and a deleted one
    cp = make_checkpoint("s1", version=4)
    store.save(cp, seq=10, request_id="a")
    store.delete("gone", seq=7, request_id="d")
    # Then each reads back with its fence (a tombstone has a fence and no value)
    assert store.load_with_fence("s1") == (cp, Fence(10, False, "a", live=True))
    assert store.load_with_fence("gone") == (None, Fence(7, True, "d"))
    assert store.load_with_fence("never") == (None, None)


def test_saves_stamped_alike_are_ordered_by_request_id_in_either_arrival_order(
    store: CheckpointStore,
) -> None:
    # Given a save applied at seq 10 by request "b"
    store.save(make_checkpoint("s1", version=2), seq=10, request_id="b")
    # When request "a", stamped alike, arrives later, then "b" again
    other = store.save(make_checkpoint("s1", version=1), seq=10, request_id="a")
    duplicate = store.save(make_checkpoint("s1", version=2), seq=10, request_id="b")
    # Then "a" lost to the request ordered after it (so its producer can be told it was
    # superseded) and the duplicate is harmless
    assert not other.applied and duplicate.applied
    loaded = store.load("s1")
    assert loaded is not None and loaded.version == 2
    assert store.fence("s1") == Fence(10, False, "b", live=True)
    # And in the other arrival order the end is the same: "b" wins over "a"
    store.save(make_checkpoint("s2", version=1), seq=10, request_id="a")
    assert store.save(make_checkpoint("s2", version=2), seq=10, request_id="b").applied
    assert store.fence("s2") == Fence(10, False, "b", live=True)


def test_request_ids_are_ordered_byte_by_byte(store: CheckpointStore) -> None:
    # "Z" (0x5a) sorts before "a" (0x61) and a prefix before its extensions, whatever the
    # locale of the Redis server (whose Lua compares strings with strcoll)
    store.save(make_checkpoint("s1", version=1), seq=10, request_id="a")
    assert not store.save(make_checkpoint("s1", version=2), seq=10, request_id="Z").applied
    assert store.save(make_checkpoint("s1", version=3), seq=10, request_id="ab").applied
    assert not store.save(make_checkpoint("s1", version=4), seq=10, request_id="a-b").applied
    assert store.fence("s1") == Fence(10, False, "ab", live=True)


def test_a_delete_still_wins_a_tie_with_another_requests_save(store: CheckpointStore) -> None:
    store.save(make_checkpoint("s1"), seq=10, request_id="z")
    assert store.delete("s1", seq=10, request_id="b")
    assert not store.save(make_checkpoint("s1"), seq=10, request_id="z").applied
    assert store.fence("s1") == Fence(10, True, "b")


def test_deletes_stamped_alike_are_ordered_by_request_id(store: CheckpointStore) -> None:
    assert store.delete("s1", seq=10, request_id="b")
    assert not store.delete("s1", seq=10, request_id="a")
    assert store.delete("s1", seq=10, request_id="b")
    assert store.delete("s1", seq=10, request_id="c")
    assert store.fence("s1") == Fence(10, True, "c")


def test_batch_items_carry_their_own_request_ids(store: CheckpointStore) -> None:
    results = store.apply_batch(
        [
            SaveOp(make_checkpoint("s1", version=1), 10, "t:0"),
            SaveOp(make_checkpoint("s1", version=2), 10, "t:1"),
            DeleteOp("s2", 5, "t:2"),
        ]
    )
    assert [getattr(r, "applied", r) for r in results] == [True, True, True]
    assert store.fence("s1") == Fence(10, False, "t:1", live=True)
    assert store.fence("s2") == Fence(5, True, "t:2")
