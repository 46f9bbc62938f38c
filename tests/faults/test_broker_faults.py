"""Issue 44: the broker's faults, against real redis-servers and a real worker.

What a broker can do to accepted requests besides failing outright: another producer reuse a
request id, a store whose clock runs ahead list its sessions, a broker come back with a
suffix of what it accepted missing.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointq.store import Checkpoint, ConversationMessage, RedisStore
from checkpointq.tasks.errors import PendingRecordMissing
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from checkpointq.tasks.producer.outcomes import APPLIED, LOST, SUPERSEDED
from checkpointq.tasks.producer.pending import Settlement, Settler
from checkpointq.worker.ops import health
from checkpointq.worker.settings import Settings
from tests.faults.harness import QUEUE, SAVE, Deployment, Request, push
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until

pytestmark = pytest.mark.integration

DAY = 86_400.0


def _client(deployment: Deployment, **options: object) -> CheckpointClient:
    settings = deployment.all_settings
    return CheckpointClient(
        str(settings["broker_url"]),
        RedisStore.from_url(str(settings["store_url"])),
        queue=QUEUE,
        clock=SeqClock(),
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def client(deployment: Deployment) -> Iterator[CheckpointClient]:
    opened = _client(deployment)
    yield opened
    opened.close()


def test_a_request_whose_id_another_reuses_stays_superseded(
    deployment: Deployment, client: CheckpointClient
) -> None:
    deployment.worker()
    older = client.save(make_checkpoint("reused", version=1))
    newer = client.save(make_checkpoint("reused", version=2))
    assert client.wait_durable(newer, timeout=30).outcome == APPLIED
    assert client.wait_durable(older, timeout=30).outcome == SUPERSEDED
    # When a faulty producer sends a later save under the superseded request's id
    assert newer.seq is not None
    seq = max(wall_clock_us(), newer.seq + 1)
    reuse = Request(SAVE, "reused", seq, 3, task_id=older.request)
    push(deployment.broker_client(), [reuse.envelope()])
    reused = Handle(older.task_id, older.task, "reused", reuse.seq)
    assert client.wait_durable(reused, timeout=30).outcome == APPLIED
    # Then the older request is still superseded: the fence names its id, not its stamp
    assert client.wait_durable(older, timeout=5).outcome == SUPERSEDED
    assert client.wait_durable(newer, timeout=5).outcome == SUPERSEDED


def test_a_replica_whose_clock_runs_ahead_lists_what_it_loads(
    deployment: Deployment, client: CheckpointClient
) -> None:
    deployment.worker()
    ids = [f"listed-{n}" for n in range(10)]
    for session_id in ids:
        client.wait_durable(client.save(make_checkpoint(session_id)), timeout=30)
    # Given a replica whose clock runs ahead of the store's by more than the sessions'
    # lifetime (loads judge deadlines by the store's time, and return every session)
    settings = deployment.all_settings
    ahead = CheckpointClient(
        str(settings["broker_url"]),
        RedisStore.from_url(str(settings["store_url"]), clock=lambda: time.time() + 31 * DAY),
        queue=QUEUE,
    )
    try:
        assert all(ahead.load(session_id) is not None for session_id in ids)
        # Then its lists, by the store's time too, hold every one of them
        assert ahead.store.list() == ids
        assert ahead.list() == ids
        assert ahead.store.fences(ids)[0].live  # type: ignore[union-attr]
    finally:
        ahead.close()


def _turn(client: CheckpointClient, session_id: str, n: int) -> Handle:
    """The apiserver's turn: load (None: a new session), append turn ``n``, save."""
    loaded = client.load(session_id)
    checkpoint = loaded or make_checkpoint(session_id, messages=0)
    turn = ConversationMessage(role="user", content=f"t{n}")
    history = [*checkpoint.conversation_history, turn]
    update = {"version": n, "conversation_history": history}
    return client.save(checkpoint.model_copy(update=update))


def _turns(checkpoint: Checkpoint | None) -> list[str]:
    return [] if checkpoint is None else [m.content for m in checkpoint.conversation_history]


def _aof(broker: RedisServer) -> Path:
    return broker.workdir / "appendonlydir"


