"""Reconcile section: how fast the reconciliation pass converges, and what it costs Redis.

The keyspace holds N sessions in the store's own layout (written as the sweep section
writes them, checked against a real ``save``) beside 1M unrelated keys; before each pass,
1% of N more are written as a Go ``RedisStore`` writes them (``SET EX 30 d``, no index
entry) and 1% of the indexed sessions lose their value (a Go ``DEL``). One pass is what beat
runs one slice at a time: ``RedisStore.reconcile(budget)`` with the worker's default budget,
here back to back until a slice completes the pass (beat spaces the slices by
``CHECKPOINTQ_RECONCILE_INTERVAL_SECONDS``; convergence time = slices x interval).

The same pass runs on a private 3-master cluster holding the same keys (the store's cluster
layout: per-slot indexes), each node's share written down its own connection.

Call times are Redis's own account, on every node, of the commands the pass sends (a script
counts as one command; the commands it runs inside are not counted again): the number of
calls and their p99.9 from Redis's latency histograms (``LATENCY HISTOGRAM``, power-of-two
buckets, so the p99.9 is a bucket's upper bound), and every call over 5 ms from SLOWLOG at a
5,000 us threshold (which, unlike a 0 us threshold, costs the server nothing when nothing is
that slow). Both measure wall time: a command during which redis-server was descheduled on
a busy machine shows up as slow.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.cluster_bench import ClusterPopulation
from bench.harness import RunConfig, SectionReport, Summary, Target, private_redis, summarize
from bench.sweep_bench import POPULATE_BATCH, Population, _command
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore, StoreOptions
from checkpointq.worker.settings import Settings
from tests.support.cluster import LocalCluster

DAY_MS = 24 * 60 * 60 * 1000
GO_TTL_SECONDS = 30 * 24 * 60 * 60
LONGEST_CALL_TARGET_MS = 5.0
#: SLOWLOG records the calls slower than this (us): the target's threshold.
SLOWLOG_THRESHOLD_US = int(LONGEST_CALL_TARGET_MS * 1000)
#: The commands a reconciliation pass sends (the commands a script runs inside it are
#: recorded by Redis too, under their own names, and are not counted again).
PASS_COMMANDS = ("evalsha", "eval", "scan", "zscan", "hgetall")


@dataclass(frozen=True, slots=True)
class Sizes:
    sessions: tuple[int, ...]
    unrelated: int


@dataclass(frozen=True, slots=True)
class PassResult:
    deployment: str
    sessions: int
    foreign: int
    budget: int
    slices: Summary
    pass_seconds: Summary
    items_per_second: Summary
    longest_slice_seconds: float
    #: Calls the pass sent, and their p99.9 (a histogram bucket's upper bound), in ms.
    calls: int
    p999_call_ms: float
    #: Calls over 5 ms, and the longest of them ((0, "") when none was).
    calls_over_target: int
    longest_call_ms: float
    longest_call: str
    #: The largest histogram bucket that holds a call: the longest call is at most this.
    longest_bucket_ms: float
    #: The servers' main threads during the passes: preemptions, and seconds spent waiting
    #: for a CPU while runnable (machine load, not the calls' own work).
    preempted: int
    waited_seconds: float


@dataclass
class _Deployment:
    """A store under test, how to populate it, and the nodes whose timings are read."""

    name: str
    store: RedisStore
    population: Population
    nodes: list[redis.Redis]


def sizes(config: RunConfig) -> Sizes:
    if config.quick:
        return Sizes(sessions=(2_000,), unrelated=2_000)
    return Sizes(sessions=(1_000_000,), unrelated=1_000_000)


def run(config: RunConfig) -> SectionReport:
    size = sizes(config)
    budget = Settings.model_fields["reconcile_budget"].default
    interval = Settings.model_fields["reconcile_interval_seconds"].default
    results = []
    for sessions in size.sessions:
        with _single_redis(size) as deployment:
            results.append(_measure(deployment, sessions, budget, config))
    with _cluster(size) as deployment:
        results.append(_measure(deployment, size.sessions[-1], budget, config))
    report = SectionReport("reconcile", "Reconcile: a full pass beside Go writers")
    _write(report, results, size, budget, interval, config)
    return report


@contextmanager
def _single_redis(size: Sizes) -> Iterator[_Deployment]:
    with private_redis("--enable-debug-command", "local") as client:
        client.execute_command(  # type: ignore[no-untyped-call]
            "DEBUG", "POPULATE", size.unrelated, "unrelated", 100
        )
        store = RedisStore(client, options=StoreOptions())
        yield _Deployment("single Redis", store, Population(store, client), [client])


@contextmanager
def _cluster(size: Sizes) -> Iterator[_Deployment]:
    cluster = LocalCluster(masters=3).start()
    masters = [node.client() for node in cluster.nodes]
    try:
        store = RedisStore.from_url(cluster.url, options=StoreOptions(), socket_timeout=60)
        try:
            _write_unrelated(store, size.unrelated)
            population = ClusterPopulation(store, store.client)
            yield _Deployment("3-master cluster", store, population, masters)
        finally:
            store.close()
    finally:
        for master in masters:
            master.close()
        cluster.cleanup()


def _write_unrelated(store: RedisStore, count: int) -> None:
    """``count`` small keys outside the store's, each down its own node's connection (as
    ``DEBUG POPULATE`` writes them on a single Redis)."""
    cluster = store.client
    slots = cluster.nodes_manager.slots_cache
    by_node: dict[str, tuple[Any, list[str]]] = {}
    for i in range(count):
        key = f"unrelated:{i}"
        node = slots[cluster.keyslot(key)][0]
        by_node.setdefault(node.name, (node, []))[1].append(key)
    for node, keys in by_node.values():
        connection = cluster.get_redis_connection(node)
        for start in range(0, len(keys), POPULATE_BATCH):
            pipe = connection.pipeline(transaction=False)
            for key in keys[start : start + POPULATE_BATCH]:
                pipe.set(key, b"x" * 100)
            pipe.execute()


def _measure(deployment: _Deployment, sessions: int, budget: int, config: RunConfig) -> PassResult:
    store, population = deployment.store, deployment.population
    foreign = max(1, sessions // 100)
    live = [f"live-{i:07d}" for i in range(sessions)]
    population.write(live, 30 * DAY_MS)
    population.check_layout(live[0])
    slices, seconds, rates, slowest = [], [], [], []
    timings = _Timings()
    repeats = config.repeats if sessions <= 100_000 else min(config.repeats, 2)
    for rep in range(repeats):
        go_only = [f"go-{rep}-{i:07d}" for i in range(foreign)]
        deleted = live[rep * foreign : (rep + 1) * foreign]
        _stage(store, go_only, deleted)
        with timings.recording(deployment.nodes):
            count, elapsed, examined, slice_max = _one_pass(store, budget)
        # As many Go-only sessions adopted as values deleted: N entries again.
        indexed = store.count_sessions().live
        if indexed != sessions:
            raise RuntimeError(f"after the pass {indexed} sessions are indexed, not {sessions}")
        slices.append(float(count))
        seconds.append(elapsed)
        rates.append(examined / elapsed)
        slowest.append(slice_max)
    calls, p999, top_bucket = timings.histogram_figures()
    over, longest = timings.slow_figures()
    return PassResult(
        deployment.name,
        sessions,
        foreign,
        budget,
        summarize(slices),
        summarize(seconds),
        summarize(rates),
        max(slowest),
        calls,
        p999,
        over,
        longest[0],
        longest[1],
        top_bucket,
        timings.preempted,
        timings.waited,
    )


def _stage(store: RedisStore, go_only: list[str], deleted: list[str]) -> None:
    """Go's writes behind our back: values without index entries, and DELs of our values."""
    client = store.client
    value = store.encode(make_checkpoint("go", 500)).value
    pipe = client.pipeline(transaction=False)
    for n, session_id in enumerate(go_only, 1):
        pipe.set(store.keys.data(session_id), value, ex=GO_TTL_SECONDS)
        if n % 2_000 == 0:
            pipe.execute()
    for n, session_id in enumerate(deleted, 1):
        pipe.delete(store.keys.data(session_id))
        if n % 2_000 == 0:
            pipe.execute()
    pipe.execute()


