"""End-to-end drain rate of one worker (prefork, concurrency 2): applied saves of 20 KB
checkpoints per second, next to the same worker draining no-op tasks of the same payload.

    .venv/bin/python bench/worker_drain.py [--messages 2000] [--size 20000]

Starts private redis-servers (broker and store) and one worker. For each task it fills a
staging list with ready-made protocol 2 envelopes, RENAMEs it onto the queue in one step,
and times from the first message taken to the queue drained with nothing unacknowledged
(acks are late: a message is acknowledged only once its task has run).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from checkpointq.store.keys import KeySpace  # noqa: E402
from checkpointq.store.serde import checkpoint_to_wire  # noqa: E402
from tests.support.checkpoints import checkpoint_of_size  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402
from tests.worker.celery_processes import CeleryProcess, checkpointq_env  # noqa: E402
from tests.worker.envelopes import protocol2  # noqa: E402

QUEUE = "checkpoints"
STAGING = "bench-staging"
APPLY_BATCH = "checkpoint.apply_batch"


@contextmanager
def running_worker(
    broker: RedisServer, store: RedisServer, pool: str, concurrency: int
) -> Iterator[CeleryProcess]:
    """One worker of ``bench.noop_app`` (the real app plus ``checkpoint.noop``)."""
    env = checkpointq_env(
        broker_url=broker.url,
        store_url=store.url,
        queue=QUEUE,
        pool=pool,
        concurrency=concurrency,
        log_level="WARNING",
    )
    worker = CeleryProcess("worker", env, app="bench.noop_app")
    worker.start(ready="ready.")
    try:
        yield worker
    finally:
        worker.stop()


def release_and_time_drain(client: redis.Redis, messages: int) -> float:
    """Move the staged messages into the queue at once; seconds from the first one taken
    until the queue is empty with nothing left unacknowledged."""
    client.rename(STAGING, QUEUE)
    while client.llen(QUEUE) >= messages:
        time.sleep(0.001)
    start = time.perf_counter()
    while client.llen(QUEUE) or client.hlen("unacked"):
        time.sleep(0.005)
    return time.perf_counter() - start


def drain(
    broker: RedisServer, task: str, messages: int, size: int, tag: str, per_message: int = 1
) -> float:
    """Requests per second for ``messages`` messages of ``task``.

    With ``task`` ``checkpoint.apply_batch``, each message carries ``per_message`` saves and
    the rate counts saves, not messages.
    """
    client = broker.client()
    pipe = client.pipeline(transaction=False)
    payload_bytes = 0
    for i in range(messages):
        if task == APPLY_BATCH:
            items = [
                {
                    "op": "save",
                    "checkpoint": checkpoint_to_wire(checkpoint_of_size(f"{tag}-{i}-{n}", size)),
                    "seq": 1_000 + i,
                }
                for n in range(per_message)
            ]
            envelope = protocol2(task, [items], {}, queue=QUEUE)
        else:
            wire = checkpoint_to_wire(checkpoint_of_size(f"{tag}-{i}", size))
            envelope = protocol2(task, [wire], {"seq": 1_000 + i}, queue=QUEUE)
        payload_bytes += len(envelope)
        pipe.lpush(STAGING, envelope)
        if i % 200 == 199:
            pipe.execute()
    pipe.execute()
    elapsed = release_and_time_drain(client, messages)
    client.close()
    rate = messages * (per_message if task == APPLY_BATCH else 1) / elapsed
    print(
        f"{task:18} {messages} msgs, ~{payload_bytes // messages // 1024} KiB envelopes: "
        f"{elapsed:.2f}s, {rate:,.0f}/s",
        flush=True,
    )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--size", type=int, default=20_000, help="checkpoint JSON bytes")
    args = parser.parse_args()
    broker, store = RedisServer().start(), RedisServer().start()
    env = checkpointq_env(
        broker_url=broker.url, store_url=store.url, queue=QUEUE, pool="prefork", concurrency=2
    )
    worker = CeleryProcess("worker", env, app="bench.noop_app")
    try:
        worker.start(ready="ready.")
        noop = drain(broker, "checkpoint.noop", args.messages, args.size, "noop")
        save = drain(broker, "checkpoint.save", args.messages, args.size, "save")
        stored = store.client()
        keys = KeySpace()
        applied = sum(1 for i in range(args.messages) if stored.exists(keys.data(f"save-{i}")))
        print(f"applied saves found in the store: {applied}/{args.messages}")
        print(f"saves/s {save:,.0f}  no-op/s {noop:,.0f}  ratio save/no-op {save / noop:.2f}")
    finally:
        worker.stop()
        broker.cleanup()
        store.cleanup()


if __name__ == "__main__":
    main()
