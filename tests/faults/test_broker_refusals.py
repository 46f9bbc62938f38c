"""A broker that refuses writes (out of memory, read-only) must pause a worker, never stop it.

Broker and store on one Redis is the default layout (``checkpointq up``, docker compose):
there one ``maxmemory`` refuses the store's writes and the broker's at once, and a refused
ack, reject or retry publish used to end the worker ("Unrecoverable error:
OutOfMemoryError"), with its queue left to grow.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import redis

from tests.faults.harness import (
    Deployment,
    RssSampler,
    Scale,
    SteadyTraffic,
    Verdict,
    describe,
    finish,
    generate_load,
    hold,
    push,
)
from tests.support.servers import RedisServer, wait_until

#: What a worker logs when it stops taking messages, and when it takes them again.
PAUSED = "refusing writes"
RESUMED = "writes again after"


def _out_of_memory(client: redis.Redis) -> Callable[[], object]:
    """Cap the server's memory below what it uses, eviction off: every write is refused.
    Returns what the operator does to end it (raise the limit)."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1024 * 1024, used // 2))
    return lambda: client.config_set("maxmemory", 0)


def _steady_run(
    deployment: Deployment,
    scale: Scale,
    fault: Callable[[], Callable[[], object]],
    seconds: float,
    seed: int,
) -> tuple[Verdict, float, RssSampler, str, int]:
    """Steady traffic through ``seconds`` of ``fault``; the verdict once it ended, the
    seconds from its end to the expected state, the worker's RSS, its log and exit code
    on SIGTERM afterwards."""
    deployment.settings.update(dict(scale.retry_settings))
    worker = deployment.worker()
    load = generate_load(scale.sessions, scale.requests, random.Random(seed))
    # Half the load queued at once, so that the fault finds the worker busy (requests held,
    # store writes and acks in flight), the other half pushed steadily through the fault
    backlog, steady = load[: len(load) // 2], load[len(load) // 2 :]
    traffic = SteadyTraffic(deployment.broker_client(), steady, len(steady) / seconds, patient=True)
    with RssSampler(worker.pid) as rss:
        push(deployment.broker_client(), (r.envelope() for r in backlog))
        deployment.wait_progress(len(backlog), 0.1)
        traffic.start()
        end_fault = fault()
        try:
            wait_until(lambda: PAUSED in worker.log(), timeout=30, message="the worker to pause")
        except AssertionError:
            raise AssertionError(worker.log()[-6000:]) from None
        hold(seconds)
        end_fault()
        ended = time.monotonic()
        traffic.finish()
        verdict = deployment.settle(load, timeout=300)
        converged = time.monotonic() - ended
    assert worker.running(), worker.log()[-3000:]
    log = worker.log()
    return verdict, converged, rss, log, worker.terminate(timeout=30)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seconds", [10.0, 120.0], ids=["10s", "120s"])
def test_a_shared_redis_at_maxmemory_pauses_the_worker_and_it_heals_by_itself(
    broker: RedisServer, scale: Scale, seconds: float
) -> None:
    if seconds > 60 and scale.name != "long":
        pytest.skip("the 120 s fault runs in the long mode (--long)")
    # Given broker and store on one Redis (the default layout), producers pushing steadily
    deployment = Deployment(broker, broker)
    try:
        # When that Redis reaches maxmemory (noeviction) for a while, then is given room
        verdict, converged, rss, log, code = _steady_run(
            deployment, scale, lambda: _out_of_memory(broker.client()), seconds, seed=26
        )
        # Then the worker paused, resumed by itself, lost nothing, and stops on SIGTERM
        finish(
            deployment,
            verdict,
            scenario=f"26a-shared-redis-maxmemory-{seconds:.0f}s",
            title=f"broker and store on one Redis at maxmemory (noeviction) for {seconds:.0f} s",
            load=describe(scale) + ", steady; producers retry refused pushes",
            faults=f"one Redis refusing every write for {seconds:.0f} s, then given room",
            notes=f"worker paused {log.count(PAUSED)}x, resumed {log.count(RESUMED)}x; "
            f"never exited; SIGTERM afterwards exit {code}",
            passed=RESUMED in log and "Unrecoverable" not in log and code == 0,
            rss=rss,
            converged_s=converged,
        )
    finally:
        deployment.cleanup()


@pytest.mark.timeout(900)
def test_a_broker_only_at_maxmemory_pauses_the_worker_while_its_store_accepts_writes(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a broker and a store of its own; when the broker alone refuses writes for a while
    verdict, converged, rss, log, code = _steady_run(
        deployment, scale, lambda: _out_of_memory(deployment.broker.client()), 10.0, seed=27
    )
    # Then the worker paused on the broker's refusal, resumed by itself and lost nothing
    finish(
        deployment,
        verdict,
        scenario="26b-broker-only-maxmemory",
        title="broker at maxmemory (noeviction) for 10 s, store on its own Redis",
        load=describe(scale) + ", steady; producers retry refused pushes",
        faults="the broker refusing every write for 10 s, then given room",
        notes=f"worker paused {log.count('broker refusing writes')}x on the broker's refusal, "
        f"resumed {log.count(RESUMED)}x; SIGTERM afterwards exit {code}",
        passed="broker refusing writes" in log and RESUMED in log and code == 0,
        rss=rss,
        converged_s=converged,
    )
