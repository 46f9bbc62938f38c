"""How the drain rate grows with workers, and what each broker costs a producer.

    .venv/bin/python bench/worker_scaling.py [--messages 3000] [--size 2000] [--workers 1,2,4]
    .venv/bin/python bench/worker_scaling.py --publish-only   # producer side only

Drain: private redis-servers (broker and store) and N workers of one process each
(``--concurrency``). The queue is filled with ready-made protocol 2 save envelopes in a
staging list and RENAMEd onto the queue in one step; the time runs from the first message
taken to the queue drained with nothing unacknowledged. Every save is checked in the store.

Publish: ``CheckpointClient.save`` calls per second from one thread, on a Redis broker
(the fast LPUSH path) and, when RabbitMQ answers on 127.0.0.1:5672, on a RabbitMQ vhost of
our own (Celery's publisher with confirms), deleted afterwards.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import worker_drain  # noqa: E402
from bench.worker_drain import QUEUE  # noqa: E402
from checkpointq.store.keys import KeySpace  # noqa: E402
from checkpointq.tasks.producer.client import CheckpointClient  # noqa: E402
from checkpointq.worker.settings import Settings  # noqa: E402
from tests.support.celery_processes import CeleryProcess, checkpointq_env  # noqa: E402
from tests.support.checkpoints import checkpoint_of_size  # noqa: E402
from tests.support.rabbitmq import RabbitVhost, rabbitmq_available  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402


def drain_rate(workers: int, concurrency: int, messages: int, size: int) -> tuple[float, int]:
    """Saves per second drained by ``workers`` workers, and how many reached the store."""
    broker, store = RedisServer().start(), RedisServer().start()
    env = checkpointq_env(
        broker_url=broker.url, store_url=store.url, queue=QUEUE, concurrency=concurrency
    )
    fleet = [CeleryProcess("worker", env) for _ in range(workers)]
    try:
        for worker in fleet:
            worker.start(timeout=60)
        client = broker.client()
        staged = worker_drain.stage(client, "bench-saves", messages, size, "s")
        elapsed = staged.release_and_time_drain(client)
        client.close()
        stored = store.client()
        keys = KeySpace()
        pipe = stored.pipeline(transaction=False)
        for i in range(messages):
            pipe.exists(keys.data(f"s-{i}"))
        applied = sum(pipe.execute())
        stored.close()
        return messages / elapsed, applied
    finally:
        for worker in fleet:
            worker.stop()
        broker.cleanup()
        store.cleanup()


def publish_rate(broker_url: str, store_url: str, count: int, size: int) -> float:
    settings = Settings(broker_url=broker_url, store_url=store_url, queue=QUEUE)
    checkpoints = [checkpoint_of_size(f"p-{i}", size) for i in range(count)]
    with CheckpointClient.from_settings(settings) as client:
        client.save(checkpoints[0])  # connect outside the timing
        start = time.perf_counter()
        for cp in checkpoints[1:]:
            client.save(cp)
        return (count - 1) / (time.perf_counter() - start)


def publish_section(count: int, size: int) -> None:
    broker, store = RedisServer().start(), RedisServer().start()
    try:
        rate = publish_rate(broker.url, store.url, count, size)
        print(f"| Redis (LPUSH fast path) | {rate:,.0f} |", flush=True)
        if rabbitmq_available():
            vhost = RabbitVhost().create()
            try:
                rate = publish_rate(vhost.url, store.url, count, size)
                print(f"| RabbitMQ (confirms) | {rate:,.0f} |", flush=True)
            finally:
                vhost.delete()
    finally:
        broker.cleanup()
        store.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--size", type=int, default=2000, help="checkpoint JSON bytes")
    parser.add_argument("--workers", default="1,2,4", help="worker counts to measure")
    parser.add_argument("--concurrency", type=int, default=1, help="processes per worker")
    parser.add_argument("--publish-only", action="store_true")
    args = parser.parse_args()
    if not args.publish_only:
        print(f"| workers x processes | saves/s ({args.size} B, {args.messages} msgs) | applied |")
        print("|---|---|---|")
        for workers in (int(n) for n in args.workers.split(",")):
            rate, applied = drain_rate(workers, args.concurrency, args.messages, args.size)
            print(f"| {workers} x {args.concurrency} | {rate:,.0f} | {applied} |", flush=True)
    print(f"\n| broker | client saves/s ({args.size} B, one thread) |\n|---|---|")
    publish_section(1000, args.size)


if __name__ == "__main__":
    main()
