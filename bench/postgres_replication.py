"""What ``CHECKPOINTQ_PG_DURABILITY=replicated`` costs a group: the median time of a 32-save
``apply_batch``, ``local`` and ``replicated`` interleaved, on a private primary with a
streaming standby (``pg_basebackup`` with a slot) on this machine.

    python -m bench.postgres_replication [GROUPS]    (default 200: about a minute)

docs/reliability.md ("PostgreSQL failover and durability") reports its figures.
"""

from __future__ import annotations

import statistics
import sys
import time

from checkpointq.store.base import SaveOp
from checkpointq.store.postgres import PostgresStore
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer

MODES = ("local", "replicated")
#: Groups left out of each mode's figures: connections made, caches warm.
WARM_UP = 5


def measure(groups: int) -> dict[str, list[float]]:
    """Seconds per 32-save group, per mode, interleaved."""
    primary = PostgresServer().start()
    try:
        PostgresStore(primary.url, schema="bench").ping()
        standby = PostgresServer(standby_of=primary, slot="bench").start()
        try:
            stores = {m: PostgresStore(primary.url, schema="bench", durability=m) for m in MODES}
            times: dict[str, list[float]] = {m: [] for m in MODES}
            version = 0
            for _ in range(groups):
                for mode, store in stores.items():
                    version += 1
                    ops = [
                        SaveOp(make_checkpoint(f"s{i}", version=version, content_size=2000))
                        for i in range(32)
                    ]
                    started = time.perf_counter()
                    store.apply_batch(ops)
                    times[mode].append(time.perf_counter() - started)
            return {mode: spent[WARM_UP:] for mode, spent in times.items()}
        finally:
            standby.cleanup()
    finally:
        primary.cleanup()


def main() -> None:
    times = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
    for mode, spent in times.items():
        deciles = statistics.quantiles(spent, n=10)
        print(
            f"{mode}: median {statistics.median(spent) * 1000:.2f} ms (p10 "
            f"{deciles[0] * 1000:.2f}, p90 {deciles[-1] * 1000:.2f}) over {len(spent)} groups"
        )
    local, replicated = (statistics.median(times[mode]) for mode in MODES)
    print(f"replicated / local: {replicated / local:.2f}x")


if __name__ == "__main__":
    main()
