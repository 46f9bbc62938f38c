"""A live system for the operations tests: private broker and store Redis, a real prefork
worker (concurrency 2) with its metrics endpoint and quick heartbeats, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import redis

from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import REPO, CeleryProcess, checkpointq_env
from tests.support.metrics import Samples, scrape, value
from tests.support.servers import RedisServer, free_port
from tests.support.workers import QUEUE, TEST_WORKER_SETTINGS, wait_redis_queue_drained

#: Re-exported for the tests here, which import them from this module.
__all__ = ["QUEUE", "Samples", "System", "scrape", "value"]

#: Quick heartbeats (they live 3 intervals), and room for the truncation test's messages.
WORKER_SETTINGS: dict[str, object] = {
    **TEST_WORKER_SETTINGS,
    "heartbeat_seconds": 0.5,
    "max_message_bytes": 256 * 1024,
}


@dataclass
class System:
    """Broker, store, a worker with its metrics port, and the settings to reach them."""

    broker: RedisServer
    store: RedisServer
    settings: Settings
    values: dict[str, object]
    worker: CeleryProcess | None = None

    @property
    def metrics_port(self) -> int:
        port = self.settings.metrics_port
        assert port is not None
        return port

    def env(self) -> dict[str, str]:
        return checkpointq_env(**self.values)

    def start_worker(self) -> CeleryProcess:
        self.worker = CeleryProcess("worker", self.env()).start()
        return self.worker

    def stop_worker(self) -> None:
        if self.worker is not None:
            code = self.worker.stop()
            print(f"--- worker log (exit {code}) ---\n{self.worker.log()}")
            self.worker = None

    def close(self) -> None:
        """Stop the worker, then both servers, and remove their files."""
        self.stop_worker()
        self.broker.cleanup()
        self.store.cleanup()

    def client(self) -> CheckpointClient:
        return CheckpointClient.from_settings(self.settings)

    def broker_client(self) -> redis.Redis:
        return self.broker.client()

    def store_client(self) -> redis.Redis:
        return self.store.client()

    def wait_drained(self, timeout: float = 30.0) -> None:
        """Until the queue is empty and the worker holds no unacknowledged message."""
        wait_redis_queue_drained(self.broker_client, timeout)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``checkpointq <args>`` in a subprocess with this system's settings."""
        return subprocess.run(
            [sys.executable, "-m", "checkpointq.worker.cli", *args],
            cwd=REPO,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def start_system(redis_args: Sequence[str] = ()) -> System:
    """Fresh broker and store servers, each started with ``redis_args``; no worker yet."""
    broker = RedisServer(extra_args=list(redis_args)).start()
    store = RedisServer(extra_args=list(redis_args)).start()
    values = {
        **WORKER_SETTINGS,
        "broker_url": broker.url,
        "store_url": store.url,
        "metrics_port": free_port(),
    }
    return System(broker, store, Settings(**values), values)  # type: ignore[arg-type]


@pytest.fixture
def system() -> Iterator[System]:
    """Fresh servers per test (tests stop them); the test starts the worker when it wants."""
    live = start_system()
    try:
        yield live
    finally:
        live.close()


@pytest.fixture
def cpu_hogs() -> Iterator[int]:
    """A busy loop on every core this process may run on, for the test's length: a loaded
    machine. Yields how many."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        yield len(hogs)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
