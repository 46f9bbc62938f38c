"""A worker notices a broker that went back in time, as producers do (issue 44): each
heartbeat reads the broker's pending epoch and mark, and says how many losses it saw."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from checkpointq.store.keys import KeySpace
from checkpointq.worker.ops.health import Heartbeat
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = RedisServer().start()
    yield started
    started.cleanup()


def test_a_heartbeat_counts_a_broker_gone_back_in_time(server: RedisServer) -> None:
    keys = KeySpace()
    client = server.client()
    heart = Heartbeat(client, keys, "w1", interval=1.0, queue="q", broker=client)
    client.set(keys.pending_epoch(), "e1")
    client.hset(keys.pending_mark(), "n", 40)
    heart.beat()
    client.hset(keys.pending_mark(), "n", 45)
    heart.beat()
    assert heart.value()["broker_losses"] == 0
    # When the broker comes back with an older mark (a lagging replica promoted)
    client.hset(keys.pending_mark(), "n", 41)
    heart.beat()
    # Then the worker counts it once, in its heartbeat too
    assert heart.epochs.changes == 1
    heart.beat()
    assert heart.value()["broker_losses"] == 1
    # And the epoch the reporting producer turns is the same loss: not counted again
    client.set(keys.pending_epoch(), "e2")
    heart.beat()
    assert heart.epochs.changes == 1
    # But a later change of the epoch is another loss
    client.set(keys.pending_epoch(), "e3")
    heart.beat()
    assert heart.epochs.changes == 2
    client.close()


def test_a_heartbeat_counts_a_loss_that_later_publishes_brought_the_mark_back_above(
    server: RedisServer,
) -> None:
    keys = KeySpace()
    client = server.client()
    heart = Heartbeat(client, keys, "w1", interval=1.0, queue="q", broker=client)
    client.set(keys.pending_epoch(), "e1")
    client.hset(keys.pending_mark(), mapping={"n": 40, "t40": "40:aaaa"})
    heart.beat()  # mark 40, with its token (publish.lua's ring)
    # When the broker lost mark 40 and later publishes, unaware, took it and went past it
    client.hset(keys.pending_mark(), mapping={"n": 42, "t40": "40:bbbb", "t42": "42:cccc"})
    heart.beat()
    # Then the worker counts it once: its mark holds another publish
    assert heart.epochs.changes == 1
    heart.beat()
    # But a slot overwritten by a mark 65536 further on tells nothing
    client.hset(keys.pending_mark(), mapping={"n": 65578, "t42": "65578:dddd"})
    heart.beat()
    assert heart.value()["broker_losses"] == 1
    client.close()
