"""``checkpointq health`` when the store refuses writes, and when a worker is stuck."""

from __future__ import annotations

import json
import os
import signal

from checkpointq.store.keys import KeySpace
from tests.faults.harness import children, envelope, push
from tests.ops.conftest import System
from tests.support.servers import wait_until


def _health(system: System) -> tuple[int, str]:
    result = system.cli("health")
    return result.returncode, result.stderr.strip()


def test_health_and_stats_say_the_store_refuses_writes_not_no_worker(system: System) -> None:
    # Given a healthy system
    system.start_worker()
    wait_until(lambda: _health(system)[0] == 0, timeout=30, message="health to pass")
    # When the store runs out of memory (eviction off): it answers PING but refuses writes,
    # heartbeats included
    store = system.store_client()
    store.config_set("maxmemory-policy", "noeviction")
    store.config_set("maxmemory", 1024 * 1024)
    keys = KeySpace(system.settings.key_prefix)
    names = [name.decode() for name in store.smembers(keys.workers())]  # type: ignore[union-attr]
    assert names, "no worker heartbeat before the fault"
    wait_until(
        lambda: not any(store.exists(keys.heartbeat(name)) for name in names),
        timeout=30,
        message="the last heartbeat to expire",
    )
    # Then health fails naming the reason plainly, and does not blame the worker
    code, line = _health(system)
    assert code == 1
    assert "store: redis://127.0.0.1:" in line and "refusing writes: out of memory" in line
    assert "no worker heartbeat" not in line
    assert "the store refuses writes" in line
    report = json.loads(system.cli("health", "--json").stdout)
    assert report["checks"]["store"]["ok"] is False
    # And stats (what top draws) says the store refuses writes, and why
    stats = system.cli("stats")
    assert stats.returncode == 0, stats.stderr
    assert "store_writes           REFUSED: out of memory" in stats.stdout
    snapshot = json.loads(system.cli("stats", "--json").stdout)
    assert snapshot["store_refusing_writes"].startswith("out of memory")
    # When an operator raises the limit, health passes again (the worker never stopped)
    store.config_set("maxmemory", 0)
    wait_until(lambda: _health(system)[0] == 0, timeout=30, message="health to pass again")
    assert "store_writes           accepted" in system.cli("stats").stdout
    assert json.loads(system.cli("stats", "--json").stdout)["store_refusing_writes"] is None


def test_health_says_the_worker_is_paused_while_the_broker_refuses_writes(
    system: System,
) -> None:
    # Given a healthy system
    worker = system.start_worker()
    wait_until(lambda: _health(system)[0] == 0, timeout=30, message="health to pass")
    # When the broker runs out of memory (eviction off): it answers PING, refuses writes
    broker = system.broker_client()
    broker.config_set("maxmemory-policy", "noeviction")
    broker.config_set("maxmemory", 1024 * 1024)
    # Then health fails saying so, and the worker pauses rather than exits
    code, line = _health(system)
    assert code == 1
    assert "paused: broker refusing writes (out of memory" in line, line
    wait_until(lambda: "broker refusing writes" in worker.log(), timeout=30, message="the pause")
    # When an operator raises the limit, the worker resumes by itself and health passes
    broker.config_set("maxmemory", 0)
    wait_until(lambda: _health(system)[0] == 0, timeout=30, message="health to pass again")
    wait_until(
        lambda: "broker accepts writes again" in worker.log(), timeout=30, message="resuming"
    )
    assert worker.process is not None and worker.process.poll() is None


def test_health_notices_a_worker_that_holds_messages_but_finishes_none(system: System) -> None:
    # Given a healthy worker whose pool processes then hang (SIGSTOP: alive, doing nothing)
    worker = system.start_worker()
    wait_until(lambda: _health(system)[0] == 0, timeout=30, message="health to pass")
    assert worker.process is not None
    pool = children(worker.process.pid)
    assert pool, "no pool processes"
    for pid in pool:
        os.kill(pid, signal.SIGSTOP)
    try:
        # When messages arrive, the worker takes some (its heartbeat goes on: the main
        # process is fine) but finishes none
        push(
            system.broker_client(),
            [envelope("checkpoint.refresh", [f"stuck-{i}"], {}) for i in range(10)],
        )
        # Then health fails, saying the worker holds messages and makes no progress
        wait_until(
            lambda: "finished none" in _health(system)[1],
            timeout=60,
            message="health to notice the stuck worker",
        )
        code, line = _health(system)
        assert code == 1 and "holds" in line and "message(s)" in line
    finally:
        for pid in pool:
            os.kill(pid, signal.SIGCONT)
    # And once the pool runs again, health passes
    wait_until(lambda: _health(system)[0] == 0, timeout=60, message="health to pass again")
