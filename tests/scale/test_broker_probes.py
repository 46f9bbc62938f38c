"""``checkpointq health``, ``stats``/``top`` and the metrics gauges with a RabbitMQ and with a
Sentinel broker (``worker/ops/broker_probe.py``).

Each test runs once per broker: the module's own RabbitMQ vhost or Sentinel group, the
module's store Redis, real workers and the real CLI in subprocesses. Every test uses a
queue of its own, so that none depends on what another left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.scale.conftest import WORKER_SETTINGS
from tests.support.celery_processes import REPO, CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.metrics import scrape, value
from tests.support.rabbitmq import RabbitVhost
from tests.support.sentinel import MASTER_NAME, SentinelGroup
from tests.support.servers import RedisServer, free_port, wait_until

pytestmark = pytest.mark.integration

#: In every URL the tests hand over: it must never be printed.
PASSWORD = "pr0be-s3cret"


@dataclass(frozen=True)
class Broker:
    """One broker under test: the settings that reach it, and the changes to them that
    reach nothing of the same kind (with passwords)."""

    kind: str
    values: dict[str, object]
    unreachable: dict[str, object]
    #: Whether the broker can tell the oldest queued request's age (not RabbitMQ).
    shows_oldest: bool

    def settings(self, **more: object) -> dict[str, object]:
        """Worker and CLI settings on this broker, a fresh queue, quick heartbeats."""
        queue = f"probe-{uuid.uuid4().hex[:8]}"
        return {
            **WORKER_SETTINGS,
            "concurrency": 1,
            "heartbeat_seconds": 0.5,
            **self.values,
            "queue": queue,
            **more,
        }


@pytest.fixture(scope="module", params=["rabbitmq", "sentinel"])
def broker(request: pytest.FixtureRequest, store_server: RedisServer) -> Broker:
    dead = free_port()
    if request.param == "rabbitmq":
        vhost: RabbitVhost = request.getfixturevalue("rabbit_vhost")
        return Broker(
            "rabbitmq",
            {"broker_url": vhost.url, "store_url": store_server.url},
            {"broker_url": f"amqp://guest:{PASSWORD}@127.0.0.1:{dead}/{vhost.name}"},
            shows_oldest=False,
        )
    group: SentinelGroup = request.getfixturevalue("sentinel_group")
    return Broker(
        "sentinel",
        {
            "broker_url": group.broker_url,
            "sentinel_master": MASTER_NAME,
            "store_url": store_server.url,
        },
        {
            "broker_url": ";".join([f"sentinel://:{PASSWORD}@127.0.0.1:{dead}/0"] * 2),
            "sentinel_password": PASSWORD,
        },
        shows_oldest=True,
    )


@pytest.fixture
def workers(store_client: redis.Redis) -> Iterator[list[CeleryProcess]]:
    """Workers a test starts (against the emptied store); stopped, logs printed, after."""
    started: list[CeleryProcess] = []
    yield started
    for process in started:
        code = process.stop()
        print(f"--- worker (exit {code}) ---\n{process.log()}")


def start_worker(workers: list[CeleryProcess], values: dict[str, object], *args: str) -> None:
    process = CeleryProcess("worker", checkpointq_env(**values), extra_args=list(args))
    workers.append(process)
    process.start(timeout=60)


def cli(values: dict[str, object], *args: str) -> subprocess.CompletedProcess[str]:
    """``checkpointq <args>`` in a subprocess with these settings."""
    return subprocess.run(
        [sys.executable, "-m", "checkpointq.worker.cli", *args],
        cwd=REPO,
        env=checkpointq_env(**values),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_health_passes_with_a_worker_and_fails_in_one_line_without_the_broker(
    broker: Broker, workers: list[CeleryProcess]
) -> None:
    # Given a worker on the broker, serving /metrics
    port = free_port()
    values = broker.settings(metrics_port=port)
    start_worker(workers, values)
    # Then health passes: broker, store and the worker's heartbeat
    wait_until(lambda: cli(values, "health").returncode == 0, timeout=30, message="health")
    report = json.loads(cli(values, "health", "--json").stdout)
    assert report["ok"] is True and report["checks"]["broker"]["ok"] is True
    # and the worker's scrape reads the broker
    samples = scrape(port)
    assert value(samples, "checkpointq_redis_up", role="broker") == 1
    assert value(samples, "checkpointq_queue_depth", queue=str(values["queue"])) == 0

    # When the broker cannot be reached (same kind of URL, nothing listening)
    result = cli({**values, **broker.unreachable}, "health")
    # Then health fails with one line naming the broker, and no password
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("checkpointq: unhealthy: broker: ")
    assert "unreachable" in lines[0]
    assert "store" not in lines[0] and "worker" not in lines[0]  # those are fine
    assert PASSWORD not in result.stdout + result.stderr
    # and stats fails the same way, without a traceback
    stats = cli({**values, **broker.unreachable}, "stats")
    assert stats.returncode == 1 and "Traceback" not in stats.stderr
    assert len(stats.stderr.strip().splitlines()) == 1
    assert PASSWORD not in stats.stdout + stats.stderr


def test_stats_top_and_the_metrics_gauge_count_what_waits_in_the_queue(
    broker: Broker, workers: list[CeleryProcess]
) -> None:
    # Given requests queued while no worker consumes the queue
    port = free_port()
    values = broker.settings(metrics_port=port)
    queue = str(values["queue"])
    queued = 7
    with CheckpointClient.from_settings(Settings(**values)) as client:  # type: ignore[arg-type]
        for i in range(queued):
            client.save(make_checkpoint(f"probe-{broker.kind}-{i}"))

    # Then stats reports them all
    def depth() -> int:
        done = cli(values, "stats", "--json")
        assert done.returncode == 0, done.stderr
        return int(json.loads(done.stdout)["queue_depth"])

    wait_until(lambda: depth() == queued, timeout=20, message="stats to count the queue")
    stats = json.loads(cli(values, "stats", "--json").stdout)
    # with the oldest request's age where the broker can show it, and "unknown" otherwise
    if broker.shows_oldest:
        assert stats["oldest_queued_known"] is True
        assert stats["oldest_queued_seconds"] is not None
    else:
        assert stats["oldest_queued_known"] is False
        assert stats["oldest_queued_seconds"] is None
        assert "oldest_queued          unknown" in cli(values, "stats").stdout
    # and top draws its screen with them
    top = cli(values, "top", "--once")
    assert top.returncode == 0 and "Traceback" not in top.stderr, top
    (line,) = [line for line in top.stdout.splitlines() if line.startswith("queue depth")]
    assert line.split("queue depth")[1].split()[0] == str(queued)
    assert ("unknown" in top.stdout) is not broker.shows_oldest

    # When a worker with a metrics port starts, consuming another queue (so the requests
    # stay where they are while it is scraped)
    start_worker(workers, values, "-Q", f"{queue}-elsewhere")
    # Then its scrape reports the same depth, and the broker up
    samples = scrape(port)
    assert value(samples, "checkpointq_queue_depth", queue=queue) == queued
    assert value(samples, "checkpointq_redis_up", role="broker") == 1
    assert value(samples, "checkpointq_redis_up", role="store") == 1
