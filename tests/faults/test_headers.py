"""Headers a producer controls: an ``eta`` far ahead, an ``expires`` already past."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from tests.faults.harness import (
    SAVE,
    Deployment,
    Request,
    RssSampler,
    Scale,
    describe,
    envelope,
    finish,
    generate_load,
    push,
)

CASES = {
    # scenario: (header, offset from now, as said in the row, dead-letter kind, its reason)
    "17-far-future-eta": (
        "eta",
        timedelta(days=1),
        "a day ahead",
        "invalid_input",
        "the broker would hand",
    ),
    "18-expired": ("expires", timedelta(minutes=-5), "5 min past", "expired", "expired at"),
}


@pytest.mark.parametrize("scenario", sorted(CASES))
def test_a_timing_header_the_worker_cannot_honour_is_dead_lettered_not_held_or_dropped(
    deployment: Deployment, scale: Scale, scenario: str
) -> None:
    header, offset, said, kind, words = CASES[scenario]
    # Given a load, and for every tenth session a newer save carrying the header: were it
    # applied it would win its session, were it held it would sit in the worker
    load = generate_load(scale.sessions, scale.requests, random.Random(15))
    last = max(r.seq for r in load)
    sessions = sorted({r.session_id for r in load})[::10]
    timed = [Request(SAVE, sid, last + 1 + i, version=10**9 + i) for i, sid in enumerate(sessions)]
    when = (datetime.now(UTC) + offset).isoformat()
    worker = deployment.worker()
    with RssSampler(worker.pid) as rss:
        # When they are sent first, and the load follows
        push(
            deployment.broker_client(),
            (envelope(SAVE, *r.args(), task_id=r.task_id, headers={header: when}) for r in timed),
        )
        push(deployment.broker_client(), (r.envelope() for r in load))
        # Then the load ends exact (none of them applied), nothing is held, and each of them
        # is a replayable dead letter saying why
        verdict = deployment.settle(load, timeout=240)
        letters = deployment.wait_dead_letters(len(timed))
    entries = letters.list(count=len(timed)).entries
    right = all(e.kind == kind and words in e.reason and e.replayable for e in entries)
    row = finish(
        deployment,
        verdict,
        scenario=scenario,
        title=f"saves whose {header} is {said}",
        load=describe(scale),
        faults=f"{len(timed)} newer saves with {header} {said}, sent before the load "
        "(visibility timeout 10 s)",
        notes=f"each dead-lettered as {kind} with its arguments (replayable); "
        "none held by the worker, none applied",
        expect_dead=len(timed),
        passed=worker.running() and right,
        rss=rss,
    )
    assert worker.running()
    assert row.dead_lettered == len(timed)
    assert right, [(e.kind, e.reason) for e in entries]
