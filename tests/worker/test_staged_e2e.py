"""End to end: staged saves (``checkpoint.save_staged``) through a real worker.

The producer SETs the value on the broker under the request's id and pushes a message that
names it. The worker applies it, coalesced or as a single task, deletes the value when it
settles the request, tells a redelivery (stale) from a lost value (dead-lettered), and keeps
a refused request's checkpoint in its dead letter. Given / When / Then.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from checkpointq.store.keys import KeySpace
from checkpointq.store.serde import checkpoint_to_wire, serialize_checkpoint
from checkpointq.tasks.errors import RequestRefused
from checkpointq.tasks.messages import SAVE, SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from checkpointq.tasks.producer.outcomes import APPLIED, SUPERSEDED
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration


def _keys(live: Deployment) -> KeySpace:
    return KeySpace(live.settings.key_prefix)


def _staged_values(live: Deployment) -> list[bytes]:
    pattern = f"{live.settings.key_prefix}.cq:pending-value:*"
    return list(live.broker_client().scan_iter(pattern, count=1000))


def _send_staged(
    client: CheckpointClient, session_id: str, seq: int, task_id: str, **options: Any
) -> Handle:
    """A staged save's message as Celery's ``send_task`` writes it (``options``: its own,
    e.g. a countdown, which takes the message off the coalesced path)."""
    client._celery_app().send_task(
        SAVE_STAGED,
        args=[session_id],
        kwargs={"seq": seq},
        queue=client.queue,
        task_id=task_id,
        **options,
    )
    return Handle(task_id, SAVE, session_id, seq)


def test_a_staged_save_is_applied_and_leaves_nothing_on_the_broker(live: Deployment) -> None:
    # Given saves of several sessions, each staged (the client's default on Redis)
    with live.checkpoint_client() as client:
        assert client.stage_saves
        handles = [client.save(make_checkpoint(f"staged{n}", version=n)) for n in range(1, 9)]
        # Then each is applied as sent
        for n, handle in enumerate(handles, start=1):
            assert client.wait_durable(handle, timeout=20).outcome == APPLIED
            stored = client.store.load(f"staged{n}")
            assert stored == make_checkpoint(f"staged{n}", version=n)
    # And once the queue is drained, no staged value and no pending record is left behind
    live.wait_drained()
    assert _staged_values(live) == []
    assert live.broker_client().zcard(_keys(live).pending_index()) == 0


def test_a_staged_save_run_as_a_single_task_is_applied_and_its_value_deleted(
    live: Deployment,
) -> None:
    # Given a staged value and its message sent with a countdown (the single-task path)
    checkpoint = make_checkpoint("single-task", version=3)
    task_id = "single-task-request"
    broker = live.broker_client()
    value_key = _keys(live).pending_value("single-task", task_id)
    broker.set(value_key, serialize_checkpoint(checkpoint), px=60_000)
    with live.checkpoint_client() as client:
        handle = _send_staged(client, "single-task", wall_clock_us(), task_id, countdown=0.05)
        # Then it is applied, and its value goes when it settles
        assert client.wait_durable(handle, timeout=20).outcome == APPLIED
        assert client.store.load("single-task") == checkpoint
    live.wait_drained()
    assert not broker.exists(value_key)


def test_a_redelivered_staged_save_is_stale_not_refused(live: Deployment) -> None:
    # Given a staged save the worker applied (its value then deleted)
    with live.checkpoint_client() as client:
        handle = client.save(make_checkpoint("redelivered", version=2))
        assert client.wait_durable(handle, timeout=20).outcome == APPLIED
        live.wait_drained()
        # When its message arrives again (a redelivery), with no value left to read
        _send_staged(client, "redelivered", handle.seq or 0, handle.task_id)
        live.wait_drained()
        # Then it is taken as the duplicate it is: nothing refused, the session unchanged
        assert client.wait_durable(handle, timeout=20).outcome == APPLIED
        assert live.dead_letters().list(count=10).entries == []
        assert client.store.load("redelivered") == make_checkpoint("redelivered", version=2)


@pytest.mark.parametrize("countdown", [None, 0.05], ids=["coalesced", "single-task"])
def test_a_staged_save_whose_value_is_gone_is_refused_with_the_reason(
    live: Deployment, countdown: float | None
) -> None:
    # Given a staged save's message whose value is not on the broker (expired, evicted, or
    # lost with the broker's data), amid a save of another session
    with live.checkpoint_client() as client:
        options = {} if countdown is None else {"countdown": countdown}
        lost = _send_staged(client, "lost", wall_clock_us(), f"lost-{countdown}", **options)
        kept = client.save(make_checkpoint("kept", version=1))
        # Then it is dead-lettered, saying why, and the other save applies
        with pytest.raises(RequestRefused) as refused:
            client.wait_durable(lost, timeout=20)
        assert client.wait_durable(kept, timeout=20).outcome == APPLIED
    assert refused.value.kind == "invalid_input"
    assert "staged value" in refused.value.reason and "not on the broker" in refused.value.reason
    letter = live.dead_letters().get(refused.value.entry)
    assert letter is not None and letter.task == SAVE_STAGED and letter.args == ["lost"]


def _misconfigured(live: Deployment, ahead_seconds: float) -> CheckpointClient:
    """A producer whose clock runs ``ahead_seconds`` ahead and whose limit is set above the
    workers' (600 s against their 300 s), so that the broker accepts what a worker refuses:
    one producer's faults, as any record-writing producer could have them."""
    settings = live.settings
    assert settings.broker_url is not None
    ahead = SeqClock(lambda: wall_clock_us() + int(ahead_seconds * 1_000_000))
    store = live.checkpoint_client().store
    return CheckpointClient(
        settings.broker_url, store, queue=settings.queue, clock=ahead, max_seq_ahead_seconds=1200
    )