def _snapshot(deployment: Deployment, into: Path) -> Path:
    """A copy of the broker's AOF as it is now (nothing writes meanwhile), in ``into``."""
    snapshot = into / "appendonlydir"
    shutil.copytree(_aof(deployment.broker), snapshot)
    return snapshot


def _come_back_from(deployment: Deployment, snapshot: Path) -> None:
    """The broker killed (-9) and started again from ``snapshot``, an older AOF."""
    deployment.broker.stop(kill=True)
    shutil.rmtree(_aof(deployment.broker))
    shutil.copytree(snapshot, _aof(deployment.broker))
    deployment.broker.start()


def test_a_broker_gone_back_in_time_is_detected_and_what_producers_hold_comes_back(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A machine crash inside the fsync window, or a failover to a lagging replica: the
    broker comes back with a prefix of what it accepted. Here its AOF (fsync always) as it
    was after the first turns, put back after the second ones were accepted."""
    replicas = [_client(deployment) for _ in range(4)]
    sessions = {r: [f"crash-{r}-{n}" for n in range(5)] for r in range(4)}
    try:
        # Given four replicas, each with five sessions at turn 1 and one to delete
        for r, client in enumerate(replicas):
            for session_id in [*sessions[r], f"doomed-{r}"]:
                _turn(client, session_id, 1)
        snapshot = _snapshot(deployment, tmp_path)
        # And turn 2 accepted for every session, and every doomed one deleted
        for r, client in enumerate(replicas):
            for session_id in sessions[r]:
                _turn(client, session_id, 2)
            client.delete(f"doomed-{r}")
        # When the broker comes back with what it held before them (kill -9, old AOF)
        _come_back_from(deployment, snapshot)
        # Then each replica's next load finds it, counts it once, republishes what it
        # published lately, and serves turn 2 (and no doomed session)
        for r, client in enumerate(replicas):
            for session_id in sessions[r]:
                assert _turns(client.load(session_id)) == ["t1", "t2"], session_id
            assert client.load(f"doomed-{r}") is None
            assert client.epoch_changes == 1
            assert client.pending_records is not None and client.pending_records.republished
        # And `checkpointq health` raises it
        report = health.check(Settings(**deployment.all_settings))  # type: ignore[arg-type]
        assert report.broker_losses is not None and report.broker_losses.count == 1
        assert "the broker lost accepted requests" in " ".join(report.warning_lines())
        # And once the worker drains the queue, every turn is in the store, no delete undone
        for r, client in enumerate(replicas):
            for session_id in sessions[r]:
                _turn(client, session_id, 3)
        deployment.worker()
        store = deployment.store()
        wait_until(
            lambda: (
                deployment.backlog() == 0
                and all(
                    _turns(store.load(s)) == ["t1", "t2", "t3"]
                    for r in range(4)
                    for s in sessions[r]
                )
            ),
            timeout=60,
            interval=0.2,
            message="every turn in the store",
        )
        assert all(store.load(f"doomed-{r}") is None for r in range(4))
        assert all(client.epoch_changes == 1 for client in replicas)
        assert deployment.dead_letters().count() == 0
    finally:
        for client in replicas:
            client.close()


def test_a_loss_that_unaware_publishes_cover_up_is_detected_by_the_marks_token(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Finding 7 of tests/model/README.md: the broker loses producer A's last k publishes,
    then producer B, which saw none of them, publishes k times and brings the pending mark
    back to the one A saw. The counter alone tells A nothing; the token of its mark does."""
    a, b = _client(deployment), _client(deployment)
    try:
        # Given A and B, each with a session at turn 1
        _turn(a, "a-session", 1)
        _turn(b, "b-session", 1)
        snapshot = _snapshot(deployment, tmp_path)
        # And A's turn 2 and a new session of A's accepted (k = 2 publishes)
        _turn(a, "a-session", 2)
        _turn(a, "a-other", 1)
        pending_mark = deployment.keys.pending_mark()
        seen = deployment.broker_client().hget(pending_mark, "n")  # A's last publish's
        # When the broker comes back without them (kill -9, old AOF)
        _come_back_from(deployment, snapshot)
        # And B, which saw none of the lost marks, publishes twice: the mark is A's again
        _turn(b, "b-session", 2)
        _turn(b, "b-session", 3)
        assert b.epoch_changes == 0
        assert deployment.broker_client().hget(pending_mark, "n") == seen
        # Then A's next load finds the loss, counts it once, republishes its window, and
        # serves its turn 2 and its other session
        assert _turns(a.load("a-session")) == ["t1", "t2"]
        assert a.epoch_changes == 1
        assert a.pending_records is not None and a.pending_records.republished >= 2
        assert _turns(a.load("a-other")) == ["t1"]
        # And A's republish turned the epoch: B counts the loss once too, and health says so
        assert _turns(b.load("b-session")) == ["t1", "t2", "t3"]
        assert b.epoch_changes == 1
        report = health.check(Settings(**deployment.all_settings))  # type: ignore[arg-type]
        assert report.broker_losses is not None and report.broker_losses.count == 1
        assert "went back below mark" in report.broker_losses.line()
        # And the worker lands every turn
        deployment.worker()
        store = deployment.store()
        wait_until(
            lambda: (
                deployment.backlog() == 0
                and _turns(store.load("a-session")) == ["t1", "t2"]
                and _turns(store.load("a-other")) == ["t1"]
                and _turns(store.load("b-session")) == ["t1", "t2", "t3"]
            ),
            timeout=60,
            interval=0.2,
            message="every turn in the store",
        )
        assert deployment.dead_letters().count() == 0
    finally:
        a.close()
        b.close()


def test_a_missing_pending_record_is_refused_not_read_as_applied(
    deployment: Deployment, client: CheckpointClient
) -> None:
    sessions = [f"missing-{n}" for n in range(20)]
    store = deployment.store()
    for session_id in sessions:
        _turn(client, session_id, 1)
    worker = deployment.worker()
    wait_until(lambda: all(store.load(s) for s in sessions), timeout=30, message="turn 1")
    worker.terminate()  # turn 1 applied, then no worker
    # Given turn 2 accepted for every session, its message queued
    handles = [_turn(client, session_id, 2) for session_id in sessions]
    # When an operator deletes the pending-request hashes (the messages stay queued)
    broker = deployment.broker_client()
    broker.delete(*[deployment.keys.pending_requests(s) for s in sessions])
    # Then every load refuses rather than serve turn 1 (which a next turn would build on)
    for session_id in sessions:
        with pytest.raises(PendingRecordMissing, match="missing on the broker"):
            client.load(session_id)
    # And once a worker applies the queued turns, loads answer them again (a worker settles
    # a request's entry, and its count, just after the store write that wait_durable sees:
    # until then the load still refuses)
    deployment.worker()
    for handle in handles:
        assert client.wait_durable(handle, timeout=60).outcome == APPLIED

    def answered() -> bool:
        try:
            return all(_turns(client.load(s)) == ["t1", "t2"] for s in sessions)
        except PendingRecordMissing:
            return False

    wait_until(answered, timeout=30, interval=0.05, message="loads answer turn 2 again")
    assert all(_turns(client.load(s)) == ["t1", "t2"] for s in sessions)


def test_a_redelivered_settle_does_not_spend_the_count_of_another_missing_record(
    deployment: Deployment, client: CheckpointClient
) -> None:
    # Finding 6 (tests/model/README.md): a settle whose own entry is gone used to count one
    # less whenever the count expected a missing entry, whoever's it was.
    session_id = "spent-count"
    broker = deployment.broker_client()
    entries = deployment.keys.pending_requests(session_id)
    worker = deployment.worker()
    _turn(client, session_id, 1)
    second = _turn(client, session_id, 2)
    assert client.wait_durable(second, timeout=60).outcome == APPLIED
    wait_until(lambda: not broker.exists(entries), timeout=30, message="turn 2 settled")
    worker.terminate()
    # Given turn 3 accepted, its message queued, and its entry deleted by an operator
    third = _turn(client, session_id, 3)
    broker.delete(entries)
    with pytest.raises(PendingRecordMissing, match="missing on the broker"):
        client.load(session_id)
    # When turn 2's message is delivered again (a restore after the visibility timeout) and
    # its worker, finding it stale, settles it again: the worker's own settle call
    Settler(broker, deployment.keys).settle([Settlement(session_id, second.request, second.seq)])
    # Then loads still refuse: answering turn 2 would read turn 3, still queued, as applied
    with pytest.raises(PendingRecordMissing, match="missing on the broker"):
        client.load(session_id)
    # And once a worker applies turn 3, loads answer it
    deployment.worker()
    assert client.wait_durable(third, timeout=60).outcome == APPLIED

    def answered() -> bool:
        try:
            return _turns(client.load(session_id)) == ["t1", "t2", "t3"]
        except PendingRecordMissing:
            return False

    wait_until(answered, timeout=30, interval=0.05, message="loads answer turn 3")


def test_an_older_deliverys_settle_leaves_a_republished_request_to_its_own_message(
    deployment: Deployment, tmp_path: Path
) -> None:
    # Finding 5 (tests/model/README.md): a worker held a delivery of a staged save when the
    # broker lost it; its settle, once the producer had published the request again (same
    # id, same stamp), removed the republished entry, count and value: loads missed the
    # save while it was queued, and its republished message was dead-lettered "value lost".
    session_id = "republished"
    broker = deployment.broker_client()
    client = _client(deployment, stage_saves=True)
    try:
        worker = deployment.worker()
        first = _turn(client, session_id, 1)
        assert client.wait_durable(first, timeout=60).outcome == APPLIED
        worker.terminate()
        snapshot = _snapshot(deployment, tmp_path)
        # Given turn 2 accepted, and its message (delivery D1) taken by a worker
        second = _turn(client, session_id, 2)
        (held,) = broker.lrange(QUEUE, 0, -1)
        held_tag = json.loads(held)["properties"]["delivery_tag"]
        # And the broker come back without it (its value went too), and the producer's next
        # load finding the loss and publishing turn 2 again
        _come_back_from(deployment, snapshot)
        assert _turns(client.load(session_id)) == ["t1", "t2"]
        assert client.epoch_changes == 1
        queued = [json.loads(m) for m in broker.lrange(QUEUE, 0, -1)]  # turns 1 and 2
        (again,) = [m for m in queued if m["headers"]["id"] == second.request]
        assert again["properties"]["delivery_tag"] != held_tag
        # When the worker holding D1, its value gone, dead-letters it and settles it: the
        # worker's own settle call, with D1's delivery tag
        Settler(broker, deployment.keys).settle(
            [Settlement(session_id, second.request, second.seq, tag=held_tag)]
        )
        # Then loads still answer turn 2, queued again
        assert _turns(client.load(session_id)) == ["t1", "t2"]
        # And a worker applies the republished message, value and all
        deployment.worker()
        assert client.wait_durable(second, timeout=60).outcome == APPLIED
        assert _turns(deployment.store().load(session_id)) == ["t1", "t2"]
        wait_until(
            lambda: not broker.exists(deployment.keys.pending_requests(session_id)),
            timeout=30,
            message="turn 2 settled by its own message",
        )
        assert deployment.dead_letters().count() == 0
    finally:
        client.close()


def test_a_purged_queue_leaves_no_record_serving_a_turn_that_never_lands(
    deployment: Deployment, client: CheckpointClient
) -> None:
    # Given a sweep every second that looks for messages of entries older than 1 s (a
    # grace the settings accept only above the producers' recovery window)
    deployment.settings.update(
        sweep_interval_seconds=1.0, orphan_grace_seconds=1.0, republish_seconds=0.5
    )
    sessions = [f"purged-{n}" for n in range(20)]
    store = deployment.store()
    worker = deployment.worker()
    for session_id in sessions:
        _turn(client, session_id, 1)
    wait_until(lambda: all(store.load(s) for s in sessions), timeout=30, message="turn 1")
    worker.terminate()
    # And turn 2 accepted for every session, its message queued
    handles = [_turn(client, session_id, 2) for session_id in sessions]
    assert all(_turns(client.load(s)) == ["t1", "t2"] for s in sessions)
    # When the queue is purged (what `celery purge` does)
    deployment.broker_client().delete(QUEUE)
    deployment.worker()
    deployment.beat()
    # Then within a few sweeps every record is settled as lost, and dead-lettered
    for handle in handles:
        assert client.wait_durable(handle, timeout=60).outcome == LOST
    letters = deployment.wait_dead_letters(len(sessions))
    assert {entry.kind for entry in letters.list(100).entries} == {"lost"}
    # And loads answer what the store holds, which is all there is
    assert all(_turns(client.load(s)) == ["t1"] for s in sessions)
    assert not deployment.broker_client().zcard(deployment.keys.pending_index())
