"""The WAIT a replicated publish sends and how its reply is judged (``broker_durability``);
tests/faults/test_broker_replication.py runs it against a real replica."""

from __future__ import annotations

import pytest
from redis import exceptions as redis_errors

from checkpointq.store.errors import CheckpointError, InvalidInput
from checkpointq.tasks.errors import ReplicationTimeout
from checkpointq.tasks.producer.broker_durability import BrokerDurability

SCRIPT = ("EVALSHA", "digest", 0)


def test_local_sends_no_wait_and_checks_nothing() -> None:
    local = BrokerDurability()
    assert local.with_wait([SCRIPT]) == [SCRIPT]
    assert local.split(["reply"]) == (["reply"], None)
    local.check(None, "the save", "redis://b")
    assert local.wait_seconds == 0


def test_replicated_waits_in_the_same_write_and_raises_when_too_few_acknowledge() -> None:
    durability = BrokerDurability.replicated(replicas=2, timeout_ms=250)
    assert durability.with_wait([SCRIPT]) == [SCRIPT, ("WAIT", 2, 250)]
    assert durability.with_wait([SCRIPT], wait=False) == [SCRIPT]  # a republish
    assert durability.split(["reply", 1]) == (["reply"], 1)
    assert durability.wait_seconds == 0.25
    durability.check(2, "the save", "redis://b")
    with pytest.raises(ReplicationTimeout) as raised:
        durability.check(1, "the save of session 's'", "redis://b")
    assert isinstance(raised.value, CheckpointError)
    assert (raised.value.acked, raised.value.replicas, raised.value.timeout_ms) == (1, 2, 250)
    assert "only 1 of 2 replica(s) acknowledged it within 250 ms" in str(raised.value)
    with pytest.raises(redis_errors.ResponseError):
        durability.check(redis_errors.ResponseError("ERR WAIT"), "the save", "redis://b")


def test_a_mode_or_count_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidInput, match="mode: must be 'local' or 'replicated'"):
        BrokerDurability("sync")
    with pytest.raises(InvalidInput, match="replicas: must be at least 1"):
        BrokerDurability.replicated(replicas=0)
