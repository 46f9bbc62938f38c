"""How long a request may apply, and how long its fence guards (``store/ordering.py``).

Part of the store contract, on every backend. A ``seq`` from 2020 on is a time: a save lapses
at seq + TTL (never stored, as it would have expired by then), its value lives until that
deadline whenever it was applied, and a tombstone outlives the deadline of every request
ordered before it. Issue 31's holes 3 and 4: a save restored after a long outage neither
outlives a tombstone nor brings an expired session back. Given / When / Then.
"""

from __future__ import annotations

from checkpointq.store import CheckpointStore
from checkpointq.store.base import DeleteOp, Fence, LapseOp, SaveOp
from tests.store.conftest import StoreEnv
from tests.support.checkpoints import make_checkpoint


def now_us(store: CheckpointStore) -> int:
    return int(store.clock() * 1_000_000)


def test_a_save_past_its_deadline_is_never_stored(store: CheckpointStore) -> None:
    # Given a save stamped more than a TTL ago (it waited out an outage)
    seq = now_us(store) - int(store.options.ttl_seconds * 1_000_000) - 1
    # When it arrives
    result = store.save(make_checkpoint("s1"), seq=seq, request_id="late")
    # Then it lapses: not applied, nothing stored, and its fence says so
    assert result.lapsed and not result.applied
    assert store.load("s1") is None and store.list() == []
    assert store.fence("s1") == Fence(seq, False, "late", live=False, lapsed=True)


def test_a_lapsed_save_fences_out_older_requests_and_ends_an_older_value(
    store: CheckpointStore,
) -> None:
    # Given a session saved with a counter seq (a raw producer's), so live for a whole TTL
    assert store.save(make_checkpoint("s1", version=1), seq=10, request_id="old").applied
    # When a save ordered after it arrives past its deadline
    seq = now_us(store) - int(store.options.ttl_seconds * 1_000_000) - 1
    assert store.save(make_checkpoint("s1", version=2), seq=seq, request_id="late").lapsed
    # Then the older value is gone too (had the late save applied on time, the session
    # would have expired by now), and older requests stay out
    assert store.load("s1") is None
    assert not store.save(make_checkpoint("s1", version=3), seq=seq - 1).applied
    assert store.load("s1") is None


def test_a_lapse_op_settles_a_staged_save_without_its_value(store: CheckpointStore) -> None:
    seq = now_us(store) - int(store.options.ttl_seconds * 1_000_000) - 1
    results = store.apply_batch([LapseOp("s1", seq, "t:0"), DeleteOp("s2", seq, "t:1")])
    assert results == [True, True]
    assert store.fence("s1") == Fence(seq, False, "t:0", lapsed=True)
    # A lapse never beats a request ordered after it, nor repeats itself
    assert store.apply_batch([LapseOp("s2", seq, "t:2"), LapseOp("s1", seq, "t:0")]) == [
        False,
        False,
    ]


def test_a_batch_save_past_its_deadline_lapses(store: CheckpointStore) -> None:
    seq = now_us(store) - int(store.options.ttl_seconds * 1_000_000) - 1
    (result,) = store.apply_batch([SaveOp(make_checkpoint("s1"), seq, "t:0")])
    assert not isinstance(result, bool | Exception) and result.lapsed and not result.applied
    assert store.load("s1") is None


def test_a_value_lives_until_its_own_deadline_whenever_it_was_applied(
    store_env: StoreEnv,
) -> None:
    # Given a 3 s TTL and a save stamped 1.5 s ago (it sat in the queue that long)
    store = store_env.store(ttl_seconds=3.0)
    assert store.save(make_checkpoint("late"), seq=now_us(store) - 1_500_000).applied
    # And a save with a counter seq, which has no deadline of its own
    assert store.save(make_checkpoint("counter"), seq=7).applied
    # When 2 s pass
    store_env.pass_time(2.0)
    # Then the late save has expired (stamped + TTL), the counter's value is still live
    # (applied + TTL): no value outlives a request that was ordered after it
    assert store.load("late") is None
    assert store.load("counter") is not None


def test_a_tombstone_outlives_every_request_ordered_before_it(store_env: StoreEnv) -> None:
    # Given a 2 s TTL and a 0.5 s tombstone margin, and a session deleted now
    store = store_env.store(ttl_seconds=2.0, tombstone_ttl_seconds=0.5)
    deleted = now_us(store)
    assert store.save(make_checkpoint("s1", version=1), seq=deleted - 1_000).applied
    assert store.delete("s1", seq=deleted, request_id="d")
    # When a save stamped just before the delete comes back after the margin (a worker
    # killed holding it, the fleet down longer than the margin)
    store_env.pass_time(1.0)
    late = store.save(make_checkpoint("s1", version=2), seq=deleted - 1, request_id="s")
    # Then the tombstone still refuses it: it lives until the save's deadline has passed
    assert not late.applied
    assert store.load("s1") is None
    assert store.fence("s1") == Fence(deleted, True, "d")
