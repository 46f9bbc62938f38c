"""A warm shutdown reads the prefork pool's results until its processes exit
(``worker/hooks/celery.py``), so that one blocked writing a result the pool forgot cannot
hold the worker for good."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.concurrency import asynpool
from kombu.asynchronous import Hub

from checkpointq.worker.hooks import celery as celery_hooks

# kombu's hints are partial (untyped functions): its event loop is used as Any here.
EventLoop: Any = Hub

#: A result larger than a pipe holds (64 KiB on Linux): its process blocks writing it until
#: the main process reads.
LARGE_RESULT_BYTES = 200_000
#: Seconds the pool's join gets; with the drain it takes well under one.
JOIN_LIMIT = 10.0


def large_result() -> bytes:
    return b"x" * LARGE_RESULT_BYTES


@pytest.fixture
def pool() -> Iterator[tuple[Any, Any]]:
    """A one-process prefork pool on an event loop of its own, started."""
    hub = EventLoop()
    started: Any = asynpool.AsynPool(processes=1, threads=False, synack=False)
    started.register_with_event_loop(hub)
    loop = hub.create_loop()
    deadline = time.monotonic() + 30
    while not started.did_start_ok():
        assert time.monotonic() < deadline, "the pool process did not start"
        next(loop)
    yield started, hub
    # A failed test leaves the process blocked writing and the join waiting on it: end it.
    for process in started._pool:  # billiard's list of the pool's processes
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
    started.terminate()
    hub.close()


def test_a_warm_stop_reads_the_result_of_a_job_the_pools_flush_forgot(
    pool: tuple[Any, Any],
) -> None:
    # Given the drain, and a job written to the pool's process that the main process has
    # not yet seen it take (what Celery's consumer flushes on a warm stop)
    assert celery_hooks.drain_pool_at_shutdown()
    started, hub = pool
    loop = hub.create_loop()
    job = started.apply_async(large_result)
    while job._write_to is None:  # billiard's: the process the job was written to
        next(loop)
    assert not job.accepted()
    # When the consumer's close flushes the pool (it forgets the job) and the pool stops
    started.flush()
    started.close()
    joiner = threading.Thread(target=started.join, daemon=True)
    joiner.start()
    joiner.join(JOIN_LIMIT)
    # Then the process wrote its large result, exited, and the join returned
    assert not joiner.is_alive(), "the pool's join waits on a process blocked writing"


def test_the_drain_stays_celerys_where_the_result_handler_lacks_what_it_calls(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a Celery whose prefork result handler has no _flush_outqueue
    class Handler:
        def on_stop_not_started(self) -> None:
            pass

    monkeypatch.setattr(asynpool, "ResultHandler", Handler)
    # When the drain is asked to go in
    with caplog.at_level(logging.WARNING, logger=celery_hooks.__name__):
        installed = celery_hooks.drain_pool_at_shutdown()
    # Then it does not, says why, and Celery's own drain stays
    assert not installed
    assert "its prefork result handler has no _flush_outqueue" in caplog.text
    assert Handler.on_stop_not_started.__module__ == __name__
