"""Store faults that must never stop a worker: refused messages arriving while the store is down."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from tests.faults.harness import (
    QUEUE,
    Deployment,
    RssSampler,
    Scale,
    SteadyTraffic,
    describe,
    envelope,
    finish,
    generate_load,
    hold,
    push,
)
from tests.support.servers import wait_until

#: What a worker logs when it stops taking messages, and when it takes them again.
PAUSED = "store refusing writes"
RESUMED = "taking messages from"
#: What a task logs when its retries ran out while the store refused writes.
REQUEUED = "back to the queue"


def test_refused_messages_during_a_store_outage_wait_in_the_broker(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker that has noticed its store is down
    worker = deployment.worker()
    deployment.store_server.stop()
    wait_until(lambda: PAUSED in worker.log(), timeout=30, message="the worker to pause")
    # When messages it must refuse (unknown task; their dead letters go to the store) arrive
    refused = [envelope("checkpoint.nope", [i], {}) for i in range(2)]
    push(deployment.broker_client(), refused)
    hold(3.0)  # the outage goes on for a few probe intervals
    # Then they wait in the broker, untouched ...
    waiting = int(deployment.broker_client().llen(QUEUE))
    # ... and once the store is back and valid requests follow, the same worker applies them
    # all and dead-letters the refused ones
    deployment.store_server.start()
    load = generate_load(scale.sessions, scale.requests, random.Random(11))
    push(deployment.broker_client(), (r.envelope() for r in load))
    verdict = deployment.settle(load, timeout=240)
    deployment.wait_dead_letters(len(refused))
    row = finish(
        deployment,
        verdict,
        scenario="11-refused-during-outage",
        title="refused messages arrive while the store is down",
        load=describe(scale),
        faults="store Redis down; 2 unknown-task messages pushed during the outage",
        notes=f"{waiting} of 2 waited in the broker while the worker was paused; "
        "dead-lettered once the store was back",
        expect_dead=len(refused),
        passed=worker.running() and waiting == len(refused),
    )
    assert waiting == len(refused)
    assert worker.running()
    assert row.dead_lettered == len(refused)


def _out_of_memory(deployment: Deployment) -> Callable[[], object]:
    """Cap the store's memory below what it uses, eviction off: every write is refused.
    Returns what the operator does to end it (raise the limit)."""
    client = deployment.store_client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1024 * 1024, used // 2))
    return lambda: client.config_set("maxmemory", 0)


def _down(deployment: Deployment) -> Callable[[], object]:
    deployment.store_server.stop()
    return deployment.store_server.start


@pytest.mark.timeout(1200)  # long mode: a 120 s fault, then the backlog it left to drain
@pytest.mark.parametrize(
    ("scenario", "fault", "retry_max"),
    [
        ("16a-store-down-long", "down", 8),
        ("16b-store-down-long-retry-max-3", "down", 3),
        ("16c-store-out-of-memory", "oom", 8),
    ],
)
def test_a_store_fault_longer_than_the_retry_budget_loses_and_dead_letters_nothing(
    deployment: Deployment, scale: Scale, scenario: str, fault: str, retry_max: int
) -> None:
    # Given a worker with the retry settings of this scale (production's in the long mode),
    # and producers pushing steadily
    deployment.settings.update(dict(scale.retry_settings), retry_max=retry_max)
    worker = deployment.worker()
    load = generate_load(scale.sessions, scale.requests, random.Random(13))
    lead = 5.0
    traffic = SteadyTraffic(deployment.broker_client(), load, len(load) / (lead + scale.long_fault))
    with RssSampler(worker.pid) as rss:
        traffic.start()
        hold(lead)
        # When the store fails (down, or out of memory until an operator raises the limit)
        # for longer than a request's whole retry budget, while the traffic goes on
        end_fault = _down(deployment) if fault == "down" else _out_of_memory(deployment)
        wait_until(lambda: PAUSED in worker.log(), timeout=30, message="the worker to pause")
        hold(scale.long_fault - lead)
        traffic.finish()
        end_fault()
        ended = time.monotonic()
        # Then the worker resumes by itself and every request applies: nothing lost, none
        # dead-lettered
        verdict = deployment.settle(load, timeout=600)
        converged = time.monotonic() - ended
    log = worker.log()
    requeued = log.count(REQUEUED)
    what = "down" if fault == "down" else "out of memory (maxmemory, noeviction)"
    finish(
        deployment,
        verdict,
        scenario=scenario,
        title=f"store {what} {scale.long_fault:.0f} s under steady traffic, "
        f"CHECKPOINTQ_RETRY_MAX={retry_max}",
        load=describe(scale),
        faults=f"store {what} {scale.long_fault:.0f} s while requests keep arriving",
        notes=f"worker paused {log.count(PAUSED)}x while the store refused writes; "
        f"{log.count('retry ')} retries, {requeued} requeued with retries spent; "
        f"retries {dict(scale.retry_settings)}",
        passed=worker.running(),
        rss=rss,
        converged_s=converged,
    )
    assert worker.running()
    assert RESUMED in log


@pytest.mark.timeout(1200)
def test_requests_whose_retries_run_out_in_an_outage_go_back_to_the_queue(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker that would notice an outage only after an hour (its backpressure all
    # but off) and gives up on the store after one retry
    deployment.settings.update(store_probe_seconds=3600, retry_max=1)
    worker = deployment.worker()
    load = generate_load(scale.sessions, scale.requests, random.Random(14))
    with RssSampler(worker.pid) as rss:
        push(deployment.broker_client(), (r.envelope() for r in load))
        wait_until(lambda: deployment.backlog() <= len(load) * 0.8, timeout=120, message="20% done")
        # When the store is down for longer than that retry budget
        deployment.store_server.stop()
        stopped = time.monotonic()
        # (each retry waits its turn behind the whole queue: minutes in the long mode)
        wait_until(
            lambda: worker.log().count(REQUEUED) >= 10,
            timeout=600,
            message="requests to run out of retries",
        )
        hold(scale.store_outage)
        deployment.store_server.start()
        ended = time.monotonic()
        outage = ended - stopped
        # Then every request whose retries ran out went back to the queue, none was
        # acknowledged or dead-lettered, and all of them apply once the store is back
        verdict = deployment.settle(load, timeout=240)
        converged = time.monotonic() - ended
    requeued = worker.log().count(REQUEUED)
    finish(
        deployment,
        verdict,
        scenario="16d-retries-spent-in-outage",
        title="retries run out during a store outage (backpressure off)",
        load=describe(scale),
        faults=f"store down {outage:.0f} s (until 10 requeues, then {scale.store_outage:.0f} s "
        "more), CHECKPOINTQ_RETRY_MAX=1, store probe every 3600 s",
        notes=f"{requeued} requeues of requests whose retries ran out while the store refused "
        "writes (rejected with requeue: back to the queue, never acknowledged)",
        passed=worker.running() and requeued > 0,
        rss=rss,
        converged_s=converged,
    )
    assert worker.running()
