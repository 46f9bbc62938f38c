"""A broker that refuses writes (out of memory, read-only) must pause a worker, never stop it.

Broker and store on one Redis is the default layout (``checkpointq up``, docker compose):
there one ``maxmemory`` refuses the store's writes and the broker's at once, and a refused
ack, reject or retry publish used to end the worker ("Unrecoverable error:
OutOfMemoryError"), with its queue left to grow.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from checkpointq.worker.consumer import EXIT_GRACE, EXIT_STATUS
from tests.faults import consumer_fault
from tests.faults.harness import (
    Celery,
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
#: What Celery logs as it restarts the consumer (a refused write or a lost connection).
RESTARTED = "Restarting event loop"
#: Seconds a loaded machine may add to a worker's own deadline to stop.
STOP_SLACK = 30.0


def _out_of_memory(client: redis.Redis) -> Callable[[], object]:
    """Cap the server's memory below what it uses, eviction off: every write is refused.
    Returns what the operator does to end it (raise the limit)."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1024 * 1024, used // 2))
    return lambda: client.config_set("maxmemory", 0)


def _healed(deployment: Deployment, converged: float) -> bool:
    """Whether the worker took messages again by itself (its gate resumed, or its consumer
    restarted with a new gate, which starts open) well before the visibility timeout would
    have redelivered what it held: nothing it held waited for that."""
    return converged < float(str(deployment.all_settings["visibility_timeout"])) / 2


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
            notes=f"worker paused {log.count(PAUSED)}x, resumed {log.count(RESUMED)}x, its "
            f"consumer restarted {log.count(RESTARTED)}x; never exited; SIGTERM afterwards "
            f"exit {code}",
            passed="Unrecoverable" not in log and code == 0 and _healed(deployment, converged),
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
        f"resumed {log.count(RESUMED)}x, its consumer restarted {log.count(RESTARTED)}x; "
        f"SIGTERM afterwards exit {code}",
        passed="broker refusing writes" in log and code == 0 and _healed(deployment, converged),
        rss=rss,
        converged_s=converged,
    )


@pytest.mark.timeout(900)
def test_sigterm_stops_a_worker_paused_by_a_refusing_broker_and_nothing_is_lost(
    broker: RedisServer, scale: Scale
) -> None:
    # Given broker and store on one Redis, and a worker busy with a load
    deployment = Deployment(broker, broker)
    try:
        load = generate_load(scale.sessions, scale.requests, random.Random(29))
        worker = deployment.busy_worker(load, 0.1)
        # ... paused because that Redis refuses every write
        end_fault = _out_of_memory(broker.client())
        wait_until(lambda: PAUSED in worker.log(), timeout=30, message="the worker to pause")
        # When it is told to stop (SIGTERM) while paused and holding messages
        held = deployment.backlog()
        assert worker.process is not None
        stopping = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        # Then it exits by itself (no SIGKILL) within its shutdown timeout and some slack
        # for a loaded machine
        limit = float(str(deployment.all_settings["shutdown_timeout_seconds"])) + STOP_SLACK
        code = worker.process.wait(timeout=limit)
        stopped = time.monotonic() - stopping
        log = worker.log()
        worker.process = None
        # ... and once the Redis has room, a new worker applies every request
        end_fault()
        deployment.worker()
        verdict = deployment.settle(load, timeout=300)
        finish(
            deployment,
            verdict,
            scenario="26s-sigterm-while-paused",
            title="SIGTERM to a worker paused by its Redis at maxmemory, then a new worker",
            load=describe(scale),
            faults=f"one Redis refusing every write; SIGTERM with {held} messages queued or held",
            notes=f"exit {code} {stopped:.1f} s after SIGTERM (shutdown timeout "
            f"{deployment.all_settings['shutdown_timeout_seconds']} s); what it held was "
            "redelivered to the next worker",
            passed=code == 0 and "Unrecoverable" not in log,
            converged_s=None,
        )
    finally:
        deployment.cleanup()


