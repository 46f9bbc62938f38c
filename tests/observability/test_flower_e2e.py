"""Flower 2.2 lists every request a default (coalescing) worker applied, as SUCCESS.

Flower builds its task list from Celery's task events; the worker sends them per request of
a coalesced group (worker/group_events.py) once events are on (``-E``). Flower runs as
docs/operations.md says, ``celery -A checkpointq.worker.app flower``, with the broker URL spelled as
``checkpointq up`` prints it: ``redis://`` or the embedded Redis's ``unix://`` (which
``celery --broker`` alone does not know).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.observability.conftest import CHECKPOINTQ
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, free_port, wait_until
from tests.support.workers import TEST_WORKER_SETTINGS

pytestmark = pytest.mark.integration

#: The Flower command of docs/operations.md.
FLOWER = [sys.executable, "-m", "celery", "-A", "checkpointq.worker.app", "flower"]


@pytest.fixture(scope="module", params=["redis", "unix"])
def broker_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A broker Redis, and its URL in the spelling ``up`` prints for it."""
    socket = Path(tempfile.mkdtemp(prefix="cq-sock-")) / "redis.sock"
    server = RedisServer(extra_args=["--unixsocket", str(socket)]).start()
    try:
        yield server.url if request.param == "redis" else f"unix://{socket}"
    finally:
        server.cleanup()


def _flower_tasks(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks", timeout=5) as reply:
        tasks: dict[str, Any] = json.load(reply)
    return tasks


def test_flower_lists_every_save_as_succeeded(
    broker_url: str, store_server: RedisServer, tmp_path: Path
) -> None:
    # Given a default worker with task events on (-E), and Flower started as docs/operations.md says
    values = {**TEST_WORKER_SETTINGS, "broker_url": broker_url, "store_url": store_server.url}
    env = checkpointq_env(**values)
    worker = CeleryProcess("worker", env, command=[CHECKPOINTQ, "worker", "-E", "-n", "fl@%h"])
    port = free_port()
    flower_env = env | {"FLOWER_UNAUTHENTICATED_API": "true"}
    flower_log = tmp_path / "flower.log"
    with flower_log.open("wb") as out:
        flower = subprocess.Popen(
            [*FLOWER, "--address=127.0.0.1", f"--port={port}"],
            env=flower_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        worker.start()
        wait_until(lambda: _reachable(port), timeout=30, message="flower to listen")
        with CheckpointClient.from_settings(Settings(**values)) as client:  # type: ignore[arg-type]
            # Flower answers HTTP before its event receiver has bound its queue: events sent
            # before then are lost to it. A warm-up save per poll until Flower lists one.
            warm_up: set[str] = set()

            def listening() -> bool:
                if warm_up & set(_flower_tasks(port)):
                    return True
                warm_up.add(client.save(make_checkpoint("fl-warm-up")).task_id)
                return False

            wait_until(listening, timeout=30, interval=0.5, message="flower to receive events")
            # When 20 saves go through the Python client
            ids = {client.save(make_checkpoint(f"fl-{n}", version=1)).task_id for n in range(20)}

        # Then Flower lists each of them as SUCCESS, with its name, worker and runtime
        def succeeded() -> set[str]:
            tasks = _flower_tasks(port)
            return {i for i in ids if (tasks.get(i) or {}).get("state") == "SUCCESS"}

        wait_until(lambda: succeeded() == ids, timeout=30, message="flower to show 20 saves")
        tasks = _flower_tasks(port)
        for task_id in ids:
            assert tasks[task_id]["name"] == "checkpoint.save_staged"  # the client's default
            assert tasks[task_id]["worker"].startswith("fl@")
            assert tasks[task_id]["runtime"] is not None and tasks[task_id]["runtime"] >= 0
            assert tasks[task_id]["received"] is not None and tasks[task_id]["started"]
            assert "fl-" in tasks[task_id]["args"]
    finally:
        flower.terminate()
        flower.wait(timeout=15)
        code = worker.stop()
        print(f"--- flower log ---\n{flower_log.read_text(errors='replace')}")
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


def _reachable(port: int) -> bool:
    try:
        _flower_tasks(port)
    except OSError:
        return False
    return True
