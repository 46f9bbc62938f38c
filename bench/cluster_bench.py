"""Cluster section: listing and sweeping N sessions on a single Redis and on a local 3-master
Redis Cluster, in the store's own layout on each (Go's data keys, on the cluster too).

Sessions are written as the sweep section writes them (pipelined ``SET PXAT`` / ``HSET`` /
``PEXPIRE`` / ``ZADD``, the very structures ``save.lua`` writes, checked against a real
``save`` before measuring); on the cluster each node's share goes down that node's own
connection, its index entries into the slot index of each session's data key.

Figures: ``list()`` of every session; a full pass with nothing due (on the cluster it reads
all 16384 slot indexes, as every ``CHECKPOINTQ_SWEEP_FULL_PASS_SECONDS``; on a single Redis
it is the ordinary sweep); then a sweep with nothing due (``expire_stale`` with the beat's
limit), which on the cluster reads the sweep hint only; and a sweep of the staged batch of
stale sessions. Stale sessions are staged behind the store's back, with a TTL far below the
store's, so the full pass before the measured sweeps is what tells the hint of them, as it
would have known of sessions saved a TTL ago. "Longest call" is Redis's own account
(SLOWLOG at a 0 us threshold on every node during the sweeps): a script counts as one
command.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from bench.harness import RunConfig, SectionReport, Summary, Target, private_redis, summarize
from bench.sweep_bench import POPULATE_BATCH, Population, _command, _longest, _Slowlog
from checkpointq.store import RedisStore, StoreOptions
from checkpointq.store.keys import ClusterKeySpace
from tests.support.cluster import LocalCluster

#: What the beat's sweep task passes (worker setting ``sweep_limit``).
SWEEP_LIMIT = 10_000
#: Target of issue #12: an empty sweep among 1M sessions on the cluster.
EMPTY_SWEEP_TARGET_MS = 50.0
DAY_MS = 24 * 60 * 60 * 1000
STALE_TTL_MS = 60 * 60 * 1000


@dataclass(frozen=True, slots=True)
class Sizes:
    sessions: int
    stale: int


@dataclass(frozen=True, slots=True)
class LayoutResult:
    """Everything measured on one deployment (a single Redis, or the cluster)."""

    layout: str
    sessions: int
    populate_seconds: float
    list_seconds: Summary
    #: A sweep with nothing due that reads every slot index (None: a single Redis has one).
    full_pass_ms: Summary | None
    empty_sweep_ms: Summary
    #: Redis's own time for an empty sweep on the busiest node (the sum of that node's calls,
    #: SLOWLOG): what the sweep costs a master, and its wall time when masters have cores
    #: of their own (here 3 masters share 2 cores with everything else).
    empty_sweep_node_ms: Summary
    stale_sweep_seconds: Summary
    expirations_per_second: Summary
    longest_call_ms: float
    longest_call: str


def sizes(config: RunConfig) -> Sizes:
    if config.quick:
        return Sizes(sessions=3_000, stale=300)
    return Sizes(sessions=1_000_000, stale=10_000)


def run(config: RunConfig) -> SectionReport:
    size = sizes(config)
    results = [_on_single_redis(size, config), _on_cluster(size, config)]
    report = SectionReport("cluster", "Cluster: list and sweep, single Redis vs 3-master cluster")
    _write(report, results, size, config)
    return report


class ClusterPopulation(Population):
    """``Population`` for a cluster store: each node's sessions down its own connection."""

    def __init__(self, store: RedisStore, client: RedisCluster) -> None:
        # The layout check reads keys through any client; the cluster client routes them.
        Population.__init__(self, store, client)  # type: ignore[arg-type]
        self.cluster = client

    def write(self, ids: Sequence[str], ttl_ms: int) -> None:
        keys = self.store.keys
        slots = self.cluster.nodes_manager.slots_cache
        by_node: dict[str, list[str]] = {}
        nodes: dict[str, Any] = {}
        for session_id in ids:
            node = slots[keys.shard(session_id)][0]
            by_node.setdefault(node.name, []).append(session_id)
            nodes[node.name] = node
        now_ms = int(time.time() * 1000)
        deadline = now_ms + ttl_ms
        for name, node_ids in by_node.items():
            connection = self.cluster.get_redis_connection(nodes[name])
            for start in range(0, len(node_ids), POPULATE_BATCH):
                pipe = connection.pipeline(transaction=False)
                for session_id in node_ids[start : start + POPULATE_BATCH]:
                    session = keys.session(session_id)
                    pipe.set(session.data, self.value, pxat=deadline)
                    pipe.hset(
                        session.fence,
                        mapping={
                            "seq": now_ms * 1000,
                            "deleted": "0",
                            "deadline": deadline,
                            "expires": deadline,
                            "req": "",
                        },
                    )
                    pipe.pexpire(session.fence, ttl_ms + self.fence_extra_ms)
                    pipe.zadd(session.index, {session_id: deadline})
                pipe.execute()


