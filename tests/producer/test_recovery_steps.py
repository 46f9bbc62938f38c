"""The recovery pass both clients run (``RecordCalls.recover_steps``), judged without I/O:
the sync client drives it with blocking round trips, the asyncio one with awaited ones, so
its rules live in one place. Real brokers: tests/producer/test_broker_losses.py (sync) and
test_async_parity.py (asyncio)."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from redis import exceptions as redis_errors

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.producer.fast_publish import Envelopes
from checkpointq.tasks.producer.pending import (
    Commands,
    RecordCalls,
    RecordWrite,
    drive,
    with_fresh_tag,
)

EPOCH = b"epoch-1"


def _calls(kept: int) -> RecordCalls:
    calls = RecordCalls(KeySpace(), ttl_seconds=60)
    calls.epochs.observe(EPOCH, 10)
    for n in range(kept):
        calls.recent.add(
            "q", f"message-{n}".encode(), [RecordWrite(f"s{n}", n + 1, "delete", f"r{n}")]
        )
    return calls


def _message(commands: Commands) -> bytes:
    (script,) = commands
    return bytes(script[3 + script[2]])  # ARGV[1], after EVALSHA, sha, numkeys and KEYS


def test_a_pass_skips_refused_requests_and_stops_at_a_broker_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given four kept publishes, the broker refusing the first's seq, failing on the third
    calls = _calls(4)
    sent: list[bytes] = []

    def send(commands: Commands) -> list[Any]:
        message = _message(commands)
        sent.append(message)
        if message == b"message-0":
            return [redis_errors.ResponseError("CQREFUSED seq past its deadline")]
        if message == b"message-2":
            raise redis_errors.ConnectionError("broker gone")
        return [[EPOCH, 11, 0]]

    # When the pass runs
    with caplog.at_level(logging.ERROR):
        republished = drive(calls.recover_steps(), send)
    # Then it went on past the refusal, stopped at the error, and counted what went out
    assert sent == [b"message-0", b"message-1", b"message-2"]
    assert republished == 1 and calls.republished == 1
    assert "republished 1 requests, then: broker gone" in caplog.text


def test_one_pass_at_a_time_and_the_next_one_runs() -> None:
    # Given a pass suspended on its first write (a task awaiting the broker, or a thread)
    calls = _calls(2)
    first = calls.recover_steps()
    next(first)
    # When a second pass starts meanwhile, it sends nothing and reports none
    assert drive(calls.recover_steps(), lambda _: pytest.fail("sent")) == 0
    # Then once the first is answered to its end, a later pass runs whole
    first.send([[EPOCH, 11, 0]])
    with pytest.raises(StopIteration) as done:
        first.send([[EPOCH, 12, 0]])
    assert done.value.value == 2
    assert drive(calls.recover_steps(), lambda _: [[EPOCH, 13, 0]]) == 2


def test_a_pass_abandoned_mid_write_lets_the_next_one_run() -> None:
    # Given a pass whose driver was cancelled on its first write (the generator dropped)
    calls = _calls(1)
    abandoned = calls.recover_steps()
    next(abandoned)
    abandoned.close()
    # Then the next pass is not refused as "under way"
    assert drive(calls.recover_steps(), lambda _: [[EPOCH, 11, 0]]) == 1


def test_a_republished_message_carries_a_fresh_delivery_tag_and_nothing_else_new() -> None:
    # Given a publish kept in the window, as the fast publisher builds its message
    first = Envelopes("q").envelope("checkpoint.delete", b"[[], {}, {}]", "()", "{}", "r0")
    calls = RecordCalls(KeySpace(), ttl_seconds=60)
    calls.epochs.observe(EPOCH, 10)
    calls.recent.add("q", first, [RecordWrite("s0", 1, "delete", "r0")])
    sent: list[bytes] = []

    def send(commands: Commands) -> list[Any]:
        sent.append(_message(commands))
        return [[EPOCH, 11, 0]]

    # When the pass publishes it again
    drive(calls.recover_steps(), send)
    # Then its delivery tag is new (settle.lua tells the two publishes apart by it) and the
    # rest of the message is as it was
    (again,) = [orjson.loads(m) for m in sent]
    before = orjson.loads(first)
    assert again["properties"].pop("delivery_tag") != before["properties"].pop("delivery_tag")
    assert again == before
    # And a message that does not end with a tag goes as it is
    assert with_fresh_tag(b'{"body": "x"}') == b'{"body": "x"}'
