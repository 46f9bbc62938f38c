"""``checkpointq health`` against real servers and a real worker: exit 0 only when all is up."""

from __future__ import annotations

import json

from tests.ops.conftest import System
from tests.support.celery_processes import CeleryProcess
from tests.support.servers import RedisServer, wait_until


def _one_line_failure(system: System, *args: str) -> str:
    result = system.cli("health", *args)
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _healthy(system: System) -> bool:
    return system.cli("health").returncode == 0


def test_health_fails_without_a_worker_and_passes_once_one_runs(system: System) -> None:
    # Given a broker and a store but no worker, health fails and says why on one line
    line = _one_line_failure(system)
    assert "worker" in line and "no worker heartbeat" in line
    assert "broker" not in line and "store" not in line  # those are fine

    # When a worker starts, health passes (the worker's first heartbeat)
    system.start_worker()
    wait_until(lambda: _healthy(system), timeout=30, message="health to pass")
    report = json.loads(system.cli("health", "--json", "--local").stdout)
    assert report["ok"] is True
    # ("one store": the workers announced this configuration's store as theirs)
    assert set(report["checks"]) == {"broker", "store", "worker", "one store"}
    assert all(check["ok"] for check in report["checks"].values())

    # When the worker stops, health fails again at once (its heartbeat is removed)
    system.stop_worker()
    assert "no worker heartbeat" in _one_line_failure(system)


def test_health_fails_while_the_broker_is_down_and_recovers_with_it(system: System) -> None:
    # Given a healthy system
    system.start_worker()
    wait_until(lambda: _healthy(system), timeout=30, message="health to pass")

    # When the broker goes down, health fails, naming the broker
    system.broker.stop()
    line = _one_line_failure(system)
    assert line.startswith("checkpointq: unhealthy: broker: redis://127.0.0.1:")
    report = json.loads(system.cli("health", "--json").stdout)
    assert report["ok"] is False and report["checks"]["broker"]["ok"] is False

    # When it comes back, the worker reconnects and health passes again
    system.broker.start()
    wait_until(lambda: _healthy(system), timeout=60, message="health to pass again")


def test_health_fails_while_the_store_is_down(system: System) -> None:
    # Given a healthy system
    system.start_worker()
    wait_until(lambda: _healthy(system), timeout=30, message="health to pass")

    # When the store goes down, health fails, naming the store (workers cannot be seen)
    system.store.stop()
    line = _one_line_failure(system)
    assert "store: redis://127.0.0.1:" in line and "unreachable" in line
    report = json.loads(system.cli("health", "--json").stdout)
    assert report["checks"]["store"]["ok"] is False
    assert report["checks"]["worker"]["ok"] is False

    # When it comes back, health passes again
    system.store.start()
    wait_until(lambda: _healthy(system), timeout=60, message="health to pass again")


def test_health_never_prints_a_password(system: System) -> None:
    # Given a broker that wants a password, and a URL holding a wrong one
    guarded = RedisServer(password="s3cret-right").start()
    try:
        system.values["broker_url"] = guarded.url.replace("s3cret-right", "s3cret-wrong")
        # When health runs, it fails on the broker without printing either password
        result = system.cli("health")
        shown = result.stdout + result.stderr
        assert result.returncode == 1
        assert "s3cret" not in shown
        assert "broker: redis://:***@127.0.0.1" in shown
    finally:
        guarded.cleanup()


def test_health_beat_checks_the_sweep_schedule(system: System) -> None:
    # Given no beat has ever run, the beat check fails on one line
    assert "no sweep scheduled" in _one_line_failure(system, "--beat")

    # When beat runs, its schedule in Redis makes the check pass
    beat = CeleryProcess("beat", system.env()).start()
    try:
        wait_until(
            lambda: system.cli("health", "--beat").returncode == 0,
            timeout=30,
            message="health --beat to pass",
        )
        report = json.loads(system.cli("health", "--beat", "--json").stdout)
        assert set(report["checks"]) == {"broker", "store", "beat"}
        assert report["checks"]["beat"]["detail"].startswith("next sweep in ")
    finally:
        beat.stop()
