"""What setting an oversize item aside costs the broker, by the two ways the worker does it.

``python -m bench.oversize_broker [MB ...]`` (default 50 200 500). For each size, on a fresh
private ``redis-server`` (no persistence), one item of that size is queued and then:

- script: the reserve script takes it (``worker/lua/reserve.lua``), as for a busy worker;
- stream: a BRPOP's reply is peeked at and streamed to a broker key in 1 MiB APPENDs
  (``worker/oversize.py``), as for an idle worker.

Printed: the wall time of the step, the broker's ``used_memory_peak`` over its memory with
the item queued (Lua's heap is not in it), its peak RSS over its RSS then (Lua's copy
included), its ``used_memory`` after (the item kept once), Lua's memory after, and the
reader's own peak Python allocation.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from checkpointq.store import redis_hooks
from checkpointq.store.keys import KeySpace
from checkpointq.worker import oversize, reserve
from tests.support.servers import RedisServer

MIB = 1 << 20
KEYS = KeySpace()


def _script(client: redis.Redis, limit: int) -> None:
    reply = client.evalsha(
        reserve.sha(),
        5,
        "unacked",
        "unacked_index",
        KEYS.oversize_body("bench"),
        KEYS.oversize_index(),
        "q",
        10,
        4 * MIB,
        time.time(),
        limit,
        oversize.SAMPLE_BYTES // 2,
    )
    assert str(reply[2], "ascii").startswith("#"), "the item was not set aside"


def _stream(client: redis.Redis, limit: int) -> None:
    reader = redis.Redis(
        host=client.connection_pool.connection_kwargs["host"],
        port=client.connection_pool.connection_kwargs["port"],
    )
    conn: Any = reader.connection_pool.get_connection()
    conn.send_command("BRPOP", "q", 1)
    head = None
    while head is None:
        head = redis_hooks.peek_pop_reply(conn)
    header, _key, size = head
    assert size > limit
    redis_hooks.discard(conn, header)
    for chunk in redis_hooks.stream(conn, size, oversize.CHUNK_BYTES):
        client.append(KEYS.oversize_body("bench"), chunk)
    redis_hooks.discard(conn, 2)
    reader.connection_pool.release(conn)
    reader.close()


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _measure(size: int, step: Callable[[redis.Redis, int], None]) -> dict[str, Any]:
    server = RedisServer().start()
    try:
        client = server.client()
        client.config_set("proto-max-bulk-len", 1024 * MIB)
        client.script_load(reserve.source())
        client.lpush("q", b"A" * size)
        assert server.process is not None
        pid = server.process.pid
        base = int(client.info("memory")["used_memory"])
        rss_base = _status_kib(pid, "VmRSS")
        tracemalloc.start()
        started = time.perf_counter()
        step(client, oversize.max_item_bytes(8 * MIB))
        elapsed = time.perf_counter() - started
        _, reader_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        memory = client.info("memory")
        assert client.strlen(KEYS.oversize_body("bench")) == size
        client.close()
        return {
            "seconds": round(elapsed, 2),
            "broker_peak_over_queued_mib": round((memory["used_memory_peak"] - base) / MIB),
            "broker_after_mib": round(memory["used_memory"] / MIB),
            "lua_after_mib": round(memory["used_memory_lua"] / MIB, 1),
            "broker_rss_peak_over_queued_mib": round((_status_kib(pid, "VmHWM") - rss_base) / 1024),
            "reader_peak_mib": round(reader_peak / MIB, 1),
        }
    finally:
        server.cleanup()


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [50, 200, 500]
    for mb in sizes:
        for name, step in (("script", _script), ("stream", _stream)):
            print(f"{mb} MB {name}: {_measure(mb * MIB, step)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
