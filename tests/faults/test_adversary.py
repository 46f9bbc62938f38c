"""Issue 31: the five ways an adversary broke "loads see every accepted write", each replayed
as it was found, against a real worker, broker and store.

1. one fast clock: its save is refused at once, and a healthy replica's stamps never follow
   it beyond the session it loaded;
2. a save and a delete stamped alike: settling the save leaves the delete's entry, so no load
   serves the deleted conversation while the delete is queued;
3. a save left unacked by a worker killed with -9 outlives no tombstone, however long the
   fleet is down;
4. an outage longer than the session TTL ends one way for staged and plain saves: they lapse,
   never stored, never dead-lettered;
5. a request id reused for another session can neither delete a staged value nor make an
   applied save look refused.

Each failed on the release before issue 31 (docs/reliability.md, "The protocol, explored").
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from checkpointq.store.base import Fence, StoreOptions
from checkpointq.store.redis import RedisStore
from checkpointq.tasks.errors import SeqRefused
from checkpointq.tasks.messages import SAVE, SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from checkpointq.tasks.producer.outcomes import APPLIED, EXPIRED, SUPERSEDED
from checkpointq.tasks.producer.pending import Settlement, Settler
from tests.faults.harness import QUEUE, Deployment
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration


def _client(
    deployment: Deployment, *, offset_s: float = 0.0, **options: object
) -> CheckpointClient:
    """A replica of the deployment, with a clock of its own (``offset_s`` off the machine's)
    and store options (as the deployment's workers have them)."""
    settings = deployment.all_settings
    offset_us = int(offset_s * 1_000_000)
    store = RedisStore.from_url(
        str(settings["store_url"]),
        options=StoreOptions(**options),  # type: ignore[arg-type]
    )
    return CheckpointClient(
        str(settings["broker_url"]),
        store,
        queue=QUEUE,
        clock=SeqClock(lambda: wall_clock_us() + offset_us),
    )


@contextmanager
def _paused(deployment: Deployment) -> Iterator[None]:
    """Every worker of the deployment stopped (SIGSTOP): the queue lags meanwhile."""
    pids = [proc.pid for proc in deployment.processes if proc.running()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):  # killed meanwhile
                os.kill(pid, signal.SIGCONT)


def test_hole_1_a_fast_clock_is_refused_at_once_and_followed_by_no_other_session(
    deployment: Deployment,
) -> None:
    deployment.worker()
    healthy, hour_ahead, ahead = (
        _client(deployment),
        _client(deployment, offset_s=3600),
        _client(deployment, offset_s=100),
    )
    try:
        durable = healthy.save(make_checkpoint("shared", version=1))
        assert healthy.wait_durable(durable, timeout=30).outcome == APPLIED
        with _paused(deployment):
            # When a replica whose clock runs an hour ahead saves it while the queue lags
            with pytest.raises(SeqRefused, match="clock"):
                hour_ahead.save(make_checkpoint("shared", version=2))
            # And one 100 s ahead (within the limit) saves it
            within = ahead.save(make_checkpoint("shared", version=3))
            # Then the healthy replica loads that save, and stamps its next one after it
            loaded = healthy.load("shared")
            assert loaded is not None and loaded.version == 3
            after = healthy.save(make_checkpoint("shared", version=4))
            # But only that session's: another's stamp is its own clock's
            other = healthy.save(make_checkpoint("other", version=1))
        assert after.seq is not None and within.seq is not None and after.seq > within.seq
        assert other.seq is not None and abs(other.seq - wall_clock_us()) < 10_000_000
        # And every request of the healthy replica applies (none refused as "ahead")
        assert healthy.wait_durable(after, timeout=30).outcome == APPLIED
        assert healthy.wait_durable(other, timeout=30).outcome == APPLIED
        assert healthy.wait_durable(within, timeout=30).outcome == SUPERSEDED
        assert deployment.dead_letters().count() == 0
    finally:
        for client in (healthy, hour_ahead, ahead):
            client.close()


def test_hole_2_settling_a_save_leaves_the_delete_stamped_alike(deployment: Deployment) -> None:
    # Given a session whose fence a fast replica (within the limit) stamped 60 s ahead, so
    # that two healthy replicas loading it both stamp their next request fence + 1
    store = deployment.store()
    fence_seq = wall_clock_us() + 60_000_000
    assert store.save(make_checkpoint("tie", version=1), seq=fence_seq, request_id="first")
    saver, deleter = _client(deployment), _client(deployment)
    try:
        assert saver.load("tie") is not None and deleter.load("tie") is not None
        save = saver.save(make_checkpoint("tie", version=2))
        delete = deleter.delete("tie")
        assert save.seq == delete.seq == fence_seq + 1
        # And the delete's message held back (the queue lagging behind the save)
        held = deployment.broker_client().lpop(QUEUE)
        assert isinstance(held, bytes) and json.loads(held)["headers"]["id"] == delete.task_id
        # When a worker applies the save and settles it (its entry gone)
        deployment.worker()
        assert saver.wait_durable(save, timeout=30).outcome == APPLIED
        entries = deployment.keys.pending_requests("tie")
        broker = deployment.broker_client()
        wait_until(
            lambda: not broker.hexists(entries, save.task_id), timeout=30, message="the settle"
        )
        # Then every load still answers the delete, accepted and queued
        assert saver.load("tie") is None and deleter.load("tie") is None
        assert saver.list() == []
        # And once it lands the session is deleted, the delete applied, the save superseded
        deployment.broker_client().rpush(QUEUE, held)
        assert deleter.wait_durable(delete, timeout=30).outcome == APPLIED
        assert saver.wait_durable(save, timeout=30).outcome == SUPERSEDED
        assert store.load("tie") is None and saver.load("tie") is None
    finally:
        saver.close()
        deleter.close()


def _take_unacked(deployment: Deployment) -> str:
    """Take the queue's next message as a worker's reserve does (into kombu's ``unacked``
    hash and index, scored now): what a worker killed with -9 leaves behind. Its id."""
    broker = deployment.broker_client()
    raw = broker.rpop(QUEUE)
    assert isinstance(raw, bytes)
    message = json.loads(raw)
    tag = message["properties"]["delivery_tag"]
    broker.hset("unacked", tag, json.dumps([message, "", QUEUE]))
    broker.zadd("unacked_index", {tag: time.time()})
    return str(message["headers"]["id"])


def test_hole_3_a_save_restored_after_the_fleet_was_down_outlives_no_tombstone(
    deployment: Deployment,
) -> None:
    # Given an 11 s tombstone margin and a 10 s visibility timeout (the least allowed)
    deployment.settings.update(tombstone_ttl_seconds=11, visibility_timeout=10)
    client = _client(deployment, tombstone_ttl_seconds=11)
    try:
        worker = deployment.worker()
        durable = client.save(make_checkpoint("doomed", version=1))
        assert client.wait_durable(durable, timeout=30).outcome == APPLIED
        # And a second save held by a worker killed with -9 (left in kombu's unacked)
        with _paused(deployment):
            held = client.save(make_checkpoint("doomed", version=2))
            assert _take_unacked(deployment) == held.task_id
            worker.kill()
        # When a delete ordered after it is applied and settled (by another worker, which
        # stops before the visibility timeout), and the fleet is then down for longer than
        # the tombstone margin
        gone = client.delete("doomed")
        message = deployment.broker_client().rpop(QUEUE)
        assert isinstance(message, bytes) and json.loads(message)["headers"]["id"] == gone.task_id
        assert gone.seq is not None
        assert client.store.delete("doomed", seq=gone.seq, request_id=gone.task_id)
        Settler(deployment.broker_client(), deployment.keys).settle(
            [Settlement("doomed", gone.task_id, gone.seq, deleted=True)]
        )
        time.sleep(12.0)  # the outage itself: longer than the 11 s margin
        # Then the save restored after the visibility timeout does not bring it back
        deployment.worker()
        wait_until(
            lambda: deployment.backlog() == 0 and not deployment.broker_client().hlen("unacked"),
            timeout=60,
            message="the held save restored and settled",
        )
        assert client.wait_durable(held, timeout=30).outcome == SUPERSEDED
        assert client.store.load("doomed") is None and client.load("doomed") is None
        fence = client.store.fence("doomed")
        assert fence is not None and fence.deleted and fence.request_id == gone.task_id
    finally:
        client.close()


def test_hole_4_saves_outliving_their_session_ttl_lapse_staged_or_not(
    deployment: Deployment,
) -> None:
    # Given a 3 s session TTL, and sessions saved before an outage of the workers (by a
    # worker already consuming: one started after the saves may take longer than the TTL to
    # start on a loaded machine, and the saves then lapse, rightly, before the outage)
    deployment.settings.update(ttl_seconds=3)
    client = _client(deployment, ttl_seconds=3)
    try:
        deployment.worker()
        before = [client.save(make_checkpoint(s, version=1)) for s in ("staged", "plain")]
        for handle in before:
            assert client.wait_durable(handle, timeout=30).outcome == APPLIED
        # When both are saved again during an outage longer than the TTL: one staged, one
        # carrying its checkpoint
        with _paused(deployment):
            staged = client.save(make_checkpoint("staged", version=2))
            client.stage_saves = False
            plain = client.save(make_checkpoint("plain", version=2))
            time.sleep(3.5)
        # Then both lapse alike: never stored, never dead-lettered, the sessions stay expired
        for handle in (staged, plain):
            assert client.wait_durable(handle, timeout=30).outcome == EXPIRED
            assert client.store.load(handle.session_id) is None
            assert client.load(handle.session_id) is None
            fence = client.store.fence(handle.session_id)
            assert fence == Fence(handle.seq or 0, False, handle.task_id, lapsed=True)
        assert deployment.dead_letters().count() == 0
        wait_until(lambda: deployment.backlog() == 0, timeout=30, message="the queue drained")
    finally:
        client.close()


def _hijack(deployment: Deployment, victim: Handle, session_id: str) -> None:
    """A message for ``session_id`` carrying ``victim``'s request id, as a faulty or hostile
    producer might push it (the id is readable in the victim's pending entry)."""
    body = json.dumps([[session_id], {"seq": wall_clock_us()}, {}]).encode()
    envelope = protocol2(SAVE_STAGED, [], body=body, queue=QUEUE, task_id=victim.task_id)
    deployment.broker_client().rpush(QUEUE, envelope)  # taken before the victim's


@pytest.mark.parametrize("coalesce", [1, 32], ids=["coalescing-off", "coalescing-on"])
def test_hole_5_a_request_id_reused_for_another_session_hijacks_nothing(
    deployment: Deployment, coalesce: int
) -> None:
    deployment.settings.update(coalesce_max_items=coalesce)
    client = _client(deployment)
    try:
        # Given a victim's staged save, and a message for another session with its id
        victim = client.save(make_checkpoint("victim", version=7))
        _hijack(deployment, victim, "intruder")
        # When a worker takes both, the intruder's first
        deployment.worker()
        # Then the victim's save applies, and is reported applied
        assert client.wait_durable(victim, timeout=30).outcome == APPLIED
        assert client.store.load("victim") == make_checkpoint("victim", version=7)
        # And the intruder's message is refused on its own account
        (letter,) = deployment.wait_dead_letters(1).list().entries
        assert letter.task_id == victim.task_id and letter.args == ["intruder"]
        refusals = deployment.store_client().hgetall(deployment.keys.refusals("intruder"))
        assert list(refusals) == [victim.task_id.encode()]
        assert b"staged value" in refusals[victim.task_id.encode()]
        assert not deployment.store_client().exists(deployment.keys.refusals("victim"))
    finally:
        client.close()


def test_hole_5_a_request_id_reused_in_its_own_session_cannot_make_it_look_refused(
    deployment: Deployment,
) -> None:
    # Given a victim's delete accepted, its message held back (the queue lagging), and a bad
    # request of the same session under its id (another seq, a checkpoint no worker takes)
    client = _client(deployment)
    try:
        victim = client.delete("victim")
        assert victim.seq is not None
        held = deployment.broker_client().lpop(QUEUE)
        assert isinstance(held, bytes)
        bad = {"sessionId": "victim", "version": "three"}  # a version must be an integer
        body = json.dumps([[bad], {"seq": victim.seq + 1}, {}]).encode()
        envelope = protocol2(SAVE, [], body=body, queue=QUEUE, task_id=victim.task_id)
        deployment.broker_client().rpush(QUEUE, envelope)
        # When a worker refuses the bad one (its refusal record names its own seq)
        deployment.worker()
        deployment.wait_dead_letters(1)
        # Then the victim, still queued, is still on its way: not reported refused
        with pytest.raises(TimeoutError):
            client.wait_durable(victim, timeout=1)
        # And once its message lands, it is applied
        deployment.broker_client().rpush(QUEUE, held)
        assert client.wait_durable(victim, timeout=30).outcome == APPLIED
    finally:
        client.close()