#: The full-pass period of the measured stores: longer than the 2 h by which the stale sweep
#: looks ahead, so that it reads the slots the hint names, as the sweeps between full passes do.
FULL_PASS_SECONDS = 3 * 3600.0


def _on_single_redis(size: Sizes, config: RunConfig) -> LayoutResult:
    with private_redis("--slowlog-max-len", "1000000") as client:
        store = RedisStore(client, options=StoreOptions(sweep_full_pass_seconds=FULL_PASS_SECONDS))
        return _measure("single Redis", store, Population(store, client), [client], size, config)


def _on_cluster(size: Sizes, config: RunConfig) -> LayoutResult:
    cluster = LocalCluster(masters=3).start()
    try:
        for node in cluster.nodes:
            probe = node.client()
            probe.config_set("slowlog-max-len", 1_000_000)
            probe.close()
        store = RedisStore.from_url(
            cluster.url,
            options=StoreOptions(sweep_full_pass_seconds=FULL_PASS_SECONDS),
            socket_timeout=60,
        )
        assert isinstance(store.keys, ClusterKeySpace)
        masters = [node.client() for node in cluster.nodes]
        try:
            population = ClusterPopulation(store, store.client)
            return _measure("3-master cluster", store, population, masters, size, config)
        finally:
            for master in masters:
                master.close()
            store.close()
    finally:
        cluster.cleanup()


def _measure(
    layout: str,
    store: RedisStore,
    population: Population,
    nodes: list[redis.Redis],
    size: Sizes,
    config: RunConfig,
) -> LayoutResult:
    started = time.perf_counter()
    live = [f"live-{i:07d}" for i in range(size.sessions - size.stale)]
    population.write(live, 30 * DAY_MS)
    populate_seconds = time.perf_counter() - started
    population.check_layout(live[0])
    cluster = isinstance(store.keys, ClusterKeySpace)
    lists, fulls, empties, node_ms, sweeps, rates = [], [], [], [], [], []
    longest: tuple[float, str] = (0.0, "")
    for rep in range(config.repeats):
        stale = [f"stale-{rep}-{i:05d}" for i in range(size.stale)]
        population.write(stale, STALE_TTL_MS)
        started = time.perf_counter()
        listed = store.list()
        lists.append(time.perf_counter() - started)
        if len(listed) != size.sessions:
            raise RuntimeError(f"list() gave {len(listed)} sessions, expected {size.sessions}")
        if cluster:
            store.client.delete(store.keys.sweep_hint())  # the next sweep is a full pass
        with _slowlogs(nodes) as calls:
            started = time.perf_counter()
            none = store.expire_stale(limit=SWEEP_LIMIT)
            fulls.append((time.perf_counter() - started) * 1000)
        longest = max(longest, _longest(calls))
        if none:
            raise RuntimeError(f"the full pass expired {len(none)} live sessions")
        with _slowlogs(nodes) as calls:
            started = time.perf_counter()
            none = store.expire_stale(limit=SWEEP_LIMIT)
            empties.append((time.perf_counter() - started) * 1000)
        node_ms.append(_busiest_node_ms(calls))
        longest = max(longest, _longest(calls))
        if none:
            raise RuntimeError(f"the sweep expired {len(none)} live sessions")
        later = time.time() + 2 * STALE_TTL_MS / 1000
        with _slowlogs(nodes) as calls:
            started = time.perf_counter()
            expired = store.expire_stale(now=later, limit=SWEEP_LIMIT)
            elapsed = time.perf_counter() - started
        longest = max(longest, _longest(calls))
        if sorted(expired) != stale:
            raise RuntimeError(f"expired {len(expired)} sessions, staged {len(stale)}")
        sweeps.append(elapsed)
        rates.append(len(expired) / elapsed)
    return LayoutResult(
        layout,
        size.sessions,
        populate_seconds,
        summarize(lists),
        summarize(fulls) if cluster else None,
        summarize(empties),
        summarize(node_ms),
        summarize(sweeps),
        summarize(rates),
        longest[0],
        longest[1],
    )


