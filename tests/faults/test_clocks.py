"""A producer clock far ahead: its requests are refused instead of freezing their sessions."""

from __future__ import annotations

import random

from tests.faults.harness import (
    SAVE,
    Deployment,
    Request,
    Scale,
    describe,
    finish,
    generate_load,
    push,
    seq_base,
)

#: One hour in µs: the skew of the producer whose clock runs ahead.
HOUR_US = 3600 * 1_000_000


def test_a_producer_clock_an_hour_ahead_cannot_freeze_its_sessions(
    deployment: Deployment, scale: Scale
) -> None:
    # Given one producer whose clock runs an hour ahead, saving every tenth session first
    load = generate_load(scale.sessions, scale.requests, random.Random(12))
    sessions = sorted({r.session_id for r in load})[::10]
    ahead = [
        Request(SAVE, sid, seq_base() + HOUR_US, version=10**9 + i)
        for i, sid in enumerate(sessions)
    ]
    worker = deployment.worker()
    push(deployment.broker_client(), (r.envelope() for r in ahead))
    # When the correct producers' requests follow
    push(deployment.broker_client(), (r.envelope() for r in load))
    # Then every correct request ends as if the skewed ones never came (none of them won a
    # fence), and each skewed one is a dead letter saying why
    verdict = deployment.settle(load, timeout=240)
    letters = deployment.wait_dead_letters(len(ahead))
    reasons = {entry.reason for entry in letters.list(count=len(ahead)).entries}
    row = finish(
        deployment,
        verdict,
        scenario="12-clock-ahead",
        title="a producer clock an hour ahead",
        load=describe(scale),
        faults=f"{len(ahead)} saves stamped 1 h ahead, sent before the load",
        notes="each refused as invalid input (seq beyond CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS)",
        expect_dead=len(ahead),
        passed=worker.running(),
    )
    assert row.dead_lettered == len(ahead)
    assert all("ahead of this worker's clock" in reason for reason in reasons), reasons
