"""End to end: batched requests through a real worker, one pipelined round trip per message."""

from __future__ import annotations

import orjson
import pytest

from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks import messages
from checkpointq.tasks.messages import APPLY_BATCH
from checkpointq.tasks.producer.batching import BatchingClient
from tests.support.checkpoints import make_checkpoint
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration


def test_batched_saves_and_deletes_are_applied_by_the_worker(live: Deployment) -> None:
    # Given a batching client of the deployment
    with BatchingClient(live.checkpoint_client(), window_ms=5, max_items=20) as client:
        # When it saves 50 sessions, saves ten of them again and deletes five
        first = [client.save(make_checkpoint(f"b{n}", version=1)) for n in range(50)]
        again = [client.save(make_checkpoint(f"b{n}", version=2)) for n in range(10)]
        gone = [client.delete(f"b{n}") for n in range(45, 50)]
        # Then every request becomes durable, each as it would alone
        for handle in first + again + gone:
            client.wait_durable(handle, timeout=20)
        assert sorted(client.list()) == sorted(f"b{n}" for n in range(45))
        loaded = client.load("b3")
        assert loaded is not None and loaded.version == 2
        loaded = client.load("b30")
        assert loaded is not None and loaded.version == 1
    live.wait_drained()
    assert live.dead_letters().count() == 0


def test_a_bad_item_is_dead_lettered_alone_while_the_rest_apply(live: Deployment) -> None:
    # Given a batch message, written by hand, with an invalid checkpoint between good items
    good = [checkpoint_to_wire(make_checkpoint(f"mixed-{n}")) for n in range(2)]
    items = [
        {"op": "save", "checkpoint": good[0], "seq": 10},
        {"op": "save", "checkpoint": {"sessionId": "", "version": 1}, "seq": 11},
        {"op": "save", "checkpoint": good[1], "seq": 12},
    ]
    with live.checkpoint_client() as client:
        client.send_encoded(APPLY_BATCH, messages.body(orjson.dumps([items]), b"{}"), "[<3 items>]")
        live.wait_drained()
        # Then both good items applied
        assert sorted(client.list()) == ["mixed-0", "mixed-1"]
    # And the bad one has its own dead letter, as the save it stands for
    (letter,) = live.dead_letters().list().entries
    assert letter.kind == "invalid_input" and letter.task == "checkpoint.save"
    assert letter.args == [items[1]["checkpoint"]] and letter.kwargs == {"seq": 11}
    assert "item 1 of checkpoint.apply_batch" in letter.reason
