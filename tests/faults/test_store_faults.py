"""Store faults that must never stop a worker: refused messages arriving while the store is down."""

from __future__ import annotations

import random

from tests.faults.harness import (
    Deployment,
    Scale,
    conclude,
    describe,
    envelope,
    generate_load,
    push,
)
from tests.support.servers import wait_until

#: What the consumer logs when a dead letter cannot be written and the message stays queued.
LEFT_FOR_REDELIVERY = "unacknowledged for redelivery"


def test_refused_messages_during_a_store_outage_leave_the_worker_consuming(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker whose every prefetch slot (concurrency 2) is about to hold a message
    # that it must refuse (an unknown task) while the store, where dead letters go, is down
    worker = deployment.worker()
    deployment.store_server.stop()
    refused = [envelope("checkpoint.nope", [i], {}) for i in range(2)]
    push(deployment.broker_client(), refused)
    wait_until(
        lambda: worker.log().count(LEFT_FOR_REDELIVERY) >= len(refused),
        timeout=60,
        message="both refused messages to meet the store outage",
    )
    # When the store comes back and valid requests follow
    deployment.store_server.start()
    load = generate_load(scale.sessions, scale.requests, random.Random(11))
    push(deployment.broker_client(), (r.envelope() for r in load))
    # Then the same worker applies them all, and the refused messages, redelivered after the
    # visibility timeout, are dead-lettered instead of lost
    verdict = deployment.settle(load, timeout=240)
    deployment.wait_dead_letters(len(refused))
    row = conclude(
        deployment,
        verdict,
        scenario="11-refused-during-outage",
        title="refused messages arrive while the store is down",
        load=describe(scale),
        faults="store Redis down while 2 unknown-task messages fill the prefetch window",
        notes="slots freed; the 2 refused messages come back after the visibility timeout",
        expect_dead=len(refused),
        passed=worker.running(),
    )
    assert worker.running()
    assert verdict.exact, verdict
    assert row.dead_lettered == len(refused)
