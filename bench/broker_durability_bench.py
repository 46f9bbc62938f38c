"""What ``CHECKPOINTQ_BROKER_DURABILITY=replicated`` costs a save on the request path.

    python -m bench.broker_durability_bench [--repeats 7] [--calls 2000]

A private broker primary and its replica (``replicaof``) on loopback, the store on the
primary. ``CheckpointClient.save`` (a staged 20 KB save) with ``local`` and with
``replicated`` (one replica, WAIT in the same write as the publish), interleaved
repetitions, each the p50 and p99 of ``--calls`` calls; the median of the repetitions with
their range, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import redis

from bench.harness import percentile, summarize, time_calls
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore
from checkpointq.tasks.producer.broker_durability import BrokerDurability
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.servers import RedisServer, wait_until

SIZE = 20_000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    options = parser.parse_args()
    primary = RedisServer(extra_args=["--repl-diskless-sync-delay", "0"]).start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    raw = redis.Redis(host="127.0.0.1", port=primary.port, socket_timeout=30)
    probe = replica.client()
    wait_until(lambda: probe.info("replication")["master_link_status"] == "up", timeout=30)
    modes = {
        "local": BrokerDurability(),
        "replicated (1 replica)": BrokerDurability.replicated(),
    }
    clients = {
        name: CheckpointClient(primary.url, RedisStore(raw, prefix="bench"), durability=mode)
        for name, mode in modes.items()
    }
    checkpoints = [make_checkpoint(f"s{i}", SIZE) for i in range(32)]

    def saving(client: CheckpointClient) -> Callable[[int], object]:
        return lambda i: client.save(checkpoints[i % 32])

    ways = {name: saving(client) for name, client in clients.items()}
    p50s: dict[str, list[float]] = {name: [] for name in ways}
    p99s: dict[str, list[float]] = {name: [] for name in ways}
    load_before = os.getloadavg()
    for way in ways.values():
        time_calls(way, 50)
    for rep in range(options.repeats):
        names = list(ways)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            raw.delete("checkpoints")  # the queue only: pending records stay bounded by 32
            timings = time_calls(ways[name], options.calls)
            p50s[name].append(percentile(timings, 50))
            p99s[name].append(percentile(timings, 99))
    load_after = os.getloadavg()
    print(
        f"save of a staged {SIZE // 1000} KB checkpoint, us: median (min-max) of "
        f"{options.repeats} interleaved repetitions of {options.calls} calls"
    )
    for name in ways:
        print(
            f"  {name}: p50 {summarize(p50s[name]).fmt('.0f')}, "
            f"p99 {summarize(p99s[name]).fmt('.0f')}"
        )
    local, replicated = (statistics.median(p50s[n]) for n in ways)
    ratios = [r / loc for loc, r in zip(*p50s.values(), strict=True)]
    print(
        f"replicated / local p50: {replicated / local:.2f}x (per repetition "
        f"{min(ratios):.2f}-{max(ratios):.2f}x)"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (2 cores)")
    for client in clients.values():
        client.close()
    probe.close()
    raw.close()
    replica.cleanup()
    primary.cleanup()


if __name__ == "__main__":
    main()