@pytest.mark.timeout(900)
def test_an_unexpected_error_in_the_consumer_exits_the_worker_for_its_supervisor(
    deployment: Deployment, scale: Scale, tmp_path: Path
) -> None:
    # Given a worker whose consumer has a bug that fires on the first message it receives
    deployment.settings["include"] = "tests.faults.consumer_fault"
    env = {**deployment.env(), consumer_fault.MARKER: str(tmp_path / "fired")}
    worker = Celery("worker", env)
    deployment.processes.append(worker)
    worker.start()
    load = generate_load(scale.sessions, scale.requests, random.Random(30))
    # When a load arrives
    push(deployment.broker_client(), (r.envelope() for r in load))
    # Then the process does not live on consuming nothing: it exits, with an error status
    assert worker.process is not None
    code = worker.process.wait(timeout=EXIT_GRACE + STOP_SLACK)
    log = worker.log()
    # ... and the same worker started again (its supervisor's restart) applies every request
    worker.start()
    verdict = deployment.settle(load, timeout=300)
    finish(
        deployment,
        verdict,
        scenario="26u-unexpected-consumer-error",
        title="an unexpected exception in the worker's consumer, then a supervisor's restart",
        load=describe(scale),
        faults="RuntimeError raised in the consumer on the first message received",
        notes=f"the worker exited with status {code} "
        f"({'its shutdown' if code != EXIT_STATUS else 'the exit timer'}); "
        "restarted, it applied every request",
        passed=code != 0 and "injected: a bug in the consumer" in log,
    )


def _role(client: redis.Redis) -> str:
    return str(client.info("replication")["role"])


def _failover(master: RedisServer, replica: RedisServer) -> None:
    """Redis's coordinated failover: ``master`` pauses writes until ``replica`` caught up,
    then turns into its replica (answering ``-READONLY`` to writes) as ``replica`` is
    promoted."""
    failover: Any = master.client().execute_command
    failover("FAILOVER", "TO", "127.0.0.1", replica.port, "TIMEOUT", 10000)
    wait_until(
        lambda: _role(master.client()) == "slave" and _role(replica.client()) == "master",
        timeout=30,
        message="the failover",
    )
    wait_until(
        lambda: master.client().info("replication").get("master_link_status") == "up",
        timeout=30,
        message="the demoted broker to follow the promoted one",
    )


def _synced_replica_of(broker: RedisServer) -> RedisServer:
    """A new redis-server replicating ``broker``, once it is in sync."""
    other = RedisServer().start()
    try:
        other.client().replicaof("127.0.0.1", broker.port)
        wait_until(
            lambda: other.client().info("replication").get("master_link_status") == "up",
            timeout=30,
            message="the replica to sync",
        )
    except BaseException:
        other.cleanup()
        raise
    return other


@pytest.mark.timeout(900)
def test_a_broker_demoted_to_a_read_only_replica_pauses_the_worker_until_it_is_master_again(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a broker with a replica (kept in sync), a store of its own, producers pushing
    broker, other = deployment.broker, _synced_replica_of(deployment.broker)
    try:

        def demote() -> Callable[[], object]:
            # When the replica is promoted away: the broker the workers and producers use
            # answers every write with -READONLY, until it is made master again
            _failover(broker, other)
            return lambda: _failover(other, broker)

        verdict, converged, rss, log, code = _steady_run(deployment, scale, demote, 10.0, seed=31)
        # Then the worker paused on the refusal, resumed by itself and lost nothing
        finish(
            deployment,
            verdict,
            scenario="26r-broker-read-only",
            title="broker demoted to a read-only replica (FAILOVER to its replica) for 10 s, "
            "then master again",
            load=describe(scale) + ", steady; producers retry refused pushes",
            faults="the broker answering -READONLY to every write for 10 s",
            notes=f"worker paused {log.count('broker refusing writes')}x on the broker's "
            f"refusal, resumed {log.count(RESUMED)}x, its consumer restarted "
            f"{log.count(RESTARTED)}x; never exited; SIGTERM afterwards exit {code}",
            passed="read-only" in log and code == 0 and _healed(deployment, converged),
            rss=rss,
            converged_s=converged,
        )
    finally:
        other.cleanup()


@pytest.mark.timeout(600)
def test_an_idle_worker_waiting_on_its_broker_survives_the_broker_turning_replica(
    deployment: Deployment, scale: Scale
) -> None:
    # Given an idle worker, blocked in its wait (BLMOVE) on a broker that has a replica
    broker, other = deployment.broker, _synced_replica_of(deployment.broker)
    try:
        worker = deployment.worker()
        wait_until(
            lambda: any(c.get("cmd") == "blmove" for c in broker.client().client_list()),
            timeout=30,
            message="the worker to wait in BLMOVE",
        )
        # When the broker turns replica (Redis answers the blocked wait with -UNBLOCKED)
        # and is made master again
        _failover(broker, other)
        try:
            wait_until(lambda: PAUSED in worker.log(), timeout=30, message="the worker to pause")
        except AssertionError:
            raise AssertionError(worker.log()[-6000:]) from None
        _failover(other, broker)
        # Then the worker lives on and takes the next requests
        load = generate_load(20, 50, random.Random(32))
        push(deployment.broker_client(), (r.envelope() for r in load))
        deployment.settle(load, timeout=120)
        assert worker.running(), worker.log()[-3000:]
        assert "consumer failed unexpectedly" not in worker.log()
    finally:
        other.cleanup()