def _one_pass(store: RedisStore, budget: int) -> tuple[int, float, int, float]:
    """Slices back to back until one completes the pass: how many, their total time, the
    items they examined, and the longest slice."""
    count = examined = 0
    slice_max = total = 0.0
    while True:
        started = time.perf_counter()
        report = store.reconcile(budget)
        elapsed = time.perf_counter() - started
        total += elapsed
        slice_max = max(slice_max, elapsed)
        count += 1
        examined += report.examined
        if report.completed_pass:
            return count, total, examined, slice_max


def _main_thread(node: redis.Redis) -> Path:
    """``/proc`` directory of a local redis-server's main thread (its tid is its pid)."""
    pid = int(node.info("server")["process_id"])
    return Path(f"/proc/{pid}/task/{pid}")


def _scheduling(thread: Path) -> tuple[int, float]:
    """The thread's involuntary context switches so far, and its time spent runnable but
    waiting for a CPU (s): when such a wait falls inside a command, Redis times it too."""
    waited_ns = int((thread / "schedstat").read_text().split()[1])
    status = (thread / "status").read_text()
    preempted = next(
        int(line.split()[1])
        for line in status.splitlines()
        if line.startswith("nonvoluntary_ctxt_switches")
    )
    return preempted, waited_ns / 1e9


