"""Reconcile section: how fast the reconciliation pass converges, and what it costs Redis.

The keyspace holds N sessions in the store's own layout (written as the sweep section
writes them, checked against a real ``save``) beside 1M unrelated keys; before each pass,
1% of N more are written as a Go ``RedisStore`` writes them (``SET EX 30 d``, no index
entry) and 1% of the indexed sessions lose their value (a Go ``DEL``). One pass is what beat
runs one slice at a time: ``RedisStore.reconcile(budget)`` with the worker's default budget,
here back to back until a slice completes the pass (beat spaces the slices by
``CHECKPOINTQ_RECONCILE_INTERVAL_SECONDS``; convergence time = slices x interval).

"Longest call" is Redis's own account: SLOWLOG on the private server at a 0 us threshold,
read and reset after every slice, so every command of the pass is recorded (a script counts
as one command; Redis 7 also logs the commands inside it). SLOWLOG measures wall time: on a
busy 2-core machine a command during which redis-server was descheduled shows up as a stall,
so the p99.9 and the count of calls over 5 ms are given beside the maximum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from bench.harness import (
    RunConfig,
    SectionReport,
    Summary,
    Target,
    percentile,
    private_redis,
    summarize,
)
from bench.sweep_bench import Population, _command
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore, StoreOptions
from checkpointq.worker.settings import Settings

DAY_MS = 24 * 60 * 60 * 1000
GO_TTL_SECONDS = 30 * 24 * 60 * 60
LONGEST_CALL_TARGET_MS = 5.0
#: Every command is recorded by SLOWLOG during a pass.
SLOWLOG_THRESHOLD_US = 0


@dataclass(frozen=True, slots=True)
class Sizes:
    sessions: tuple[int, ...]
    unrelated: int


@dataclass(frozen=True, slots=True)
class PassResult:
    sessions: int
    foreign: int
    budget: int
    slices: Summary
    pass_seconds: Summary
    items_per_second: Summary
    longest_call_ms: float
    longest_call: str
    p999_call_ms: float
    calls: int
    calls_over_target: int
    longest_slice_seconds: float


def sizes(config: RunConfig) -> Sizes:
    if config.quick:
        return Sizes(sessions=(2_000,), unrelated=2_000)
    return Sizes(sessions=(1_000_000,), unrelated=1_000_000)


def run(config: RunConfig) -> SectionReport:
    size = sizes(config)
    budget = Settings.model_fields["reconcile_budget"].default
    interval = Settings.model_fields["reconcile_interval_seconds"].default
    results = [_measure(n, size, budget, config) for n in size.sessions]
    report = SectionReport("reconcile", "Reconcile: a full pass beside Go writers")
    _write(report, results, size, budget, interval, config)
    return report


def _measure(sessions: int, size: Sizes, budget: int, config: RunConfig) -> PassResult:
    server_args = ("--enable-debug-command", "local", "--slowlog-max-len", "1000000")
    foreign = max(1, sessions // 100)
    with private_redis(*server_args) as client:
        store = RedisStore(client, options=StoreOptions())
        population = Population(store, client)
        client.execute_command(  # type: ignore[no-untyped-call]
            "DEBUG", "POPULATE", size.unrelated, "unrelated", 100
        )
        live = [f"live-{i:07d}" for i in range(sessions)]
        population.write(live, 30 * DAY_MS)
        population.check_layout(live[0])
        slices, seconds, rates, slowest = [], [], [], []
        durations: list[float] = []
        longest: tuple[float, str] = (0.0, "")
        repeats = config.repeats if sessions <= 100_000 else min(config.repeats, 2)
        for rep in range(repeats):
            go_only = [f"go-{rep}-{i:07d}" for i in range(foreign)]
            deleted = live[rep * foreign : (rep + 1) * foreign]
            _stage(client, store, go_only, deleted)
            count, elapsed, examined, call, slice_max = _one_pass(client, store, budget, durations)
            # As many Go-only sessions adopted as values deleted: N entries again.
            indexed = client.zcard(store.keys.index())
            if indexed != sessions:
                raise RuntimeError(f"after the pass {indexed} sessions are indexed, not {sessions}")
            slices.append(float(count))
            seconds.append(elapsed)
            rates.append(examined / elapsed)
            slowest.append(slice_max)
            longest = max(longest, call)
    return PassResult(
        sessions,
        foreign,
        budget,
        summarize(slices),
        summarize(seconds),
        summarize(rates),
        longest[0],
        longest[1],
        percentile(durations, 99.9),
        len(durations),
        sum(1 for d in durations if d > LONGEST_CALL_TARGET_MS),
        max(slowest),
    )


def _stage(client: redis.Redis, store: RedisStore, go_only: list[str], deleted: list[str]) -> None:
    """Go's writes behind our back: values without index entries, and DELs of our values."""
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


