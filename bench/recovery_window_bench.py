"""What issue 44's loss detection and recovery window cost a save, side by side in one run.

    python -m bench.recovery_window_bench [--repeats 7] [--calls 2000] [--before FILE]

On one private redis-server (broker and store alike), interleaved repetitions, each the p50
of ``--calls`` calls:

* ``CheckpointClient.save`` (a staged 20 KB save) with the recovery window on (the default,
  10 s) and off (``republish_seconds=0``): the window's cost on the request path;
* publish.lua itself, a plain 20 KB save's call sent raw (EVALSHA) as it is now (sending the
  epoch, mark and token of its previous reply, as a client does) and, with ``--before``, as
  the script was before the mark (``git show 101094d:tasks/lua/publish.lua``, called with its
  own arguments), with ``--untokened``, before the mark's token (epoch and mark only: a state
  of the work restored in c5234a2, no longer in the history): the mark's and the token's cost;
* with ``--read-untokened``, read_pending.lua's 'one' call (a session with nothing pending,
  sending the mark and token publish.lua now last returned) now and before the token (a file
  of that state): what the token's two reads cost a load.

Then the window's memory: the bytes it keeps per 20 KB staged save (``RecentPublishes.bytes``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

import redis

from bench.harness import percentile, summarize, time_calls
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore
from checkpointq.store.scripts import script_source
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.servers import RedisServer

SIZE = 20_000
QUEUE = "checkpoints"


def _empty(raw: redis.Redis) -> None:
    """Everything but the epochs and marks: a client that saw them would find a loss."""
    for key in list(raw.scan_iter(count=1000)):
        if not key.endswith((b"pending-epoch", b"pending-mark")):
            raw.delete(key)


def _read(raw: redis.Redis, sha: str, seen: list[bytes | str | int], i: int) -> None:
    """read_pending.lua's 'one' call for a session with nothing pending (``seen``: the mark
    and token to send, none before the token)."""
    session = f"r{i % 32}"
    keys = [f"b.cq:pending-requests:{session}", "b.cq:pending-epoch", f"b.cq:pending:{session}"]
    keys += ["b.cq:pending-mark", "b.cq:pending", "b.cq:pending-counts"]
    args: list[bytes | str | int] = ["one", f"b.cq:pending-value:3:{session}:"]
    raw.evalsha(sha, len(keys), *keys, *args, 30 * 86_400_000, session, *seen)


def _scripts(options: argparse.Namespace) -> dict[str, str]:
    """The scripts to time: publish.lua now, and the earlier ones the options name."""
    scripts = {"publish.lua now": script_source("publish", "checkpointq.tasks")}
    if options.read_untokened:
        scripts["read_pending.lua now"] = script_source("read_pending", "checkpointq.tasks")
    earlier = {
        "publish.lua before": options.before,
        "publish.lua untokened": options.untokened,
        "read_pending.lua untokened": options.read_untokened,
    }
    scripts.update({name: path.read_text() for name, path in earlier.items() if path})
    return scripts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--before", type=Path, help="publish.lua before issue 44")
    parser.add_argument("--untokened", type=Path, help="publish.lua before the mark's token")
    parser.add_argument(
        "--read-untokened", type=Path, help="read_pending.lua before the mark's token"
    )
    options = parser.parse_args()
    server = RedisServer().start()
    raw = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
    clients = {
        "save, window on": CheckpointClient(server.url, RedisStore(raw, prefix="bench")),
        "save, window of 8 MiB": CheckpointClient(
            server.url, RedisStore(raw, prefix="bench"), republish_bytes=8 * 1024 * 1024
        ),
        "save, window off": CheckpointClient(
            server.url, RedisStore(raw, prefix="bench"), republish_seconds=0
        ),
    }
    checkpoints = [make_checkpoint(f"s{i}", SIZE) for i in range(32)]
    value = os.urandom(SIZE)
    scripts = _scripts(options)
    source = scripts["publish.lua now"]
    shas = {name: raw.script_load(text) for name, text in scripts.items()}
    assert shas["publish.lua now"] == hashlib.sha1(source.encode()).hexdigest()

    ids = itertools.count()
    # Each script's previous reply: the epoch, the mark and its token, as a client sends them.
    replies: dict[str, list[bytes | str | int]] = {name: ["", 0, ""] for name in scripts}

    def publish(name: str, i: int) -> None:
        clock = time.time_ns() // 1000
        token = os.urandom(16).hex()
        head: list[bytes | str | int] = [b"m" * 300, 30 * 86_400_000, token, clock, 300_000_000]
        seen = {"publish.lua now": replies[name], "publish.lua untokened": replies[name][:2]}
        keys = [QUEUE, "b.cq:pending", "b.cq:pending-epoch"]
        keys += ["b.cq:pending-mark", "b.cq:pending-counts"] if name in seen else []
        req = str(next(ids))
        keys += [f"b.cq:pending-requests:r{i % 32}", f"b.cq:pending-value:3:r{i % 32}:{req}"]
        # publish.lua now also takes the session's counted requests (finding 6)
        keys += [f"b.cq:pending-counted:r{i % 32}"] if name == "publish.lua now" else []
        record: list[bytes | str | int] = [f"r{i % 32}", clock, "save", req, value]
        reply = raw.evalsha(shas[name], len(keys), *keys, *head, *seen.get(name, []), *record)
        if name in seen:
            replies[name] = [reply[0], reply[1], token[:16]]

    def saving(client: CheckpointClient) -> Callable[[int], object]:
        return lambda i: client.save(checkpoints[i % 32])

    def publishing(name: str) -> Callable[[int], object]:
        return lambda i: publish(name, i)

    def reading(name: str) -> Callable[[int], object]:
        tokened = name == "read_pending.lua now"
        return lambda i: _read(
            raw, shas[name], replies["publish.lua now"][1:] if tokened else [], i
        )

    ways = {
        **{name: saving(client) for name, client in clients.items()},
        **{name: publishing(name) for name in scripts if name.startswith("publish")},
        **{name: reading(name) for name in scripts if name.startswith("read")},
    }
    p50s: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        time_calls(way, 50)
    for rep in range(options.repeats):
        names = list(ways)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            _empty(raw)
            p50s[name].append(percentile(time_calls(ways[name], options.calls), 50))
    recent = clients["save, window on"].pending_records.recent  # type: ignore[union-attr]
    print(f"p50 us, median (min-max) of {options.repeats} repetitions of {options.calls} calls")
    for name, values in p50s.items():
        print(f"  {name}: {summarize(values).fmt('.1f')}")
    print(f"window: {len(recent)} saves kept, {recent.bytes / max(1, len(recent)):.0f} bytes each")
    for client in clients.values():
        client.close()
    raw.close()
    server.cleanup()


if __name__ == "__main__":
    main()