@contextmanager
def _slowlogs(nodes: list[redis.Redis]) -> Iterator[list[dict[str, Any]]]:
    """Every command each node executes inside the block (SLOWLOG, threshold 0 us), each
    entry tagged with its node's position (``"node"``)."""
    with ExitStack() as stack:
        logs = [stack.enter_context(_Slowlog(node)) for node in nodes]
        entries: list[dict[str, Any]] = []
        yield entries
    for position, log in enumerate(logs):
        entries.extend({**entry, "node": position} for entry in log)


def _busiest_node_ms(entries: list[dict[str, Any]]) -> float:
    """The largest sum of one node's command times, in ms. Redis 7 also logs each command a
    script runs (inside the script's own time): when scripts ran, only they are summed."""
    scripts = [e for e in entries if _command(e).upper().startswith(("EVAL", "SCRIPT"))]
    totals: dict[int, int] = {}
    for entry in scripts or entries:
        totals[entry["node"]] = totals.get(entry["node"], 0) + int(entry["duration"])
    return max(totals.values(), default=0) / 1000


def _write(
    report: SectionReport, results: list[LayoutResult], size: Sizes, config: RunConfig
) -> None:
    lines = report.lines
    lines += [
        f"N = {size.sessions:,} sessions in the store's own layout, {size.stale:,} of them "
        f"stale in each of {config.repeats} repetitions (re-staged each time), on one private "
        "redis-server and on a private 3-master cluster (no replicas) on this machine. "
        f"`list()` returns every live id; the sweeps are `expire_stale(limit={SWEEP_LIMIT:,})`, "
        "what the beat's sweep task runs. On the cluster a sweep reads the slot indexes the "
        "sweep hint names (one call when none is due); a full pass (every "
        "`CHECKPOINTQ_SWEEP_FULL_PASS_SECONDS`, 300 s by default, or with no hint) reads all "
        "16384 with `due.lua`, 256 slots per call, one pipeline per node. Here each "
        "repetition drops the hint and times the full pass, then the sweeps (the stores' "
        f"full-pass period is {FULL_PASS_SECONDS / 3600:g} h, so that the stale sweep, 2 h "
        "ahead, reads the slots the hint names).",
        "",
        "| deployment | populate s | `list()` of all, s | full pass, nothing due, ms | "
        "**sweep, nothing due, ms** | of which Redis time on the busiest node, ms | "
        f"sweep of {size.stale:,} stale, s | expirations/s | longest call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        full = r.full_pass_ms.fmt(".1f") if r.full_pass_ms else "— (one index)"
        lines.append(
            f"| {r.layout} | {r.populate_seconds:.1f} | {r.list_seconds.fmt('.2f')} | {full} | "
            f"**{r.empty_sweep_ms.fmt('.2f')}** | {r.empty_sweep_node_ms.fmt('.2f')} | "
            f"{r.stale_sweep_seconds.fmt('.3f')} | "
            f"{r.expirations_per_second.fmt()} | {r.longest_call_ms:.2f} ms ({r.longest_call}) |"
        )
    cluster = results[-1]
    report.targets.append(
        Target(
            f"empty sweep among {cluster.sessions:,} sessions on the 3-master cluster",
            f"< {EMPTY_SWEEP_TARGET_MS:g} ms",
            cluster.empty_sweep_ms.fmt(".1f", " ms"),
            None if config.quick else cluster.empty_sweep_ms.median < EMPTY_SWEEP_TARGET_MS,
        )
    )
