"""End to end: producers enqueue, a real Celery worker applies to a real store Redis."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from checkpointq.store.base import Fence
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.dead_letters import Reason
from checkpointq.tasks.errors import NotReplayable
from checkpointq.tasks.messages import DELETE, SAVE
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol1, protocol2
from tests.support.servers import wait_until
from tests.support.workers import QUEUE
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration

#: Seconds the outage's saves are held (their ETA): the worker takes them meanwhile.
OUTAGE_ETA_SECONDS = 8


def wire(session_id: str, version: int = 1, **kw: Any) -> dict[str, Any]:
    return checkpoint_to_wire(make_checkpoint(session_id, version=version, **kw))


def test_save_through_the_client_is_applied_and_readable(live: Deployment) -> None:
    # Given a client of the deployment
    with live.checkpoint_client() as client:
        # When it saves a checkpoint
        handle = client.save(make_checkpoint("client-save", version=7))
        # Then the request becomes durable and the store returns the checkpoint
        fence = client.wait_durable(handle, timeout=15)
        assert handle.seq is not None and fence.seq >= handle.seq and not fence.deleted
        loaded = client.load("client-save")
        assert loaded is not None and loaded.version == 7
        assert client.list() == ["client-save"]


def test_ids_go_accepts_are_saved_and_deleted_through_the_queue(live: Deployment) -> None:
    # Given ids that Go's store accepts: a tab, U+2028, 300 characters
    odd = ["tab\there", "line\u2028sep", "x" * 300]
    with live.checkpoint_client() as client:
        # When each is saved through the queue, Then each is applied and reads back
        for session_id in odd:
            fence = client.wait_durable(client.save(make_checkpoint(session_id)), timeout=15)
            assert not fence.deleted
        assert sorted(client.list()) == sorted(odd)
        assert all(client.load(session_id) is not None for session_id in odd)
        # And a delete through the queue removes one
        client.wait_durable(client.delete(odd[0]), timeout=15)
        assert sorted(client.list()) == sorted(odd[1:])


def test_raw_lpush_protocol2_envelope_is_applied(live: Deployment) -> None:
    # Given a producer with no Celery library: it LPUSHes the documented JSON envelope
    broker = live.broker_client()
    broker.lpush(QUEUE, protocol2(SAVE, [wire("raw-v2", version=3)], {"seq": 1_000}))
    # Then the worker applies it
    with live.checkpoint_client() as client:
        wait_until(lambda: client.load("raw-v2") is not None, timeout=15, message="raw save")
        loaded = client.load("raw-v2")
        assert loaded is not None and loaded.version == 3
        fence = client.store.fence("raw-v2")
        assert fence is not None and fence.seq == 1_000


def test_raw_lpush_protocol1_message_is_applied(live: Deployment) -> None:
    # Given a session saved through the client
    with live.checkpoint_client() as client:
        client.wait_durable(client.save(make_checkpoint("raw-v1")), timeout=15)
        # When a protocol 1 producer (task name in the body) deletes it with a newer seq
        newer = client.store.fence("raw-v1").seq + 1  # type: ignore[union-attr]
        live.broker_client().lpush(QUEUE, protocol1(DELETE, ["raw-v1"], {"seq": newer}))
        # Then the delete is applied
        wait_until(lambda: client.load("raw-v1") is None, timeout=15, message="raw delete")
        fence = client.store.fence("raw-v1")
        assert fence is not None and fence.deleted and fence.seq == newer


def test_duplicate_and_out_of_order_saves_end_at_the_newest(live: Deployment) -> None:
    # Given saves of one session delivered newest first, then older ones, then duplicates
    with live.checkpoint_client() as client:
        session = "out-of-order"
        for version in (5, 1, 3, 2, 4, 5, 1, 5):
            client.send(SAVE, [wire(session, version=version)], {"seq": 1_000 + version})
        live.wait_drained()
        # Then the newest one is stored, whatever the order they were applied in
        loaded = client.load(session)
        assert loaded is not None and loaded.version == 5
        assert client.store.fence(session).seq == 1_005  # type: ignore[union-attr]


def test_late_save_does_not_resurrect_deleted_session(live: Deployment) -> None:
    with live.checkpoint_client() as client:
        session = "deleted-then-late-save"
        # Given a save, then a delete of the session
        client.send(SAVE, [wire(session, version=1)], {"seq": 10})
        client.send(DELETE, [session], {"seq": 20})
        live.wait_drained()
        # When a save made before the delete arrives late (and is even redelivered)
        client.send(SAVE, [wire(session, version=2)], {"seq": 15})
        client.send(SAVE, [wire(session, version=2)], {"seq": 15})
        live.wait_drained()
        # Then the session stays deleted
        assert client.load(session) is None
        fence = client.store.fence(session)
        assert fence is not None and fence.deleted and fence.seq == 20


def test_each_kind_of_poison_message_is_dead_lettered_and_the_worker_carries_on(
    live: Deployment,
) -> None:
    broker = live.broker_client()
    with live.checkpoint_client() as client:
        # Given one poison message of each kind
        client.send(SAVE, [{"sessionId": "", "version": 1}], {})  # invalid checkpoint
        client.send(SAVE, [wire("bad-seq")], {"seq": "yesterday"})  # wrong argument type
        client.send(SAVE, [], {})  # wrong argument count
        client.send(DELETE, ["a", 1, 2], {})  # too many arguments
        client.send(SAVE, [wire("huge", content_size=100_000)], {})  # over max_message_bytes
        client.send("checkpoint.frobnicate", ["x"], {})  # unknown task name
        broker.lpush(QUEUE, protocol2(SAVE, [], body=b"{not json"))  # undecodable body
        broker.lpush(  # a serializer the worker refuses (pickle runs code when loaded)
            QUEUE,
            protocol2(
                SAVE,
                [],
                body=pickle.dumps(([], {}, {})),
                content_type="application/x-python-serialize",
            ),
        )
        broker.lpush(QUEUE, protocol1(None, ["x"]))  # no task name anywhere
        # When a good request follows them
        handle = client.save(make_checkpoint("after-the-poison"))
        # Then the good one is applied ...
        client.wait_durable(handle, timeout=20)
        live.wait_drained()
        # ... and every poison message is in the dead-letter store, with its reason
        letters = live.dead_letters().list(count=100).entries
        kinds = sorted(letter.kind for letter in letters)
        assert kinds == sorted(
            [
                "invalid_input",
                "invalid_input",
                "bad_arguments",
                "bad_arguments",
                "oversize",
                "unknown_task",
                "undecodable",
                "undecodable",
                "undecodable",
            ]
        ), [(letter.kind, letter.reason) for letter in letters]
        unknown = next(letter for letter in letters if letter.kind == "unknown_task")
        assert unknown.task == "checkpoint.frobnicate" and unknown.args == ["x"]
        assert unknown.task_id and unknown.time > 0 and unknown.raw
        oversize = next(letter for letter in letters if letter.kind == "oversize")
        assert oversize.task == SAVE and oversize.raw_bytes > 64 * 1024


def test_replaying_a_dead_letter_applies_the_original_request(live: Deployment) -> None:
    with live.checkpoint_client() as client:
        letters = live.dead_letters()
        # Given a save that was dead-lettered (as when the store stayed down too long)
        entry = letters.add(
            Reason.RETRIES_EXHAUSTED,
            "store unavailable after 8 retries",
            task=SAVE,
            task_id="t-1",
            args=[wire("replayed", version=9)],
            kwargs={"seq": 77},
        )
        # And an undecodable message, which has nothing to replay
        live.broker_client().lpush(QUEUE, protocol2(SAVE, [], body=b"\xff\xfe"))
        wait_until(lambda: letters.count() == 2, timeout=15, message="the undecodable letter")
        # When the save is replayed
        letters.replay(entry, client)
        # Then it is applied and its entry removed
        wait_until(lambda: client.load("replayed") is not None, timeout=15, message="replay")
        assert letters.get(entry) is None
        # And the undecodable one refuses to replay and stays for a person to look at
        (undecodable,) = letters.list().entries
        with pytest.raises(NotReplayable):
            letters.replay(undecodable.id, client)
        assert letters.count() == 1


def test_saves_sent_while_the_store_is_down_are_applied_once_it_is_back(
    live: Deployment,
) -> None:
    broker = live.broker_client()
    # Given five saves in the worker's hands, held until an ETA (a worker that noticed the
    # outage first would stop taking messages, and a save it never took is never retried)
    eta = (datetime.now(UTC) + timedelta(seconds=OUTAGE_ETA_SECONDS)).isoformat()
    saves = [
        protocol2(SAVE, [wire(f"outage-{i}", version=i)], {"seq": 1_000 + i}, eta=eta)
        for i in range(5)
    ]
    broker.lpush(QUEUE, *saves)
    wait_until(
        lambda: broker.llen(QUEUE) == 0,
        timeout=OUTAGE_ETA_SECONDS,
        message="the worker to take the five saves before their ETA",
    )
    mark = len(live.worker.log())
    # When the store Redis goes down (the broker stays up) before they are due
    live.store.stop()
    try:
        # Then the worker stops taking messages, and retries the saves it holds once due
        wait_until(
            lambda: "retry" in live.worker.log()[mark:],
            timeout=OUTAGE_ETA_SECONDS + 20,
            message="the held saves to be retried",
        )
        assert "store refusing writes" in live.worker.log()[mark:]
    finally:
        # And once the store is back
        live.store.start()
    with live.checkpoint_client() as client:
        for i in range(5):
            wait_until(
                lambda i=i: client.load(f"outage-{i}") is not None,
                timeout=30,
                message=f"outage-{i} applied",
            )
        # every save is applied, and none was dead-lettered
        assert sorted(client.list()) == [f"outage-{i}" for i in range(5)]
        assert [client.load(f"outage-{i}").version for i in range(5)] == list(range(5))  # type: ignore[union-attr]
    assert live.dead_letters().count() == 0


def test_the_envelope_documented_in_protocol_md_is_applied_as_written(live: Deployment) -> None:
    # Given the example envelope from docs/protocol.md, copied byte for byte
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    envelope = doc.split("```json\n", 1)[1].split("```", 1)[0]
    # When a producer LPUSHes it
    live.broker_client().lpush(QUEUE, envelope)
    # Then the worker takes the save it describes as written: stamped 2024-12-02, it is past
    # its deadline (seq + the 30-day TTL), so it lapses (fenced, never stored: the session
    # would have expired by now), as the document says
    with live.checkpoint_client() as client:

        def fence() -> Fence | None:
            return client.store.fence("sess-42")

        wait_until(lambda: fence() is not None, timeout=15, message="doc save")
        assert fence() == Fence(
            1733130000000000, False, "0b8a4c1e-6f7d-4d6a-9a57-1d2f0e5c9b11", lapsed=True
        )
        assert client.load("sess-42") is None
    assert live.dead_letters().list(count=10).entries == []


def test_a_refused_requests_dead_letter_keeps_its_body_exactly_as_received(
    live: Deployment,
) -> None:
    # Given a save refused by the store, its body written by hand: an empty embed, odd spacing
    body = b'[[{"sessionId": "", "version": 1}],  {"seq": 5},{}]'
    live.broker_client().lpush(QUEUE, protocol2(SAVE, [], body=body, task_id="raw-exact"))

    # When it is dead-lettered
    wait_until(
        lambda: live.dead_letters().list(count=10).entries, timeout=20, message="dead letter"
    )
    (letter,) = live.dead_letters().list(count=10).entries

    # Then its raw payload is those bytes, embed included, and its arguments were decoded
    assert letter.task_id == "raw-exact" and letter.kind == "invalid_input"
    assert letter.raw == body
    assert letter.args == [{"sessionId": "", "version": 1}] and letter.kwargs == {"seq": 5}
