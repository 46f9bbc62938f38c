"""End to end: causal seqs and per-request outcomes through a real worker.

``wait_durable`` answers for the request itself: applied, superseded by a newer request, or
refused (dead-lettered, with the reason); and two producers whose clocks disagree keep the
order of a load followed by a save. Given / When / Then.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from checkpointq.store.redis import RedisStore
from checkpointq.tasks.errors import RequestRefused, SeqRefused
from checkpointq.tasks.producer.batching import BatchingClient
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from checkpointq.tasks.producer.outcomes import APPLIED, SUPERSEDED
from tests.support.checkpoints import make_checkpoint
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration


class WallClockOnly(SeqClock):
    """The rule before causal seqs: the producer's wall clock, blind to the fences it read."""

    def observe(self, session_id: str, seq: int) -> None:
        pass


def skewed(offset_us: int) -> Callable[[], int]:
    return lambda: wall_clock_us() + offset_us


def producer(live: Deployment, clock: SeqClock, max_ahead: float = 300) -> CheckpointClient:
    """A producer of the deployment with a clock of its own (a replica on another host) and
    the limit it is told the workers apply (``max_ahead``, s)."""
    settings = live.settings
    assert settings.broker_url is not None and settings.store_url is not None
    store = RedisStore.from_url(settings.store_url, prefix=settings.key_prefix)
    return CheckpointClient(
        settings.broker_url,
        store,
        queue=settings.queue,
        clock=clock,
        max_seq_ahead_seconds=max_ahead,
    )


def take_turns(live: Deployment, fast: SeqClock, slow: SeqClock, turns: int) -> int:
    """Two replicas take turns on one session, as the apiserver does: load, bump the
    version, save, wait. Returns how many saves did not end as the session's value."""
    lost = 0
    with producer(live, fast) as a, producer(live, slow) as b:
        for turn in range(turns):
            replica = a if turn % 2 == 0 else b
            loaded = replica.load("turns")
            version = (loaded.version if loaded else 0) + 1
            handle = replica.save(make_checkpoint("turns", version=version))
            outcome = replica.wait_durable(handle, timeout=20)
            current = replica.load("turns")
            assert current is not None
            if current.version != version:
                lost += 1
                assert outcome.outcome == SUPERSEDED, f"turn {turn}: lost but {outcome}"
            else:
                assert outcome.outcome == APPLIED, f"turn {turn}: applied but {outcome}"
    return lost


def test_producers_with_clocks_2s_apart_lose_no_save_taking_turns(live: Deployment) -> None:
    turns = 20
    # Given two replicas whose clocks are 2 s apart, first with wall-clock seqs
    before = take_turns(live, WallClockOnly(), WallClockOnly(skewed(-2_000_000)), turns)
    live.store_client().flushall()
    # When they stamp causal seqs instead
    after = take_turns(live, SeqClock(), SeqClock(skewed(-2_000_000)), turns)
    print(
        f"skew experiment: {turns} alternating saves, lost {before} (wall clock), {after} (causal)"
    )
    # Then no save is lost, where wall-clock seqs lost every one after a faster replica's
    assert before >= turns // 2 - 1
    assert after == 0


def test_after_orders_a_save_whose_load_happened_in_another_process(live: Deployment) -> None:
    # Given a session written by a replica whose clock runs 2 s ahead
    with producer(live, SeqClock(skewed(2_000_000))) as ahead:
        ahead.wait_durable(ahead.save(make_checkpoint("handover", version=1)), timeout=20)
        _, fence = ahead.load_with_fence("handover")
    assert fence is not None
    # When another process saves what the first loaded, passing the fence along
    with producer(live, SeqClock()) as other:
        handle = other.save(make_checkpoint("handover", version=2), after=fence.seq)
        # Then its save sorts after the one loaded, and applies
        assert handle.seq is not None and handle.seq > fence.seq
        assert other.wait_durable(handle, timeout=20).outcome == APPLIED


def test_wait_durable_tells_applied_from_superseded(live: Deployment) -> None:
    with live.checkpoint_client() as client:
        # Given two saves of one session, and then a delete
        older = client.save(make_checkpoint("outcomes", version=1))
        newer = client.save(make_checkpoint("outcomes", version=2))
        # Then the newer is applied and the older superseded
        applied = client.wait_durable(newer, timeout=20)
        assert applied.outcome == APPLIED and applied.winner == newer.task_id
        assert client.wait_durable(older, timeout=20).outcome == SUPERSEDED
        deleted = client.wait_durable(client.delete("outcomes"), timeout=20)
        assert deleted.outcome == APPLIED and deleted.deleted
        assert client.wait_durable(newer, timeout=20).outcome == SUPERSEDED


def test_wait_durable_raises_with_the_reason_of_a_refused_request(live: Deployment) -> None:
    # Given a producer whose clock runs 6.5 minutes ahead, and whose limit is set above the
    # workers' 5 (so the broker takes what a worker refuses)
    with producer(live, SeqClock(skewed(390_000_000)), max_ahead=1200) as client:
        handle = client.save(make_checkpoint("refused", version=1))
        # When it waits, then it learns the request was dead-lettered, why, and where
        with pytest.raises(RequestRefused) as refused:
            client.wait_durable(handle, timeout=20)
    assert refused.value.kind == "invalid_input" and "ahead" in refused.value.reason
    letter = live.dead_letters().get(refused.value.entry)
    assert letter is not None and letter.task_id == handle.task_id


def test_a_producer_whose_clock_runs_ahead_is_refused_at_once(live: Deployment) -> None:
    # Given a producer whose clock runs 10 minutes ahead (the worker allows 5)
    with producer(live, SeqClock(skewed(600_000_000))) as client:
        # When it saves or deletes, then the broker refuses at once, naming the clock
        with pytest.raises(SeqRefused, match=r"clock is 600.* ahead"):
            client.save(make_checkpoint("fast", version=1))
        with pytest.raises(SeqRefused, match="clock"):
            client.delete("fast")
        # And nothing was queued, nothing is pending: no load sees it, none adopts its seq
        assert client.load("fast") is None and client.list() == []
    assert live.broker_client().llen(live.settings.queue) == 0


def test_batched_requests_report_their_own_outcomes(live: Deployment) -> None:
    # Given two saves of one session travelling in one batch
    with BatchingClient(live.checkpoint_client(), window_ms=50, max_items=10) as client:
        first = client.save(make_checkpoint("batched", version=1))
        second = client.save(make_checkpoint("batched", version=2))
        assert first.task_id == second.task_id and first.request != second.request
        # Then each item has its own outcome
        assert client.wait_durable(second, timeout=20).outcome == APPLIED
        assert client.wait_durable(first, timeout=20).outcome == SUPERSEDED
