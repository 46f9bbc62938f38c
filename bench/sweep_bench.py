"""Sweep section: ``RedisStore.expire_stale`` against a seed-style ``SCAN MATCH <prefix>:*``.

The keyspace holds N sessions in the store's own layout (data key, fence hash, deadline
index) beside 1M unrelated keys (``DEBUG POPULATE``). Writing a million sessions through
``save.lua`` would take minutes, so they are written with pipelined ``SET PX`` / ``HSET`` /
``PEXPIRE`` / ``ZADD``: the very structures, fields and TTLs ``save.lua`` writes, with key
names from ``checkpointq.store.keys`` (checked against a real ``save`` before measuring).

The "longest call" is Redis's own account: ``SLOWLOG`` with ``slowlog-log-slower-than 0``
on the private server records how long Redis executed every command of the sweep, a Lua
script counting as one command. That is the time Redis is blocked for other clients. It
excludes network and client time, which block nobody but the sweeper.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore, StoreOptions

#: Sessions per pipeline while populating; the index gets one ZADD per batch.
POPULATE_BATCH = 2_000
#: What the beat's sweep task passes (worker setting ``sweep_limit``).
SWEEP_LIMIT = 10_000
#: ``SCAN`` page size of the seed's listing (go-redis ``Scan(ctx, cursor, match, 100)``).
SCAN_COUNT = 100
#: Targets of the performance issue.
EMPTY_VS_SCAN_TARGET = 1 / 50
EXPIRATIONS_TARGET = 5_000.0
LONGEST_CALL_TARGET_MS = 5.0

DAY_MS = 24 * 60 * 60 * 1000
#: Lifetime of the sessions staged to go stale: an hour (the sweep is run "two hours later").
STALE_TTL_MS = 60 * 60 * 1000


@dataclass(frozen=True, slots=True)
class Sizes:
    sessions: tuple[int, ...]
    unrelated: int
    stale: int


@dataclass(frozen=True, slots=True)
class CountResult:
    """Everything measured among one number of sessions."""

    sessions: int
    populate_seconds: float
    scan_seconds: Summary
    empty_sweep_seconds: Summary
    stale_sweep_seconds: Summary
    expirations_per_second: Summary
    #: Longest single command Redis executed for the sweep, in ms, and which.
    longest_call_ms: float
    longest_call: str
    #: 99.9th percentile of the same commands, in ms: tells a stall from a pattern.
    p999_call_ms: float

    @property
    def empty_vs_scan(self) -> float:
        return self.empty_sweep_seconds.median / self.scan_seconds.median


def sizes(config: RunConfig) -> Sizes:
    if config.quick:
        return Sizes(sessions=(1_000, 3_000), unrelated=2_000, stale=300)
    return Sizes(sessions=(20_000, 100_000, 1_000_000), unrelated=1_000_000, stale=10_000)


def run(config: RunConfig) -> SectionReport:
    size = sizes(config)
    results = [_measure(n, size, config) for n in size.sessions]
    report = SectionReport("sweep", "Sweep: expire_stale vs a seed-style SCAN listing")
    _write(report, results, size, config)
    return report


class Population:
    """Writes sessions exactly as ``save.lua`` would, many per pipelined round trip."""

    def __init__(self, store: RedisStore, client: redis.Redis) -> None:
        self.store = store
        self.client = client
        # One small but real checkpoint value for every session: SCAN and the sweep never
        # read values, and a million distinct ones would only slow the populating down.
        self.value = store.encode(make_checkpoint("bench", 500)).value
        self.fence_extra_ms = int(store.options.tombstone_ttl_seconds * 1000)

    def write(self, ids: Sequence[str], ttl_ms: int) -> None:
        keys = self.store.keys
        index = keys.index()
        now_ms = int(time.time() * 1000)
        seq = now_ms * 1000
        deadline = now_ms + ttl_ms
        for start in range(0, len(ids), POPULATE_BATCH):
            batch = ids[start : start + POPULATE_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for session_id in batch:
                fence = keys.fence(session_id)
                # PXAT: the value's expiry is then exactly the 'expires' save.lua records.
                pipe.set(keys.data(session_id), self.value, pxat=deadline)
                pipe.hset(
                    fence,
                    mapping={
                        "seq": seq,
                        "deleted": "0",
                        "deadline": deadline,
                        "expires": deadline,
                        "req": "",
                    },
                )
                pipe.pexpire(fence, ttl_ms + self.fence_extra_ms)
            pipe.zadd(index, dict.fromkeys(batch, deadline))
            pipe.execute()

    def check_layout(self, populated_id: str) -> None:
        """Refuse to measure if populated sessions differ from what ``save`` writes."""
        reference = make_checkpoint("bench-reference", 500)
        self.store.save(reference)
        try:
            mine = self._shape(populated_id)
            real = self._shape(reference.session_id)
        finally:
            self.store.delete(reference.session_id)
            self.client.delete(self.store.keys.fence(reference.session_id))
        if mine != real:
            raise RuntimeError(f"populated layout {mine} differs from save.lua's {real}")

    def _shape(self, session_id: str) -> tuple[Any, ...]:
        keys = self.store.keys.session(session_id)
        return (
            self.client.type(keys.data),
            self.client.pttl(keys.data) > 0,
            self.client.type(keys.fence),
            sorted(self.client.hkeys(keys.fence)),
            self.client.pttl(keys.fence) > self.client.pttl(keys.data),
            self.client.zscore(keys.index, session_id) is not None,
        )


def _measure(sessions: int, size: Sizes, config: RunConfig) -> CountResult:
    server_args = ("--enable-debug-command", "local", "--slowlog-max-len", "1000000")
    with private_redis(*server_args) as client:
        # 30-day sessions, as in production; the store's own key layout and default prefix.
        store = RedisStore(client, options=StoreOptions())
        population = Population(store, client)
        started = time.perf_counter()
        # redis-py has no typed wrapper for DEBUG POPULATE (keys unrelated:0, unrelated:1...).
        client.execute_command(  # type: ignore[no-untyped-call]
            "DEBUG", "POPULATE", size.unrelated, "unrelated", 100
        )
        live = [f"live-{i:07d}" for i in range(sessions - size.stale)]
        population.write(live, 30 * DAY_MS)
        populate_seconds = time.perf_counter() - started
        population.check_layout(live[0])

        scans, empties, sweeps, rates = [], [], [], []
        longest: tuple[float, str] = (0.0, "")
        durations: list[float] = []
        for rep in range(config.repeats):
            stale = [f"stale-{rep}-{i:05d}" for i in range(size.stale)]
            population.write(stale, STALE_TTL_MS)
            scans.append(_scan_listing(client, store, sessions))
            # Nothing stale yet: the sweep's cost among `sessions` sessions finding none.
            with _Slowlog(client) as calls:
                started = time.perf_counter()
                none = store.expire_stale(limit=SWEEP_LIMIT)
                empties.append(time.perf_counter() - started)
            longest = max(longest, _longest(calls))
            durations += [int(e["duration"]) / 1000 for e in calls]
            if none:
                raise RuntimeError(f"the sweep expired {len(none)} live sessions")
            # Two hours later, the staged sessions are stale: one sweep as the beat runs it.
            later = time.time() + 2 * STALE_TTL_MS / 1000
            with _Slowlog(client) as calls:
                started = time.perf_counter()
                expired = store.expire_stale(now=later, limit=SWEEP_LIMIT)
                elapsed = time.perf_counter() - started
            longest = max(longest, _longest(calls))
            durations += [int(e["duration"]) / 1000 for e in calls]
            if sorted(expired) != stale:
                raise RuntimeError(f"expired {len(expired)} sessions, staged {len(stale)}")
            sweeps.append(elapsed)
            rates.append(len(expired) / elapsed)
    return CountResult(
        sessions,
        populate_seconds,
        summarize(scans),
        summarize(empties),
        summarize(sweeps),
        summarize(rates),
        longest[0],
        longest[1],
        percentile(durations, 99.9) if durations else 0.0,
    )


def _scan_listing(client: redis.Redis, store: RedisStore, expected: int) -> float:
    """Seconds for the Go seed's ``List``: SCAN MATCH ``<prefix>:*`` over the keyspace."""
    pattern = store.keys.data_pattern()
    started = time.perf_counter()
    ids = [
        store.keys.session_id_from_data_key(key.decode())
        for key in client.scan_iter(match=pattern, count=SCAN_COUNT)
    ]
    elapsed = time.perf_counter() - started
    if len(set(ids)) != expected:
        raise RuntimeError(f"SCAN listed {len(set(ids))} sessions, expected {expected}")
    return elapsed


