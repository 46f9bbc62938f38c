"""``apply_batch``: a batch of saves and deletes ends exactly as the same requests one by one."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointq.store import (
    CheckpointStore,
    CheckpointTooLarge,
    ConversationMessage,
    InMemoryStore,
    RedisStore,
    SaveResult,
)
from checkpointq.store.base import BatchOp, BatchResult, DeleteOp, SaveOp
from tests.store.conftest import StoreEnv
from tests.support.checkpoints import make_checkpoint

SESSIONS = ["a", "b", "{c}"]
_fresh = itertools.count()


def _fresh_store(env: StoreEnv, **options: Any) -> CheckpointStore:
    if env.backend == "memory":
        return env.store(**options)
    return env.fresh(**options)


def test_batch_applies_saves_and_deletes_in_order_each_fenced(store: CheckpointStore) -> None:
    # Given a session saved at seq 100
    store.save(make_checkpoint("kept", version=1), seq=100)
    # When a batch saves it again (newer), saves an older copy, saves and deletes another
    results = store.apply_batch(
        [
            SaveOp(make_checkpoint("kept", version=2), 200),
            SaveOp(make_checkpoint("kept", version=9), 150),
            SaveOp(make_checkpoint("gone", version=1), 300),
            DeleteOp("gone", 301),
        ]
    )
    # Then each item did what it would have done alone
    newer, older, saved, deleted = results
    assert isinstance(newer, SaveResult) and newer.applied and newer.stored_bytes > 0
    assert isinstance(older, SaveResult) and not older.applied
    assert isinstance(saved, SaveResult) and saved.applied
    assert deleted is True
    loaded = store.load("kept")
    assert loaded is not None and loaded.version == 2
    assert store.load("gone") is None
    fence = store.fence("gone")
    assert fence is not None and fence.deleted and fence.seq == 301
    assert store.list() == ["kept"]


def test_a_refused_item_gets_its_error_and_the_rest_still_apply(store_env: StoreEnv) -> None:
    # Given a store whose values must fit 600 bytes
    store = _fresh_store(store_env, max_value_bytes=600)
    store.save(make_checkpoint("before", version=1, messages=0), seq=1)
    noise = random.Random(7).randbytes(2000).hex()  # does not compress below 600 bytes
    huge = make_checkpoint("huge", messages=1).model_copy(
        update={"conversation_history": [ConversationMessage(role="user", content=noise)]}
    )
    # When a batch holds a checkpoint too large even alone, between two deletes
    results = store.apply_batch(
        [
            DeleteOp("before", 10),
            SaveOp(huge, 11),
            DeleteOp("other", 12),
        ]
    )
    # Then the large one carries its error and the deletes around it applied
    assert results[0] is True and results[2] is True
    assert isinstance(results[1], CheckpointTooLarge)
    assert store.fence("before").deleted  # type: ignore[union-attr]
    assert store.fence("other") is not None and store.fence("huge") is None


def test_an_empty_batch_does_nothing(store: CheckpointStore) -> None:
    assert store.apply_batch([]) == []


def test_a_redis_batch_is_one_round_trip(store_env: StoreEnv) -> None:
    if store_env.backend not in ("redis", "redis-staged", "redis-pipeline", "fakeredis"):
        pytest.skip("counts the writes to a single Redis")
    store = _fresh_store(store_env)
    assert isinstance(store, RedisStore)
    store.scripts.save(keys=["warm", "warm-fence", "warm-index"], args=[1, b"", 1, 1, 1, "w"])
    store.scripts.delete(keys=["warm", "warm-fence", "warm-index"], args=[2, 1, "w", ""])
    writes = 0
    pool = store.client.connection_pool
    real_get_connection = pool.get_connection

    def counting_get_connection(*args: Any, **kwargs: Any) -> Any:
        conn = real_get_connection(*args, **kwargs)
        real_send = conn.send_packed_command

        def send(*a: Any, **kw: Any) -> Any:
            nonlocal writes
            writes += 1
            return real_send(*a, **kw)

        conn.send_packed_command = send
        return conn

    pool.get_connection = counting_get_connection
    try:
        ops: list[BatchOp] = [SaveOp(make_checkpoint(f"s{n}"), 1_000 + n) for n in range(50)]
        results = store.apply_batch([*ops, DeleteOp("s0", 5_000)])
    finally:
        del pool.get_connection  # back to the class's method
    assert writes == 1
    assert all(isinstance(r, SaveResult) and r.applied for r in results[:50])
    assert results[50] is True


# -- property: a batch ends as the same requests applied one by one ---------------------

# A request: (is_save, session index, version, seq): seqs may repeat and go backwards.
requests = st.lists(
    st.tuples(
        st.booleans(),
        st.integers(0, len(SESSIONS) - 1),
        st.integers(0, 5),
        st.integers(1, 20),
    ),
    min_size=0,
    max_size=15,
)


def _ops(reqs: list[tuple[bool, int, int, int]]) -> list[BatchOp]:
    return [
        SaveOp(make_checkpoint(SESSIONS[s], version=v, last_run_ref=f"r{seq}"), seq)
        if is_save
        else DeleteOp(SESSIONS[s], seq)
        for is_save, s, v, seq in reqs
    ]


def _outcome(result: BatchResult) -> object:
    if isinstance(result, SaveResult):
        return ("save", result.applied, result.seq, result.stored_bytes)
    if isinstance(result, Exception):
        return type(result)
    return result


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(reqs=requests, split=st.integers(0, 15))
def test_batch_application_equals_sequential_application(
    store_env: StoreEnv, reqs: list[tuple[bool, int, int, int]], split: int
) -> None:
    ops = _ops(reqs)
    batched, sequential = _fresh_store(store_env), _fresh_store(store_env)
    if isinstance(batched, InMemoryStore):
        sequential = InMemoryStore()
    # When one store takes the requests in two batches and the other one at a time
    got = batched.apply_batch(ops[:split]) + batched.apply_batch(ops[split:])
    want: list[BatchResult] = []
    for op in ops:
        if isinstance(op, SaveOp):
            want.append(sequential.save(op.checkpoint, op.seq))
        else:
            want.append(sequential.delete(op.session_id, op.seq))
    # Then every item reports the same, and both stores hold the same sessions and fences
    assert [_outcome(r) for r in got] == [_outcome(r) for r in want]
    for session_id in SESSIONS:
        assert batched.load(session_id) == sequential.load(session_id), session_id
        assert batched.fence(session_id) == sequential.fence(session_id), session_id
    assert sorted(batched.list()) == sorted(sequential.list())
