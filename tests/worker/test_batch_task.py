"""``checkpoint.apply_batch`` without processes: InMemoryStore, fakeredis, applied in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from celery import Celery

from checkpointq.store.base import BatchOp, BatchResult
from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.memory import InMemoryStore
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks import batch, checkpoints, messages, observers, runtime
from tests.support.checkpoints import make_checkpoint
from tests.worker.test_task_policy import install


class FlakyStore(InMemoryStore):
    """A store whose batches fail ``failures`` times, then apply."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.calls = 0

    def apply_batch(self, ops: Any) -> list[BatchResult]:
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreUnavailable("batch: Redis unavailable (ConnectionError)")
        return super().apply_batch(ops)


@pytest.fixture
def redis() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("unit", set_as_current=False)
    checkpoints.register(app)
    yield app
    runtime.reset()
    observers.unsubscribe_all()


def run_batch(app: Celery, items: Any) -> Any:
    return app.tasks[messages.APPLY_BATCH].apply(args=[items]).result


def save(session_id: str, seq: int, version: int = 1) -> dict[str, Any]:
    return {
        "op": "save",
        "checkpoint": checkpoint_to_wire(make_checkpoint(session_id, version=version)),
        "seq": seq,
    }


def test_a_batch_applies_every_item_in_order(app: Celery, redis: fakeredis.FakeRedis) -> None:
    # Given an empty store
    store = InMemoryStore()
    install(store, redis)
    # When a batch saves two sessions, saves one again (newer), deletes the other
    outcome = run_batch(
        app,
        [
            save("a", 10),
            save("b", 11),
            save("a", 12, version=2),
            {"op": "delete", "session_id": "b", "seq": 13},
        ],
    )
    # Then each item applied as it would alone
    assert outcome == {"outcome": "batch", "items": 4, "applied": 3, "deleted": 1}
    loaded = store.load("a")
    assert loaded is not None and loaded.version == 2
    assert store.load("b") is None


def test_a_bad_item_is_dead_lettered_alone_and_the_rest_apply(
    app: Celery, redis: fakeredis.FakeRedis
) -> None:
    # Given a batch with an invalid checkpoint, an unknown op and a bad seq among good items
    store = InMemoryStore()
    rt = install(store, redis)
    bad_checkpoint = {"op": "save", "checkpoint": {"sessionId": "", "version": 1}, "seq": 21}
    items = [
        save("good-1", 20),
        bad_checkpoint,
        {"op": "frobnicate", "session_id": "x"},
        {"op": "delete", "session_id": "good-1", "seq": "late"},
        save("good-2", 22),
    ]
    seen: list[observers.Observation] = []
    observers.subscribe(seen.append)
    # When the worker applies it
    outcome = run_batch(app, items)
    # Then the good items applied and each bad one has its own dead letter
    assert outcome == {"outcome": "batch", "items": 5, "applied": 2, "dead_lettered": 3}
    assert store.load("good-1") is not None and store.load("good-2") is not None
    letters = {letter.reason.split(":")[0]: letter for letter in rt.dead_letters.list().entries}
    assert set(letters) == {
        "item 1 of checkpoint.apply_batch",
        "item 2 of checkpoint.apply_batch",
        "item 3 of checkpoint.apply_batch",
    }
    first = letters["item 1 of checkpoint.apply_batch"]
    # As the single request it stands for, with its own raw payload: replayable alone
    assert first.task == messages.SAVE and first.kind == "invalid_input"
    assert first.args == [bad_checkpoint["checkpoint"]] and first.kwargs == {"seq": 21}
    assert letters["item 3 of checkpoint.apply_batch"].task == messages.DELETE
    assert letters["item 2 of checkpoint.apply_batch"].task == messages.APPLY_BATCH
    # And the observers heard of every item once, as saves and deletes (the refused ones as
    # they were recorded, the others once the batch applied), then of the message itself
    assert sorted((o.task, o.outcome) for o in seen[:-1]) == sorted(
        [
            ("save", "applied"),
            ("save", "dead_lettered"),
            ("apply_batch", "dead_lettered"),  # an item that is neither a save nor a delete
            ("delete", "dead_lettered"),
            ("save", "applied"),
        ]
    )
    assert (seen[-1].task, seen[-1].outcome) == ("apply_batch", "batch")


def test_an_unavailable_store_retries_the_whole_batch_and_records_each_bad_item_once(
    app: Celery, redis: fakeredis.FakeRedis
) -> None:
    # Given a store that fails the first two attempts, and a batch with one bad item
    store = FlakyStore(failures=2)
    rt = install(store, redis, retries=5)
    # When the batch runs (Celery applies retries in-process, eagerly)
    app.tasks[messages.APPLY_BATCH].apply(args=[[save("r", 30), {"op": "delete", "seq": 31}]])
    # Then it applied on the third attempt, and the bad item was dead-lettered once
    assert store.calls == 3
    assert store.load("r") is not None
    (letter,) = rt.dead_letters.list().entries
    assert letter.task == messages.DELETE and letter.kind == "invalid_input"


def test_items_that_are_not_a_list_dead_letter_the_message(
    app: Celery, redis: fakeredis.FakeRedis
) -> None:
    rt = install(InMemoryStore(), redis)
    outcome = run_batch(app, {"op": "save"})
    assert outcome["outcome"] == "dead_lettered" and outcome["kind"] == "invalid_input"
    (letter,) = rt.dead_letters.list().entries
    assert letter.task == messages.APPLY_BATCH


def test_parse_item_refuses_unknown_fields() -> None:
    with pytest.raises(Exception, match="unknown field"):
        batch.parse_item({"op": "delete", "session_id": "x", "seq": 1, "extra": 2})
    op: BatchOp = batch.parse_item({"op": "delete", "session_id": "x"})
    assert op.seq is None
