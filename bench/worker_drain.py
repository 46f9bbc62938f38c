"""Drain rates: how fast one worker empties a queue of ready-made save messages.

    .venv/bin/python bench/worker_drain.py [--messages 3000] [--size 20000]

Messages are built once and kept in a list on the broker (``Staged``). Each drain COPYs that
list to a staging key and RENAMEs it onto the queue in one step, so every worker measured
drains the very same bytes; the time runs from that release to the queue drained
with nothing unacknowledged (acks are late: a message is acknowledged only once its task has
run). The workers:

* ``plain``: stock Celery with our delivery settings and a no-op ``checkpoint.save``
  (``bench/plain_app.py``), the honest baseline;
* ``noop``: our worker (task base, consumer, transport, observers) with ``checkpoint.save``
  replaced by a no-op (``bench/noop_app.py``);
* ``save``: our production worker;
* ``traced``: our production worker with its coalescer traced (``bench/traced_app.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from bench.workload import make_checkpoint  # noqa: E402
from checkpointq.store.codec import ValueCodec  # noqa: E402
from checkpointq.store.keys import KeySpace  # noqa: E402
from checkpointq.store.serde import serialize_checkpoint  # noqa: E402
from checkpointq.tasks import messages as contract  # noqa: E402
from checkpointq.tasks.producer.compressed_body import enclose  # noqa: E402
from tests.support.celery_processes import CeleryProcess, checkpointq_env  # noqa: E402
from tests.support.envelopes import protocol2  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

QUEUE = "checkpoints"
STAGING = "bench-staging"

#: Worker kinds (see the module docstring) -> the Celery app they run.
APPS = {
    "plain": "bench.plain_app",
    "noop": "bench.noop_app",
    "save": "checkpointq.worker.app",
    "traced": "bench.traced_app",
}

#: Our worker as the image, ``checkpointq up`` and users start it: the console script
#: (``python -m checkpointq.worker.cli`` where it is not installed), with the settings of the
#: environment and Celery's INFO log, which says when the worker is ready.
_SCRIPT = Path(sys.executable).parent / "checkpointq"
DEPLOYED = [
    *([str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "checkpointq.worker.cli"]),
    "worker",
    "-l",
    "INFO",
]


@contextmanager
def running_worker(
    broker: RedisServer,
    store: RedisServer | str,
    pool: str = "prefork",
    concurrency: int = 2,
    kind: str = "save",
    settings: dict[str, object] | None = None,
    command: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[CeleryProcess]:
    """One worker of ``kind`` on ``broker``'s ``QUEUE``, stopped afterwards.

    ``store`` is a store server, or a store URL (a PostgreSQL one: ``bench/postgres_bench.py``).
    ``settings`` are further ``CHECKPOINTQ_*`` settings for our workers; ``command`` starts
    ours another way than ``celery -A`` (``DEPLOYED``: ``checkpointq worker``); ``extra_env``
    are further environment variables (``BENCH_TRACE_FILE`` for the ``traced`` kind).
    """
    env = checkpointq_env(
        broker_url=broker.url,
        store_url=store if isinstance(store, str) else store.url,
        queue=QUEUE,
        pool=pool,
        concurrency=concurrency,
        log_level="WARNING",
        **(settings or {}),
    )
    env.update(BENCH_BROKER_URL=broker.url, BENCH_QUEUE=QUEUE)
    env.update(extra_env or {})
    extra = ["-P", pool, "-c", str(concurrency)] if kind == "plain" else []
    worker = CeleryProcess("worker", env, app=APPS[kind], extra_args=extra, command=command)
    worker.start(ready="ready.", timeout=60)
    try:
        yield worker
    finally:
        worker.stop()


@dataclass(frozen=True, slots=True)
class Staged:
    """Messages kept on the broker at ``key``, released onto the queue as often as needed."""

    key: str
    messages: int
    #: Saves each message carries (``apply_batch`` messages carry many).
    saves_per_message: int
    envelope_bytes: int
    #: (session id, seq, task id) of each single save: the pending entry our producers
    #: would have written with it, restored before each release so that every worker
    #: settles them.
    records: tuple[tuple[str, int, str], ...] = ()
    #: Staged saves (``checkpoint.save_staged``): each message's session id, task id and
    #: staged value, restored before each release as our producers would have written them.
    values: tuple[tuple[str, str, bytes], ...] = ()

    def release_and_time_drain(self, client: redis.Redis) -> float:
        """Copy the messages onto the queue at once; seconds from then until the queue is
        empty with nothing left unacknowledged (the idle worker waits in BRPOP: it takes the
        first message at once)."""
        _write_records(client, self.records, bool(self.values))
        _write_values(client, self.values)
        client.copy(self.key, STAGING, replace=True)
        start = time.perf_counter()
        client.rename(STAGING, QUEUE)
        while client.llen(QUEUE) or client.hlen("unacked"):
            time.sleep(0.002)
        return time.perf_counter() - start

    def rate(self, client: redis.Redis, label: str = "") -> float:
        """Saves per second of one release."""
        elapsed = self.release_and_time_drain(client)
        rate = self.messages * self.saves_per_message / elapsed
        print(
            f"{label or self.key:24} {self.messages} msgs x {self.saves_per_message} saves, "
            f"~{self.envelope_bytes // self.messages // 1024} KiB envelopes: "
            f"{elapsed:.2f}s, {rate:,.0f} saves/s",
            flush=True,
        )
        return rate


#: The parts of a drain whose CPU time is measured, in report order.
CPU_PARTS = ("main", "pool", "broker", "store")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class CpuMeter:
    """CPU time of a worker's main process, its pool processes, and the two Redis servers.

    On a machine shared with other work, wall-clock rates depend on the share of the CPUs a
    drain gets; the CPU each part spends per save does not, or far less.
    """

    pids: dict[str, list[int]]

    @classmethod
    def of(cls, worker: CeleryProcess, broker: RedisServer, store: RedisServer) -> CpuMeter:
        if not (worker.process and broker.process and store.process):
            raise RuntimeError("the worker and both redis-servers must be running")
        main = worker.process.pid
        children = Path(f"/proc/{main}/task/{main}/children").read_text().split()
        return cls(
            {
                "main": [main],
                "pool": [int(child) for child in children],
                "broker": [broker.process.pid],
                "store": [store.process.pid],
            }
        )

    def read(self) -> dict[str, float]:
        return {part: sum(cpu_seconds(pid) for pid in self.pids[part]) for part in CPU_PARTS}


def stage(
    client: redis.Redis,
    key: str,
    messages: int,
    size: int,
    tag: str,
    per_message: int = 0,
    task: str = contract.SAVE,
    compressed: bool = False,
    staged: bool = False,
) -> Staged:
    """Build ``messages`` save messages of ``size``-byte checkpoints into the list ``key``.

    With ``per_message`` > 0 each message is a ``checkpoint.apply_batch`` of that many saves;
    else, with ``staged``, each is a ``checkpoint.save_staged`` naming its value (the
    checkpoint's JSON), as our Python producers send a save by default; else, with
    ``compressed``, each body is zstd as our Python producers send a save in its message.
    Session ids are ``<tag>-<i>`` (``<tag>-<i>-<n>`` in batches); seqs are increasing.
    """
    documents = [serialize_checkpoint(make_checkpoint(f"{tag}-t{n}", size)) for n in range(16)]
    codec = ValueCodec()
    client.delete(key)
    pipe = client.pipeline(transaction=False)
    total = 0
    values: list[tuple[str, str, bytes]] = []
    for i in range(messages):
        task_id = f"bench-{tag}-{i}"
        if staged:
            values.append((f"{tag}-{i}", task_id, _renamed(documents[i % 16], f"{tag}-{i}")))
            body = contract.save_staged_body(f'"{tag}-{i}"'.encode(), 1_000 + i)
            envelope = protocol2(contract.SAVE_STAGED, [], body=body, queue=QUEUE, task_id=task_id)
        elif per_message:
            items = [
                contract.save_item(_renamed(documents[n % 16], f"{tag}-{i}-{n}"), 1_000 + i)
                for n in range(per_message)
            ]
            body = contract.body(b"[[" + b",".join(items) + b"]]", b"{}")
            envelope = protocol2(contract.APPLY_BATCH, [], body=body, queue=QUEUE)
        elif compressed:
            # As our producers send a save: a zstd body made from the record's frame.
            document = _renamed(documents[i % 16], f"{tag}-{i}")
            prefix, suffix = contract.save_body_framing(1_000 + i)
            zstd_body = enclose(codec.encode(document), prefix, suffix)
            envelope = protocol2(
                task, [], body=zstd_body, queue=QUEUE, compression=contract.ZSTD, task_id=task_id
            )
        else:
            document = _renamed(documents[i % 16], f"{tag}-{i}")
            envelope = protocol2(
                task, [], body=contract.save_body(document, 1_000 + i), queue=QUEUE, task_id=task_id
            )
        total += len(envelope)
        pipe.rpush(key, envelope)
        if i % 200 == 199:
            pipe.execute()
    pipe.execute()
    records = (
        ()
        if per_message
        else tuple((f"{tag}-{i}", 1_000 + i, f"bench-{tag}-{i}") for i in range(messages))
    )
    return Staged(key, messages, max(1, per_message), total, records, tuple(values))


#: A record's value: about what a 20 KB generated checkpoint compresses to.
_RECORD_VALUE = b"v" * 9_000


def _write_records(
    client: redis.Redis, records: tuple[tuple[str, int, str], ...], staged: bool
) -> None:
    """The pending entries (tasks/producer/pending.py) of ``records``, as publish.lua
    leaves them: an entry per request in its session's hash, a plain save's value beside
    it (``staged``: the values are the staged ones, ``_write_values``), an index entry."""
    keys = KeySpace()
    pipe = client.pipeline(transaction=False)
    for n, (session_id, seq, task_id) in enumerate(records):
        pipe.hset(keys.pending_requests(session_id), task_id, f"{seq} save")
        if not staged:
            pipe.set(keys.pending_value(session_id, task_id), _RECORD_VALUE, px=3_600_000)
        pipe.zadd(keys.pending_index(), {session_id: 2**50})
        if n % 200 == 199:
            pipe.execute()
    pipe.execute()


def _write_values(client: redis.Redis, values: tuple[tuple[str, str, bytes], ...]) -> None:
    """Staged saves' values, as our producers SET them (the worker deletes each it settles)."""
    keys = KeySpace()
    pipe = client.pipeline(transaction=False)
    for n, (session_id, task_id, value) in enumerate(values):
        pipe.set(keys.pending_value(session_id, task_id), value, px=3_600_000)
        if n % 200 == 199:
            pipe.execute()
    pipe.execute()


def _renamed(document: bytes, session_id: str) -> bytes:
    """The checkpoint JSON with another session id (ids are the document's first field)."""
    head, _, rest = document.partition(b'","')
    if not head.startswith(b'{"sessionId":"'):
        raise ValueError("expected sessionId first in the Go JSON")
    return b'{"sessionId":"' + session_id.encode() + b'","' + rest


def applied(store: RedisServer, tag: str, messages: int) -> int:
    """How many of ``stage(..., tag)``'s single saves are in the store."""
    client = store.client()
    keys = KeySpace()
    pipe = client.pipeline(transaction=False)
    for i in range(messages):
        pipe.exists(keys.data(f"{tag}-{i}"))
    found = int(sum(pipe.execute()))
    client.close()
    return found


def drain(
    broker: RedisServer, task: str, messages: int, size: int, tag: str, per_message: int = 0
) -> float:
    """Stage and drain once (for the sections that need one figure): saves per second."""
    client = broker.client()
    try:
        staged = stage(client, f"bench-{tag}", messages, size, tag, per_message, task)
        return staged.rate(client, f"{task} {tag}")
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--size", type=int, default=20_000, help="checkpoint JSON bytes")
    args = parser.parse_args()
    broker, store = RedisServer().start(), RedisServer().start()
    client = broker.client()
    try:
        staged = stage(client, "bench-saves", args.messages, args.size, "s")
        rates = {}
        for kind in APPS:
            with running_worker(broker, store, kind=kind):
                rates[kind] = staged.rate(client, kind)
        print(f"applied saves found in the store: {applied(store, 's', args.messages)}")
        for kind, rate in rates.items():
            print(f"{kind:6} {rate:8,.0f}/s  {rate / rates['plain']:.2f}x plain Celery no-op")
    finally:
        client.close()
        broker.cleanup()
        store.cleanup()


if __name__ == "__main__":
    main()