class _Timings:
    """Redis's own timings of the pass's calls, over every node and repetition."""

    def __init__(self) -> None:
        #: Calls per histogram bucket (upper bound in us), not cumulative.
        self.buckets: Counter[int] = Counter()
        self.slow: list[tuple[float, str]] = []
        #: What the kernel says of the servers' main threads during the passes: how often
        #: they were preempted, and how long they waited, runnable, for a CPU (s).
        self.preempted = 0
        self.waited = 0.0

    @contextmanager
    def recording(self, nodes: Sequence[redis.Redis]) -> Iterator[None]:
        threads = [_main_thread(node) for node in nodes]
        for node in nodes:
            node.config_set("slowlog-log-slower-than", SLOWLOG_THRESHOLD_US)
            node.config_set("slowlog-max-len", 100_000)
            node.slowlog_reset()
            node.config_resetstat()  # the latency histograms too
        before = [_scheduling(thread) for thread in threads]
        try:
            yield
        finally:
            for thread, (preempted, waited) in zip(threads, before, strict=True):
                now_preempted, now_waited = _scheduling(thread)
                self.preempted += now_preempted - preempted
                self.waited += now_waited - waited
            for node in nodes:
                node.config_set("slowlog-log-slower-than", -1)
                self._read(node)

    def _read(self, node: redis.Redis) -> None:
        for entry in node.slowlog_get(-1):
            name = _command(entry).split(" ")[0].lower()
            if name in PASS_COMMANDS:
                label = "a store script" if name.startswith("eval") else name.upper()
                self.slow.append((int(entry["duration"]) / 1000, label))
        histograms: Any = node.execute_command(  # type: ignore[no-untyped-call]
            "LATENCY", "HISTOGRAM", *PASS_COMMANDS
        )
        for stats in histograms.values():
            below = 0
            for bound, cumulative in sorted(stats[b"histogram_usec"].items()):
                self.buckets[int(bound)] += int(cumulative) - below
                below = int(cumulative)

    def histogram_figures(self) -> tuple[int, float, float]:
        """Calls, their p99.9 and the largest bucket holding one (upper bounds, ms)."""
        calls = sum(self.buckets.values())
        seen, p999 = 0, 0.0
        for bound in sorted(self.buckets):
            seen += self.buckets[bound]
            if seen >= 0.999 * calls:
                p999 = bound / 1000
                break
        top = max((b for b, n in self.buckets.items() if n), default=0) / 1000
        return calls, p999, top

    def slow_figures(self) -> tuple[int, tuple[float, str]]:
        return len(self.slow), max(self.slow, default=(0.0, ""))