class _Slowlog:
    """Record every command Redis executes inside the block (SLOWLOG, threshold 0 us)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.entries: list[dict[str, Any]] = []

    def __enter__(self) -> list[dict[str, Any]]:
        self.client.config_set("slowlog-log-slower-than", 0)
        self.client.slowlog_reset()
        return self.entries

    def __exit__(self, *exc: object) -> None:
        self.client.config_set("slowlog-log-slower-than", -1)
        entries = self.client.slowlog_get(-1)
        self.entries.extend(
            e for e in entries if not _command(e).upper().startswith(("SLOWLOG", "CONFIG"))
        )


def _command(entry: dict[str, Any]) -> str:
    command = entry.get("command", b"")
    return command.decode(errors="replace") if isinstance(command, bytes) else str(command)


def _longest(entries: list[dict[str, Any]]) -> tuple[float, str]:
    if not entries:
        return (0.0, "")
    top = max(entries, key=lambda e: int(e["duration"]))
    words = _command(top).split()
    # Name the command and its size, not its arguments (keys, values).
    label = words[0] if words else "?"
    if label.upper() in ("EVALSHA", "EVAL"):
        label += " (a store script)"
    elif label.upper() == "ZRANGE" and len(words) > 1:
        label += " BYSCORE LIMIT (the stale-id lookup)"
    return (int(top["duration"]) / 1000, label)


def _write(
    report: SectionReport, results: list[CountResult], size: Sizes, config: RunConfig
) -> None:
    lines = report.lines
    lines += [
        f"Each row: one private redis-server holding N sessions beside {size.unrelated:,} "
        f"unrelated keys; {size.stale:,} of the N are stale in each of {config.repeats} "
        "repetitions (re-staged each time). The sweep is one "
        f"`RedisStore.expire_stale(limit={SWEEP_LIMIT:,})` call, what the beat's sweep task "
        "runs (the task adds a lock and one XADD event per expired session). The baseline "
        f"lists the same keyspace as the Go seed does: `SCAN MATCH <prefix>:* COUNT "
        f"{SCAN_COUNT}` until the cursor returns to 0. Sessions were written with pipelines "
        "in `save.lua`'s exact layout (checked against a real `save`), not through the "
        "script, to populate a million in seconds.",
        "",
        "| sessions | populate s | SCAN listing s | sweep, nothing stale | **nothing stale / "
        f"SCAN** | sweep of {size.stale:,} stale, s | **expirations/s** | **longest call** | "
        "p99.9 call |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.sessions:,} | {r.populate_seconds:.1f} | {r.scan_seconds.fmt('.3f')} | "
            f"{r.empty_sweep_seconds.fmt('.5f')} s | **1/{1 / r.empty_vs_scan:,.0f}** | "
            f"{r.stale_sweep_seconds.fmt('.3f')} | **{r.expirations_per_second.fmt()}** | "
            f"**{r.longest_call_ms:.2f} ms** ({r.longest_call}) | {r.p999_call_ms:.3f} ms |"
        )
    lines += [
        "",
        "The longest call is the longest single command Redis executed for any sweep of the "
        "row (SLOWLOG at a 0 us threshold on the private server, so every command is "
        "recorded): a store script counts as one command. Pipelining sends many commands "
        "per round trip, but Redis still runs them one by one and serves other clients "
        "between reads of the pipeline, so the single command is what blocks others. "
        "Redis 7 also logs the commands a script runs, each inside its script's time. "
        "SLOWLOG measures wall time: on a busy 2-core machine a command during which the "
        "server was descheduled shows up as a stall of a few ms; the p99.9 column shows "
        "whether the longest call is such an outlier or the norm (it is the lookup of "
        "stale ids, `ZRANGE BYSCORE LIMIT`, that is the largest by design: about 0.3 ms "
        f"for {SWEEP_LIMIT:,} ids).",
    ]
    biggest = results[-1]
    quick = config.quick
    report.targets += [
        Target(
            f"sweep with nothing stale among {biggest.sessions:,} sessions vs SCAN",
            "<= 1/50 of SCAN",
            f"1/{1 / biggest.empty_vs_scan:,.0f}",
            None if quick else biggest.empty_vs_scan <= EMPTY_VS_SCAN_TARGET,
        ),
        Target(
            f"expirations/s, {size.stale:,} stale among {biggest.sessions:,}",
            f">= {EXPIRATIONS_TARGET:,.0f}/s",
            biggest.expirations_per_second.fmt(),
            None if quick else biggest.expirations_per_second.median >= EXPIRATIONS_TARGET,
        ),
        Target(
            "longest single Redis call of a sweep (all rows)",
            f"<= {LONGEST_CALL_TARGET_MS:g} ms",
            f"{max(r.longest_call_ms for r in results):.2f} ms",
            None if quick else max(r.longest_call_ms for r in results) <= LONGEST_CALL_TARGET_MS,
        ),
    ]
    _plot(report, results, config)


def _plot(report: SectionReport, results: list[CountResult], config: RunConfig) -> None:
    from bench import plots

    plots.lines(
        config.out_dir / "sweep_time.png",
        "Sweep vs SCAN listing, by number of sessions (plus unrelated keys)",
        [r.sessions for r in results],
        {
            "SCAN MATCH listing (seed)": [r.scan_seconds for r in results],
            "expire_stale, nothing stale": [r.empty_sweep_seconds for r in results],
            "expire_stale, stale batch": [r.stale_sweep_seconds for r in results],
        },
        "sessions",
        "seconds (log)",
    )
    report.plots.append("sweep_time.png")
