"""Property: any order, any duplicates, same result as each request once in seq order."""

from __future__ import annotations

import itertools
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointq.store import Checkpoint, CheckpointStore, InMemoryStore
from checkpointq.store.ordering import SEQ_TIME_FLOOR
from tests.store.conftest import StoreEnv
from tests.support.checkpoints import make_checkpoint

SESSIONS = ["a", "b", "c"]
_fresh = itertools.count()

# A request: (is_save, session index, version); seqs are assigned distinct by position.
requests = st.lists(
    st.tuples(st.booleans(), st.integers(0, len(SESSIONS) - 1), st.integers(0, 5)),
    min_size=1,
    max_size=12,
)


#: Counters, and times from now on: a time seq in the past could be past its deadline, and
#: lapse (how long a request may apply is tests/store/test_lifetimes.py's to prove).
_NOW_US = int(time.time() * 1_000_000)
_seqs = st.one_of(
    st.integers(1, SEQ_TIME_FLOOR - 1), st.integers(_NOW_US, _NOW_US + 86_400_000_000)
)


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[tuple[bool, int, int]], list[int], list[int]]:
    """Requests, distinct seqs for them, and a delivery order with duplicates."""
    reqs = draw(requests)
    seqs = draw(st.lists(_seqs, min_size=len(reqs), max_size=len(reqs), unique=True))
    duplicates = draw(st.lists(st.integers(0, len(reqs) - 1), max_size=len(reqs)))
    order = draw(st.permutations(list(range(len(reqs))) + duplicates))
    return reqs, seqs, order


def _fresh_store(env: StoreEnv) -> CheckpointStore:
    if env.backend == "memory":
        return InMemoryStore()
    return env.fresh()


def _checkpoint(session: int, version: int, seq: int) -> Checkpoint:
    return make_checkpoint(SESSIONS[session], version=version, last_run_ref=f"seq-{seq}")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=deliveries())
def test_any_delivery_order_ends_as_each_request_once_in_seq_order(
    store_env: StoreEnv, case: tuple[list[tuple[bool, int, int]], list[int], list[int]]
) -> None:
    reqs, seqs, order = case
    # Expected: per session, the request with the highest seq decides.
    expected: dict[str, Checkpoint | None] = dict.fromkeys(SESSIONS)
    for (is_save, session, version), seq in sorted(
        zip(reqs, seqs, strict=True), key=lambda pair: pair[1]
    ):
        expected[SESSIONS[session]] = _checkpoint(session, version, seq) if is_save else None

    store = _fresh_store(store_env)
    for index in order:
        (is_save, session, version), seq = reqs[index], seqs[index]
        if is_save:
            store.save(_checkpoint(session, version, seq), seq=seq)
        else:
            store.delete(SESSIONS[session], seq=seq)

    for session_id in SESSIONS:
        assert store.load(session_id) == expected[session_id], session_id
    assert sorted(store.list()) == sorted(s for s, cp in expected.items() if cp is not None)