def test_a_refused_staged_save_keeps_its_checkpoint_in_its_dead_letter(live: Deployment) -> None:
    # Given a producer whose clock runs 6.5 minutes ahead (the worker allows 5)
    checkpoint = make_checkpoint("ahead", version=4)
    with _misconfigured(live, 390) as client:
        handle = client.save(checkpoint)
        # When the worker refuses its staged save
        with pytest.raises(RequestRefused) as refused:
            client.wait_durable(handle, timeout=20)
    # Then the dead letter holds the checkpoint itself, as a plain save that replays
    letter = live.dead_letters().get(refused.value.entry)
    assert letter is not None and letter.replayable
    assert letter.task == SAVE and letter.task_id == handle.task_id
    assert letter.args == [checkpoint_to_wire(checkpoint)]
    assert letter.kwargs == {"seq": handle.seq}
    # And the staged copy is gone: the dead letter is where the checkpoint lives now
    live.wait_drained()
    assert not live.broker_client().exists(_keys(live).pending_value("ahead", handle.task_id))


def test_an_older_save_stays_visible_and_applies_when_a_newer_one_is_refused(
    live: Deployment,
) -> None:
    # Given a staged save, then a newer one of the same session from a producer whose
    # faults make the worker refuse it, both queued while no worker takes them
    broker = live.broker_client()
    assert live.worker.process is not None
    os.kill(live.worker.process.pid, signal.SIGSTOP)  # the worker takes nothing meanwhile
    try:
        with live.checkpoint_client() as client:
            older = client.save(make_checkpoint("newer-refused", version=1))
        with _misconfigured(live, 390) as client:
            newer = client.save(make_checkpoint("newer-refused", version=2))
        # Each request has its own entry and value; loads answer the newer
        entries = broker.hkeys(_keys(live).pending_requests("newer-refused"))
        assert sorted(entries) == sorted([older.task_id.encode(), newer.task_id.encode()])
        with live.checkpoint_client() as client:
            assert client.load("newer-refused") == make_checkpoint("newer-refused", version=2)
    finally:
        os.kill(live.worker.process.pid, signal.SIGCONT)
    # Then the newer is refused, and the older still lands; no load ever loses sight of it:
    # the refused request's settle removes its own entry, never the older one's
    with live.checkpoint_client() as client:
        with pytest.raises(RequestRefused):
            client.wait_durable(newer, timeout=20)
        assert client.wait_durable(older, timeout=20).outcome == APPLIED
        assert client.store.load("newer-refused") == make_checkpoint("newer-refused", version=1)
        assert client.load("newer-refused") == make_checkpoint("newer-refused", version=1)


def test_staged_and_in_message_saves_of_one_session_apply_in_seq_order(
    live: Deployment,
) -> None:
    # Given one session saved alternately staged and with its checkpoint in the message
    with live.checkpoint_client() as client:
        handles = []
        for version in range(1, 11):
            client.stage_saves = version % 2 == 0
            handles.append(client.save(make_checkpoint("mixed", version=version)))
        # Then the last is the session's value and every earlier one superseded or applied
        assert client.wait_durable(handles[-1], timeout=20).outcome == APPLIED
        for handle in handles[:-1]:
            assert client.wait_durable(handle, timeout=20).outcome in (APPLIED, SUPERSEDED)
        assert client.store.load("mixed") == make_checkpoint("mixed", version=10)
    wait_until(lambda: _staged_values(live) == [], timeout=20, message="the values settled")


def test_an_oversize_staged_value_is_refused_unread_and_kept_for_the_operator(
    live: Deployment,
) -> None:
    # Given a staged value over the worker's message limit (a foreign producer's)
    limit = live.settings.max_message_bytes
    key = _keys(live).pending_value("oversize", "oversize-request")
    broker = live.broker_client()
    broker.set(key, b"{" + b" " * (limit + 1024) + b"}", px=60_000)
    with live.checkpoint_client() as client:
        handle = _send_staged(client, "oversize", wall_clock_us(), "oversize-request")
        # Then it is refused, saying why
        with pytest.raises(RequestRefused) as refused:
            client.wait_durable(handle, timeout=20)
    assert refused.value.kind == "invalid_input" and f"{limit}-byte" in refused.value.reason
    # And the value stays on the broker, where the dead letter's reason points
    live.wait_drained()
    assert broker.strlen(key) == limit + 1026
