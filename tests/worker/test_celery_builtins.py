"""Celery's builtin tasks are not ours to run: a message naming one is dead-lettered as an
unknown task, and nothing it carries reaches the store (a real worker)."""

from __future__ import annotations

from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.messages import SAVE
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.workers import QUEUE
from tests.worker.conftest import Deployment

BUILTINS = [
    "celery.map",
    "celery.starmap",
    "celery.chunks",
    "celery.group",
    "celery.chain",
    "celery.chord",
    "celery.chord_unlock",
    "celery.accumulate",
    "celery.backend_cleanup",
]


def test_a_message_naming_a_celery_builtin_is_dead_lettered_as_an_unknown_task(
    live: Deployment,
) -> None:
    save = {"task": SAVE, "args": [checkpoint_to_wire(make_checkpoint("via-builtin"))]}
    broker = live.broker_client()
    # Given one message per Celery builtin, celery.map carrying a save (it would apply it)
    for name in BUILTINS:
        args: list[object] = [save, [[]]] if name == "celery.map" else [[save], {}]
        broker.lpush(QUEUE, protocol2(name, args, task_id=f"builtin-{name}"))
    with live.checkpoint_client() as client:
        # When a good request follows them
        client.wait_durable(client.save(make_checkpoint("after-builtins")), timeout=20)
        live.wait_drained()
        # Then each builtin is an unknown task in the dead letters, with its arguments
        letters = live.dead_letters().list(count=100).entries
        assert sorted((letter.kind, letter.task) for letter in letters) == sorted(
            ("unknown_task", name) for name in BUILTINS
        ), [(letter.kind, letter.task, letter.reason) for letter in letters]
        mapped = next(letter for letter in letters if letter.task == "celery.map")
        assert mapped.args == [save, [[]]]
        # And nothing they carried was applied
        assert client.load("via-builtin") is None