def _write(
    report: SectionReport,
    results: list[PassResult],
    size: Sizes,
    budget: int,
    interval: float,
    config: RunConfig,
) -> None:
    lines = report.lines
    lines += [
        f"Each row: N sessions beside {size.unrelated:,} unrelated keys, on one private "
        "redis-server or on a private 3-master cluster (no replicas) of this machine; before "
        "each pass 1% of N are written as Go writes them (adopted by the pass) and 1% of the "
        f"indexed ones are deleted as Go deletes them (dropped). A pass is "
        f"`RedisStore.reconcile({budget:,})` slices back to back (the default "
        "`CHECKPOINTQ_RECONCILE_BUDGET`) until one completes it: a SCAN of the data keys (of "
        "each primary in turn), then a ZSCAN of the index (of every slot's, on the cluster), "
        "then `reconcile.lua` for what they found. Items are the keys and index entries the "
        "pass looked at (about 2 per session). Convergence under beat is slices x "
        f"`CHECKPOINTQ_RECONCILE_INTERVAL_SECONDS` ({interval:g} s by default). Calls are "
        "Redis's own timings, every node: counts and p99.9 from `LATENCY HISTOGRAM` "
        "(power-of-two buckets: upper bounds), calls over 5 ms from SLOWLOG at 5,000 us. Both "
        "are wall time: the last column says how often the kernel preempted the servers' "
        "main threads during the passes, and how long they then waited for a CPU, time "
        "that lands inside whatever command was running.",
        "",
        "| deployment | sessions | slices per pass | pass, s (back to back) | **items/s** | "
        "longest slice, s | **convergence under beat** | calls | p99.9 call | "
        "longest call | **server-side calls > 5 ms** | servers preempted / waiting for a CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        convergence = r.slices.median * interval
        longest = (
            f"{r.longest_call_ms:.2f} ms ({r.longest_call})"
            if r.calls_over_target
            else f"<= {r.longest_bucket_ms:.3g} ms"
        )
        lines.append(
            f"| {r.deployment} | {r.sessions:,} | {r.slices.median:,.0f} | "
            f"{r.pass_seconds.fmt('.1f')} | **{r.items_per_second.fmt()}** | "
            f"{r.longest_slice_seconds:.2f} | **{convergence / 60:,.1f} min** | {r.calls:,} | "
            f"<= {r.p999_call_ms:.3g} ms | {longest} | **{r.calls_over_target:,}** | "
            f"{r.preempted:,} times / {r.waited_seconds:.1f} s |"
        )
    worst = max(r.calls_over_target for r in results)
    longest_ms = max(
        r.longest_call_ms if r.calls_over_target else r.longest_bucket_ms for r in results
    )
    report.targets += [
        Target(
            "Redis calls over 5 ms during a reconciliation pass, server-side (all rows)",
            "0",
            f"{worst:,} (longest {longest_ms:.3g} ms)",
            None if config.quick else worst == 0,
        ),
    ]
    for r in results:
        report.targets.append(
            Target(
                f"reconciliation pass over {r.sessions:,} sessions, {r.deployment} (back to back)",
                "reported",
                f"{r.pass_seconds.median:,.1f} s, {r.items_per_second.median:,.0f} items/s",
                None,
            )
        )
