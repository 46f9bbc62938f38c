"""Task signals reach a module loaded with ``checkpointq worker -I``, once per request.

The default worker coalesces single saves and deletes (worker/coalesce.py); a handler of
``task_prerun``, ``task_postrun`` and ``task_success`` must still see each request as one
task, with ``task.request`` naming it, whichever producer sent it (the Python client, or a
producer without Celery that LPUSHes the envelope itself, as the Go client writes it).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.messages import DELETE, SAVE, SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.observability.conftest import CHECKPOINTQ
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import go_style
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import QUEUE, TEST_WORKER_SETTINGS

pytestmark = pytest.mark.integration


class Recorded:
    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]


@pytest.fixture(scope="module")
def worker_with_recorder(
    broker_server: RedisServer, store_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, Recorded]]:
    log = tmp_path_factory.mktemp("signals") / "signals.jsonl"
    values = {
        **TEST_WORKER_SETTINGS,
        "broker_url": broker_server.url,
        "store_url": store_server.url,
    }
    env = checkpointq_env(**values) | {"CQ_SIGNAL_LOG": str(log)}
    worker = CeleryProcess(
        "worker",
        env,
        command=[CHECKPOINTQ, "worker", "-I", "tests.support.signal_recorder", "-n", "sig@%h"],
    ).start()
    try:
        yield Settings(**values), Recorded(log)  # type: ignore[arg-type]
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


def test_an_included_module_sees_each_coalesced_request_once(
    worker_with_recorder: tuple[Settings, Recorded], broker_server: RedisServer
) -> None:
    settings, recorded = worker_with_recorder
    # Given a default (coalescing) worker started with -I of a module recording signals
    ids: dict[str, str] = {}
    # When the Python client saves and deletes, and a raw producer LPUSHes saves and deletes
    with CheckpointClient.from_settings(settings) as client:
        for n in range(10):
            ids[client.save(make_checkpoint(f"py-{n}", version=1)).task_id] = SAVE_STAGED
        for n in range(5):
            ids[client.delete(f"py-{n}").task_id] = DELETE
    broker = broker_server.client()
    for n in range(10):
        message = go_style(SAVE, [checkpoint_to_wire(make_checkpoint(f"go-{n}"))], n + 1)
        ids[json.loads(message)["headers"]["id"]] = SAVE
        broker.lpush(QUEUE, message)
    for n in range(5):
        message = go_style(DELETE, [f"go-{n}"], 100 + n)
        ids[json.loads(message)["headers"]["id"]] = DELETE
        broker.lpush(QUEUE, message)

    def successes() -> set[str]:
        return {line["task_id"] for line in recorded.lines() if line["signal"] == "success"}

    wait_until(lambda: set(ids) <= successes(), timeout=30, message="a success per request")
    # Then each request had exactly one received, prerun, postrun and success, each naming
    # its own request, with the registered task as sender and its delivery info pushed
    lines = [line for line in recorded.lines() if line["task_id"] in ids]
    counts = Counter((line["signal"], line["task_id"]) for line in lines)
    for task_id in ids:
        for signal in ("received", "prerun", "postrun", "success"):
            assert counts[(signal, task_id)] == 1, (signal, task_id, ids[task_id])
    pool_side = [line for line in lines if line["signal"] != "received"]
    assert all(line["task"] == ids[line["task_id"]] for line in lines)
    assert all(line["request_id"] == line["task_id"] for line in pool_side)
    assert all(line["routing_key"] == QUEUE for line in pool_side)
    assert {line["state"] for line in lines if line["signal"] == "postrun"} == {"SUCCESS"}
