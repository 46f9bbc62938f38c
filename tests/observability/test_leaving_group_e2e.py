"""A request that leaves its group shows monitors what a coalescing-off worker shows.

The coalescer announces a request (``task_received``, ``task-received``) when it joins a
group, and starts it only once the group applied it. A request the group cannot apply (a
value the store refuses, arguments that do not parse, a store outage) runs as the single
task it is, which must not be received twice: each request shows one received, one
started and one outcome per attempt, and a handler one prerun and one postrun per attempt,
exactly as on a worker that runs one task per message. Both workers run the same
Go-style messages (raw ``LPUSH``), so the second parameter is the reference.
"""

from __future__ import annotations

import base64
import json
import random
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.messages import DELETE, SAVE
from checkpointq.worker.group_events import REPR_MAX
from checkpointq.worker.settings import Settings
from tests.observability.conftest import CHECKPOINTQ
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.servers import RedisServer, wait_until
from tests.support.task_events import TaskEvents
from tests.support.workers import QUEUE, TEST_WORKER_SETTINGS

pytestmark = pytest.mark.integration

#: Seconds the outage's saves are held (their ETA): the worker takes them meanwhile.
OUTAGE_ETA_SECONDS = 8
#: The smallest stored-value budget the worker takes: a save of 3 KB of noise is refused.
MAX_VALUE_BYTES = 1024


@pytest.fixture(params=["coalescing", "one-task-per-message"])
def worker(
    request: pytest.FixtureRequest,
    broker_server: RedisServer,
    store_server: RedisServer,
    tmp_path: Path,
) -> Iterator[tuple[Settings, Path]]:
    """A worker with task events on (-E) and the signal recorder loaded (-I)."""
    log = tmp_path / "signals.jsonl"
    values = {
        **TEST_WORKER_SETTINGS,
        "broker_url": broker_server.url,
        "store_url": store_server.url,
        "max_value_bytes": MAX_VALUE_BYTES,
    }
    if request.param != "coalescing":
        values["coalesce_max_items"] = 0
    env = checkpointq_env(**values) | {"CQ_SIGNAL_LOG": str(log)}
    command = [CHECKPOINTQ, "worker", "-E", "-I", "tests.support.signal_recorder", "-n", "lg@%h"]
    process = CeleryProcess("worker", env, command=command).start()
    try:
        yield Settings(**values), log  # type: ignore[arg-type]
    finally:
        if store_server.process is None:
            store_server.start()
        code = process.stop()
        print(f"--- worker log (exit {code}) ---\n{process.log()}")


def _push(broker: Any, messages: list[str]) -> list[str]:
    """LPUSH the messages in one command (one read, one group); their task ids."""
    broker.lpush(QUEUE, *messages)
    return [json.loads(message)["headers"]["id"] for message in messages]


def _save(
    session_id: str,
    seq: int,
    *,
    content_size: int = 16,
    extra: bool = False,
    eta: str | None = None,
) -> str:
    wire = checkpoint_to_wire(make_checkpoint(session_id, content_size=content_size))
    if content_size > 16:
        noise = base64.b64encode(random.Random(seq).randbytes(content_size)).decode()
        wire["conversationHistory"][0]["content"] = noise
    return protocol2(
        SAVE, [wire, seq, "extra"] if extra else [wire], None if extra else {"seq": seq}, eta=eta
    )


def _signals(log: Path, task_id: str) -> Counter[str]:
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Counter(line["signal"] for line in lines if line["task_id"] == task_id)


def _postrun_states(log: Path, task_id: str) -> list[str]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [
        line["state"]
        for line in lines
        if line["task_id"] == task_id and line["signal"] == "postrun"
    ]


def test_each_request_is_received_started_and_ended_once_per_attempt(
    worker: tuple[Settings, Path], broker_server: RedisServer, store_server: RedisServer
) -> None:
    settings, log = worker
    broker = broker_server.client()
    with TaskEvents(settings) as events:
        events.listening(lambda: _push(broker, [_save("lg-warm-up", 1)])[0])
        # Given requests that apply, values the store refuses, arguments that do not parse,
        # all in one LPUSH (so, on the coalescing worker, in one group)
        applied = _push(
            broker,
            [_save(f"lg-ok-{n}", 1) for n in range(4)]
            + [protocol2(DELETE, [f"lg-gone-{n}"], {"seq": 1}) for n in range(2)],
        )
        refused = _push(broker, [_save(f"lg-big-{n}", 1, content_size=3000) for n in range(2)])
        unparsed = _push(broker, [_save("lg-args", 1, extra=True)])
        once = applied + refused + unparsed

        def ended(ids: list[str]) -> bool:
            return all("succeeded" in events.types(i) for i in ids)

        wait_until(lambda: ended(once), timeout=60, message="every request to succeed")
        # Then each shows received, started, succeeded once (a refused one is dead-lettered,
        # which Celery sees as a success), with one received, prerun, success and postrun
        for task_id in once:
            assert events.types(task_id) == ["received", "started", "succeeded"], task_id
            wait_until(lambda i=task_id: _signals(log, i)["postrun"] == 1, timeout=20)
            assert _signals(log, task_id) == Counter(received=1, prerun=1, success=1, postrun=1), (
                task_id
            )
        received = {i: events.by_task()[i][0] for i in once}
        assert {e["name"] for e in received.values()} == {SAVE, DELETE}
        assert all(
            len(e["args"]) <= REPR_MAX and e["hostname"].startswith("lg@")
            for e in received.values()
        )

        # When the store goes away while three saves are in the worker's hands, and comes
        # back once each was retried at least once. (They are held until an ETA, and the
        # store stops once the worker took them: a worker that notices the outage first
        # stops taking messages, and a save it never took is never tried, let alone retried.)
        eta = (datetime.now(UTC) + timedelta(seconds=OUTAGE_ETA_SECONDS)).isoformat()
        outage = _push(broker, [_save(f"lg-outage-{n}", 1, eta=eta) for n in range(3)])
        wait_until(
            lambda: all("received" in events.types(i) for i in outage),
            timeout=OUTAGE_ETA_SECONDS,
            message="the worker to take the three saves before their ETA",
        )
        store_server.stop()
        try:
            wait_until(
                lambda: all("retried" in events.types(i) for i in outage),
                timeout=60,
                message="each save to be retried",
            )
        finally:
            store_server.start()
        wait_until(lambda: ended(outage), timeout=60, message="the retried saves to succeed")
    # Then each attempt shows received and started, each retry retried (and sent: Celery's
    # retry publishes it again), the last attempt succeeded; a handler sees one prerun and
    # one postrun per attempt, a retry per retried attempt
    for task_id in outage:
        types = events.types(task_id)
        tries = types.count("started")
        assert tries >= 2, (task_id, types)
        assert Counter(types) == Counter(
            received=tries, started=tries, retried=tries - 1, sent=tries - 1, succeeded=1
        ), (task_id, types)
        wait_until(lambda i=task_id, n=tries: _signals(log, i)["postrun"] == n, timeout=20)
        assert _signals(log, task_id) == Counter(
            received=tries, prerun=tries, retry=tries - 1, success=1, postrun=tries
        ), (task_id, types)
        assert _postrun_states(log, task_id) == ["RETRY"] * (tries - 1) + ["SUCCESS"]