def _one_pass(
    client: redis.Redis, store: RedisStore, budget: int, durations: list[float]
) -> tuple[int, float, int, tuple[float, str], float]:
    client.config_set("slowlog-log-slower-than", SLOWLOG_THRESHOLD_US)
    client.slowlog_reset()
    count = examined = 0
    longest: tuple[float, str] = (0.0, "")
    slice_max = 0.0
    total = 0.0
    try:
        while True:
            started = time.perf_counter()
            report = store.reconcile(budget)
            elapsed = time.perf_counter() - started
            total += elapsed
            slice_max = max(slice_max, elapsed)
            count += 1
            examined += report.examined
            entries = client.slowlog_get(-1)
            client.slowlog_reset()
            for entry in entries:
                name = _command(entry).split(" ")[0].upper()
                if name in ("SLOWLOG", "CONFIG"):
                    continue
                label = "a store script" if name in ("EVAL", "EVALSHA") else name
                durations.append(int(entry["duration"]) / 1000)
                longest = max(longest, (durations[-1], label))
            if report.completed_pass:
                break
    finally:
        client.config_set("slowlog-log-slower-than", -1)
    return count, total, examined, longest, slice_max


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
        f"Each row: one private redis-server holding N sessions beside {size.unrelated:,} "
        "unrelated keys; before each pass 1% of N are written as Go writes them (adopted by "
        "the pass) and 1% of the indexed ones are deleted as Go deletes them (dropped). A "
        f"pass is `RedisStore.reconcile({budget:,})` slices back to back (the default "
        "`CHECKPOINTQ_RECONCILE_BUDGET`) until one completes it: a SCAN of the data keys, "
        "then a ZSCAN of the index, one script per key found. Items are the keys and index "
        "entries the pass looked at (about 2 per session). Convergence under beat is "
        f"slices x `CHECKPOINTQ_RECONCILE_INTERVAL_SECONDS` ({interval:g} s by default).",
        "",
        "| sessions | slices per pass | pass, s (back to back) | **items/s** | longest slice, s "
        "| **convergence under beat** | **longest call** | p99.9 call | calls > 5 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        convergence = r.slices.median * interval
        lines.append(
            f"| {r.sessions:,} | {r.slices.median:,.0f} | {r.pass_seconds.fmt('.1f')} | "
            f"**{r.items_per_second.fmt()}** | {r.longest_slice_seconds:.2f} | "
            f"**{convergence / 60:,.1f} min** | **{r.longest_call_ms:.2f} ms** "
            f"({r.longest_call}) | {r.p999_call_ms:.3f} ms | "
            f"{r.calls_over_target:,} of {r.calls:,} |"
        )
    biggest = results[-1]
    worst = max(r.longest_call_ms for r in results)
    report.targets += [
        Target(
            "longest single Redis call of a reconciliation pass (all rows)",
            f"<= {LONGEST_CALL_TARGET_MS:g} ms",
            f"{worst:.2f} ms",
            None if config.quick else worst <= LONGEST_CALL_TARGET_MS,
        ),
        Target(
            f"reconciliation pass over {biggest.sessions:,} sessions (back to back)",
            "reported",
            f"{biggest.pass_seconds.median:,.1f} s, {biggest.items_per_second.median:,.0f} items/s",
            None,
        ),
    ]
