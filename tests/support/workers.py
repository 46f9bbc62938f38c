"""What the end-to-end suites (worker, ops, scale) share about the workers they run."""

from __future__ import annotations

from collections.abc import Callable

import redis

from tests.support.servers import wait_until

QUEUE = "checkpoints"

#: Settings of a test worker: quick retries, so that outages resolve within a test, a short
#: soft shutdown, and a small message limit, so that oversize messages are cheap to build.
TEST_WORKER_SETTINGS: dict[str, object] = {
    "queue": QUEUE,
    "concurrency": 2,
    "pool": "prefork",
    "retry_max": 40,
    "retry_backoff_seconds": 0.1,
    "retry_backoff_max_seconds": 0.5,
    "max_message_bytes": 64 * 1024,
    "shutdown_timeout_seconds": 2,
}


def wait_redis_queue_drained(
    connect: Callable[[], redis.Redis], timeout: float, queue: str = QUEUE
) -> None:
    """Until a Redis broker's queue is empty and no worker holds a message unacknowledged.

    An empty queue and an empty ``unacked`` hash are not enough on their own: kombu pops a
    message with BRPOP and records it in ``unacked`` in a second round trip, so for a moment
    after a BRPOP returns the message is in neither (a check at that moment passed before the
    worker had even seen it). The worker sends its next read only after that record is
    written, so a connection whose last command is a BRPOP that no longer blocks is a
    message in flight: drained also means no such connection.
    """
    client = connect()
    try:
        wait_until(
            lambda: (
                client.llen(queue) == 0
                and client.hlen("unacked") == 0
                and not _popped_in_flight(client)
            ),
            timeout=timeout,
            message="the worker to drain the queue",
        )
    finally:
        client.close()


def _popped_in_flight(client: redis.Redis) -> bool:
    """Whether a connection's BRPOP has returned and its reader has not sent the next read."""
    return any(
        entry.get("cmd") == "brpop" and "b" not in entry.get("flags", "")
        for entry in client.client_list()
    )
