"""Sentry's Celery integration reports a request that fails on a default worker.

The worker loads Sentry with ``-I`` (tests/support/sentry_worker.py: ``sentry_sdk.init``
with its default integrations and a transport that writes events to a file) and a bug:
saving a ``sentry-bug`` session raises. Such a save fails in its group's round trip, leaves
the group for the single-task path, fails there too, is logged as an unexpected failure and
dead-lettered. Sentry must report it once, as a failure of that Celery task, and nothing for
the requests of its group that succeeded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpointq.tasks.errors import RequestRefused
from checkpointq.tasks.messages import SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.observability.conftest import CHECKPOINTQ
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sentry_reports_a_failing_request_as_its_celery_task(
    worker_values: dict[str, object], tmp_path: Path
) -> None:
    log = tmp_path / "sentry.jsonl"
    env = checkpointq_env(**worker_values) | {"CQ_SENTRY_LOG": str(log)}
    # Given a default (coalescing) worker with Sentry loaded by -I
    worker = CeleryProcess(
        "worker", env, command=[CHECKPOINTQ, "worker", "-I", "tests.support.sentry_worker"]
    ).start()
    try:
        with CheckpointClient.from_settings(Settings(**worker_values)) as client:  # type: ignore[arg-type]
            # When one save among good ones fails with a bug
            good = [client.save(make_checkpoint(f"sentry-ok-{n}")) for n in range(3)]
            bad = client.save(make_checkpoint("sentry-bug-1"))
            good += [client.save(make_checkpoint(f"sentry-ok-{n}")) for n in range(3, 6)]
            # Then it is dead-lettered (kept, with the reason), the others applied
            with pytest.raises(RequestRefused) as refused:
                client.wait_durable(bad, timeout=60)
            assert "InjectedBug" in str(refused.value)
            for handle in good:
                client.wait_durable(handle, timeout=60)

        # and Sentry reports it once, as an error of its task (checkpoint.save_staged) and id
        def reported() -> list[dict[str, Any]]:
            return [e for e in _events(log) if e.get("tags", {}).get("celery_task_id")]

        wait_until(lambda: reported(), timeout=30, message="a Sentry event for the failure")
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")
    events = reported()
    assert [e["tags"]["celery_task_id"] for e in events] == [bad.task_id]
    (event,) = events
    assert event["level"] == "error"
    assert event["extra"]["celery-job"]["task_name"] == SAVE_STAGED  # the client's save
    values = [v.get("value", "") for v in event["exception"]["values"]]
    assert any("a bug while saving sentry-bug-1" in value for value in values), values
    everything = log.read_text()
    assert not [h.task_id for h in good if h.task_id in everything]
