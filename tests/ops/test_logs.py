"""Worker log lines in JSON: one object per line, the request's fields, no passwords."""

from __future__ import annotations

import json
import logging
import sys

from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.logs import JsonFormatter
from tests.ops.conftest import System
from tests.support.celery_processes import CeleryProcess
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until


def test_a_json_line_redacts_urls_and_keeps_a_traceback_on_its_line() -> None:
    record = logging.LogRecord(
        "x", logging.ERROR, __file__, 1, "cannot reach %s", ("redis://:hunter2@db:6379/0",), None
    )
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)

    assert "\n" not in line and "hunter2" not in line
    data = json.loads(line)
    assert data["message"] == "cannot reach redis://:***@db:6379/0"
    assert "ValueError: boom" in data["exc"]


def test_a_worker_logs_each_request_as_one_json_line_at_debug(system: System) -> None:
    # Given a worker whose broker needs a password, logging JSON at DEBUG
    guarded = RedisServer(password="hunter2-broker").start()
    try:
        system.values.update(broker_url=guarded.url, log_format="json")
        worker = CeleryProcess("worker", system.env(), extra_args=["-l", "DEBUG"]).start()
        system.worker = worker
        settings = system.settings.model_copy(update={"broker_url": guarded.url})
        # When a save is applied
        with CheckpointClient.from_settings(settings) as client:
            handle = client.save(make_checkpoint("logged"))
            client.wait_durable(handle, timeout=30)

        # Then one JSON line tells its outcome with the session, seq and task id
        def request_lines() -> list[dict[str, object]]:
            lines = [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]
            return [line for line in lines if line.get("event") == "request"]

        wait_until(lambda: request_lines(), timeout=10, message="the request's log line")
        (line,) = request_lines()
        assert line["session_id"] == "logged"
        assert line["seq"] == handle.seq
        assert line["outcome"] == "applied"
        assert line["task_id"] == handle.task_id
        assert line["level"] == "DEBUG"
        # And the password appears nowhere in the worker's output
        assert "hunter2" not in worker.log()
    finally:
        system.stop_worker()
        guarded.cleanup()
