"""``celery inspect`` and ``celery status`` answer a default worker; changing it does not.

Read-only inspection is on by default (worker/remote_control.py); the commands that change
a worker (shutdown, pool size, rate limits, enabling events) are refused with an error reply
unless CHECKPOINTQ_REMOTE_CONTROL=true.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from checkpointq.tasks.messages import SAVE, SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.remote_control import REFUSAL
from checkpointq.worker.settings import Settings
from tests.observability.conftest import CHECKPOINTQ
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained

pytestmark = pytest.mark.integration

NODE = "insp@localhost"


@pytest.fixture(scope="module")
def worker_env(broker_server: RedisServer, store_server: RedisServer) -> Iterator[dict[str, str]]:
    values = {
        **TEST_WORKER_SETTINGS,
        "broker_url": broker_server.url,
        "store_url": store_server.url,
    }
    env = checkpointq_env(**values)
    worker = CeleryProcess("worker", env, command=[CHECKPOINTQ, "worker", "-n", NODE]).start()
    try:
        yield env
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


def celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "checkpointq.worker.app", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_inspect_and_status_answer_a_default_worker(
    worker_env: dict[str, str], broker_server: RedisServer
) -> None:
    # Given a default worker that applied a few saves
    settings = Settings(broker_url=broker_server.url, store_url=worker_env["CHECKPOINTQ_STORE_URL"])
    with CheckpointClient.from_settings(settings) as client:
        for n in range(5):
            client.save(make_checkpoint(f"insp-{n}"))
    wait_redis_queue_drained(broker_server.client, timeout=20)
    # When a user runs celery inspect ping, stats, registered, active and celery status
    ping = celery(worker_env, "inspect", "ping", "--json", "-d", NODE)
    stats = celery(worker_env, "inspect", "stats", "--json", "-d", NODE)
    registered = celery(worker_env, "inspect", "registered", "--json", "-d", NODE)
    active = celery(worker_env, "inspect", "active", "--json", "-d", NODE)
    status = celery(worker_env, "status")
    # Then each answers for the worker
    assert json.loads(ping.stdout) == {NODE: {"ok": "pong"}}, ping.stderr
    assert json.loads(stats.stdout)[NODE]["total"][SAVE_STAGED] >= 5  # the client's saves
    assert {SAVE, SAVE_STAGED} <= set(json.loads(registered.stdout)[NODE])
    assert json.loads(active.stdout) == {NODE: []}
    assert status.returncode == 0 and NODE in status.stdout, status.stderr


def test_commands_that_change_the_worker_are_refused_by_default(
    worker_env: dict[str, str], broker_server: RedisServer
) -> None:
    # When a user asks the worker to enable events, change its pool, or shut down
    events = celery(worker_env, "control", "enable_events", "--json", "-d", NODE)
    grow = celery(worker_env, "control", "pool_grow", "1", "--json", "-d", NODE)
    shutdown = celery(worker_env, "control", "shutdown", "-d", NODE)
    # Then each gets the refusal, and the worker still answers
    for reply in (events, grow):
        # (celery control --json prints the list of replies)
        assert json.loads(reply.stdout) == [{NODE: {"error": REFUSAL}}], reply.stderr
    assert shutdown.returncode in (0, 1)
    wait_until(
        lambda: json.loads(celery(worker_env, "inspect", "ping", "--json", "-d", NODE).stdout),
        timeout=20,
        message="the worker to answer a ping after the refused shutdown",
    )
