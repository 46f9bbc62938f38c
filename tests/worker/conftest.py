"""A real Celery worker on a private broker Redis, applying to a second private store Redis.

One worker serves a whole test module (starting one costs seconds); tests keep apart by
using their own session ids, and the store server is emptied before each test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from kombu.transport import redis as kombu_redis

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker import reserve
from checkpointq.worker.hooks import kombu as kombu_hooks
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.servers import RedisServer
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained

#: Worker settings for the end-to-end tests: quick retries, a small message limit.
WORKER_SETTINGS = TEST_WORKER_SETTINGS


@dataclass
class Deployment:
    """The broker and store servers, a running worker, and clients of each."""

    broker: RedisServer
    store: RedisServer
    worker: CeleryProcess
    settings: Settings

    def broker_client(self) -> redis.Redis:
        return self.broker.client()

    def store_client(self) -> redis.Redis:
        return self.store.client()

    def checkpoint_client(self) -> CheckpointClient:
        return CheckpointClient.from_settings(self.settings)

    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self.store_client(), KeySpace(self.settings.key_prefix))

    def wait_drained(self, timeout: float = 20.0) -> None:
        """Until the queue is empty and no message is held unacknowledged by the worker."""
        wait_redis_queue_drained(self.broker_client, timeout)


@pytest.fixture(scope="module")
def deployment_settings() -> dict[str, object]:
    """Settings a test module gives its worker and clients beside ``WORKER_SETTINGS``
    (override it in the module)."""
    return {}


@pytest.fixture(scope="module")
def deployment(
    broker_server: RedisServer, store_server: RedisServer, deployment_settings: dict[str, object]
) -> Iterator[Deployment]:
    values = {
        **WORKER_SETTINGS,
        **deployment_settings,
        "broker_url": broker_server.url,
        "store_url": store_server.url,
    }
    worker = CeleryProcess("worker", checkpointq_env(**values)).start()
    try:
        yield Deployment(broker_server, store_server, worker, Settings(**values))  # type: ignore[arg-type]
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


@pytest.fixture
def live(deployment: Deployment) -> Iterator[Deployment]:
    """The deployment with an empty store. The worker's log lines written during the test
    are printed after it: pytest shows them when the test fails."""
    if deployment.store.process is None:
        deployment.store.start()
    client = deployment.store_client()
    client.flushall()
    client.close()
    mark = len(deployment.worker.log())
    yield deployment
    print(f"--- worker log during the test ---\n{deployment.worker.log()[mark:]}")


@pytest.fixture
def guarded() -> Iterator[None]:
    """The worker's reader in kombu's Redis channels for this test, kombu's own after."""
    channel: Any = kombu_redis.Channel
    saved = channel._brpop_read, channel._brpop_start, channel.basic_consume, channel.codecs
    kombu_hooks.install()
    yield
    channel._brpop_read, channel._brpop_start, channel.basic_consume, channel.codecs = saved


@pytest.fixture
def broker(redis_client: redis.Redis) -> redis.Redis:
    """The private server, emptied, the script loaded, its command counters reset."""
    redis_client.script_load(reserve.source())
    redis_client.config_resetstat()
    return redis_client
