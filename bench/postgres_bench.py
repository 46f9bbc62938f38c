"""PostgreSQL section: our queue in front of PostgreSQL against writing to it directly.

Everything runs on private servers: a PostgreSQL (``tests/support/postgres.py``: fsync and
``synchronous_commit`` on, as a deployment pays its commits) and a broker redis-server.
Each figure is compared with the plain alternative a team would write instead, measured
in the same run, repetitions interleaved:

* **producer save**: our producer's save (``CheckpointClient.save``: a staged save and its
  pending record, one round trip to the broker on loopback) against a synchronous
  ``PostgresStore.save`` on one connection (the fenced single-row upsert, one call of
  ``{schema}.apply``), p50 per call of the same 20 KB checkpoint;
* **worker drain**: our production worker (prefork -c 2, coalescing as deployed) draining
  queued staged single saves into PostgreSQL (``bench/worker_drain.py``), against a loop of
  ``PostgresStore.save`` on one connection and eight such loops in parallel processes, each
  saving as many fresh sessions, in saves/s; with the write transactions each way commits
  and the CPU it spends per save;
* **sessions**: a million sessions (populated with one ``INSERT ... SELECT``), a sweep
  (``PostgresStore.expire_stale``) finding nothing stale, and expirations/s of sweeps with
  ``limit=1000`` repeated until none is left.

The first two run twice: on loopback, and with the database 1 ms of round trip away
(``bench/delay_proxy.py`` in front of PostgreSQL; the broker stays on loopback, near the
API servers, as a managed database is the far one).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench import worker_drain
from bench.delay_proxy import delay_proxy
from bench.harness import (
    RunConfig,
    SectionReport,
    Summary,
    Target,
    percentile,
    summarize,
    time_calls,
)
from bench.workload import make_checkpoint
from checkpointq.store.model import Checkpoint
from checkpointq.store.postgres import PostgresStore
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.celery_processes import CeleryProcess
from tests.support.postgres import PostgresServer, postgres_bin
from tests.support.servers import RedisServer

SIZE = 20_000
QUEUE = worker_drain.QUEUE
DATABASE = "bench"
#: The deployment's schema (the worker's default) and the sessions part's own.
SCHEMA = "checkpointq"
SWEEP_SCHEMA = "sweep"
#: The same sessions in a table hash-partitioned PARTITIONS ways (docs/scaling.md).
PARTED_SCHEMA = "sweep_parted"
PARTITIONS = 4
#: Added round trip the far database is given, and the proxy's first try at it.
TARGET_RTT_MS = 1.0
LINKS = ("loopback", "1 ms RTT")
#: Parallel loops of the second baseline, each a process with its own connection.
LOOPS = 8
#: Seconds an idle worker is watched for the write transactions it commits by itself.
IDLE_SECONDS = 3.0
SWEEP_LIMIT = 1_000
DAY_MS = 24 * 60 * 60 * 1000

PRODUCER = "CheckpointClient.save (queued)"
DIRECT = "PostgresStore.save (synchronous upsert)"
DRAIN = "our worker, prefork -c 2, coalescing (default)"
LOOP = "loop of PostgresStore.save, 1 connection"
PARALLEL = f"{LOOPS} such loops in parallel processes"
WAYS = (DRAIN, LOOP, PARALLEL)
DB_CLOCK = "expire_stale() (database clock, as the beat runs it)"
GIVEN_NOW = "expire_stale(now=...) (a given time)"

#: Targets of the performance issue (32), per link.
PRODUCER_TARGETS = {LINKS[0]: 0.5, LINKS[1]: 0.2}
LOOP_TARGET = 5.0
PARALLEL_TARGET = 2.0
EMPTY_SWEEP_TARGET_MS = 5.0
EXPIRATIONS_TARGET = 5_000.0


@dataclass(frozen=True, slots=True)
class Sizes:
    calls: int
    messages: int
    sessions: int
    stale: int


def sizes(config: RunConfig) -> Sizes:
    if config.quick:
        return Sizes(calls=50, messages=60, sessions=2_000, stale=500)
    return Sizes(calls=1_000, messages=3_000, sessions=1_000_000, stale=100_000)


@dataclass(frozen=True, slots=True)
class Rtt:
    """The proxy's delay per direction, and ``SELECT 1`` p50s directly and through it."""

    delay_ms: float
    direct_us: Summary
    proxied_us: Summary
    added_us: Summary


@dataclass(frozen=True, slots=True)
class Commits:
    """p50 microseconds of a one-row write committed with ``synchronous_commit`` on and
    off: their difference is what waiting for the WAL flush costs on this disk."""

    on_us: Summary
    off_us: Summary


def _commits(url: str, config: RunConfig) -> Commits:
    calls = 100 if config.quick else 500
    write = (
        "INSERT INTO bench_commits VALUES (1, 0) ON CONFLICT (id) DO UPDATE SET"
        " n = bench_commits.n + 1"
    )
    on: list[float] = []
    off: list[float] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_commits (id int PRIMARY KEY, n bigint)")
        for _ in range(config.repeats):
            for setting, found in (("on", on), ("off", off)):
                conn.execute(f"SET synchronous_commit = {setting}")
                found.append(percentile(time_calls(lambda _: conn.execute(write), calls), 50))
        conn.execute("DROP TABLE bench_commits")
    return Commits(summarize(on), summarize(off))


@dataclass(frozen=True, slots=True)
class Latencies:
    p50: dict[str, Summary]
    p99: dict[str, Summary]


@dataclass
class Drains:
    """Saves/s, write transactions per save and CPU per save of each way, per repetition."""

    rates: dict[str, list[float]]
    saves_per_xact: dict[str, list[float]]
    cpu_us: dict[str, dict[str, list[float]]]
    idle_xacts_per_second: float
    applied: int
    loads: list[float]


@dataclass(frozen=True, slots=True)
class Sweeps:
    populate_seconds: float
    empty_ms: dict[str, Summary]
    expirations: dict[str, Summary]
    plans: dict[str, str]
    #: Each stale sweep: its way, the rows holding only a fence when it began, expirations/s.
    runs: list[tuple[str, int, float]]


def run(config: RunConfig) -> SectionReport:
    report = SectionReport("postgres", "PostgreSQL: queued saves against synchronous upserts")
    if postgres_missing(report):
        return report
    size = sizes(config)
    pg = PostgresServer().start()
    broker = RedisServer().start()
    try:
        direct_url = pg.create_database(DATABASE)
        PostgresStore(direct_url, schema=SCHEMA).ping()  # the schema, made once
        commits = _commits(direct_url, config)
        with _calibrated_proxy(pg, direct_url, config) as (proxied_url, rtt):
            urls = {LINKS[0]: direct_url, LINKS[1]: proxied_url}
            latencies = {
                link: _save_latencies(broker, url, size.calls, config) for link, url in urls.items()
            }
            drains = {
                link: _drains(broker, pg, url, direct_url, link, size.messages, config)
                for link, url in urls.items()
            }
            rtt_after = _measure_rtt(direct_url, proxied_url, rtt.delay_ms, config)
        sweeps = _sweeps(direct_url, size, config, SWEEP_SCHEMA)
        parted = _sweeps(direct_url, size, config, PARTED_SCHEMA, partitions=PARTITIONS)
        version = pg.psql("SHOW server_version")
    finally:
        broker.cleanup()
        pg.cleanup()
    _write_setup(report, config, rtt, rtt_after, commits, version)
    _write_latencies(report, latencies, size, config)
    _write_drains(report, drains, size, config)
    _write_sweeps(report, sweeps, size, config)
    _write_parted(report, sweeps, parted, size)
    return report


def postgres_missing(report: SectionReport) -> bool:
    """Whether PostgreSQL's server programs are missing (then ``report`` says so)."""
    if postgres_bin() is not None:
        return False
    report.lines.append(
        "Not measured: PostgreSQL's server programs are missing (apt-get install postgresql)."
    )
    return True


# -- the far database ------------------------------------------------------------------


def _url(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{DATABASE}"


def _select_one_p50(url: str, calls: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(20):
            conn.execute("SELECT 1").fetchone()
        return percentile(time_calls(lambda _: conn.execute("SELECT 1").fetchone(), calls), 50)


def _measure_rtt(direct: str, proxied: str, delay_ms: float, config: RunConfig) -> Rtt:
    """``SELECT 1`` p50 through the proxy and directly, interleaved repetitions."""
    calls = 100 if config.quick else 500
    straight, through = [], []
    for _ in range(config.repeats):
        straight.append(_select_one_p50(direct, calls))
        through.append(_select_one_p50(proxied, calls))
    added = [b - a for a, b in zip(straight, through, strict=True)]
    return Rtt(delay_ms, summarize(straight), summarize(through), summarize(added))


@contextmanager
def _calibrated_proxy(
    pg: PostgresServer, direct: str, config: RunConfig
) -> Iterator[tuple[str, Rtt]]:
    """A delay proxy in front of ``pg`` adding about ``TARGET_RTT_MS`` of round trip.

    Sleeping threads overshoot (the scheduler's wake-up, the hand-over between the
    proxy's reader and writer): the first try, half the target each way, is measured,
    and the delay set once more so that what ``SELECT 1`` sees comes close to the target.
    """
    delay_ms = TARGET_RTT_MS / 2
    with delay_proxy(pg.port, delay_ms) as port:
        first = _measure_rtt(direct, _url(port), delay_ms, config)
    overshoot_ms = first.added_us.median / 1000 - TARGET_RTT_MS
    if abs(overshoot_ms) > 0.05:
        delay_ms = max(0.0, delay_ms - overshoot_ms / 2)
    with delay_proxy(pg.port, delay_ms) as port:
        yield _url(port), _measure_rtt(direct, _url(port), delay_ms, config)


# -- producer saves --------------------------------------------------------------------


def _save_latencies(broker: RedisServer, url: str, calls: int, config: RunConfig) -> Latencies:
    """p50 and p99 per repetition of our producer's save and of a synchronous upsert."""
    raw = broker.client()
    store = PostgresStore(url, schema=SCHEMA)
    # As a deployment's producer is made (from_settings): the PostgreSQL store, which a
    # save never reaches (it goes to the broker), and the broker's pending records.
    client = CheckpointClient(broker.url, PostgresStore(url, schema=SCHEMA), queue=QUEUE)
    checkpoints = [make_checkpoint(f"p{i}", SIZE) for i in range(32)]
    ways: dict[str, Callable[[int], object]] = {
        PRODUCER: lambda i: client.save(checkpoints[i % 32]),
        DIRECT: lambda i: store.save(checkpoints[i % 32]),
    }
    p50: dict[str, list[float]] = {w: [] for w in ways}
    p99: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for way in ways.values():  # warm up: connections, scripts, the rows
            for i in range(32):
                way(i)
        for rep in range(config.repeats):
            for name in (PRODUCER, DIRECT) if rep % 2 == 0 else (DIRECT, PRODUCER):
                raw.flushdb()  # nothing consumes the queue: the staged values go
                micros = time_calls(ways[name], calls)
                p50[name].append(percentile(micros, 50))
                p99[name].append(percentile(micros, 99))
        raw.flushdb()
    finally:
        client.close()
        store.close()
        raw.close()
    return Latencies(
        {w: summarize(v) for w, v in p50.items()}, {w: summarize(v) for w, v in p99.items()}
    )


# -- worker drains and loops -----------------------------------------------------------


def _next_xid(conn: psycopg.Connection[Any]) -> int:
    """The next transaction id the server will assign: each write transaction takes one
    (reads take none), so the difference of two readings counts write transactions."""
    row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    return int(row[0]) if row else 0


def _children(pid: int) -> list[int]:
    try:
        return [
            int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        ]
    except (FileNotFoundError, ProcessLookupError):  # it ended since it was listed
        return []


def _reaped_cpu(pid: int) -> float:
    """CPU seconds of the children ``pid`` has waited for (Linux /proc: cutime + cstime):
    the postmaster's backends that ended, whose own entries are gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def _cpu_of(pids: list[int]) -> dict[int, float]:
    found = {}
    for pid in pids:
        try:
            found[pid] = worker_drain.cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):  # a backend that ended since listed
            continue
    return found


class _Cpu:
    """CPU seconds of a worker's processes, the broker, and every PostgreSQL process (its
    backends come and go: each reading lists them afresh, and counts those that ended
    through the postmaster's reaped children, under the key -1)."""

    PARTS = ("main", "pool", "broker", "postgres")

    def __init__(self, worker: CeleryProcess | None, broker: RedisServer, pg: PostgresServer):
        self.main = worker.process.pid if worker and worker.process else None
        self.broker = broker.process.pid if broker.process else None
        self.postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])

    def read(self) -> dict[str, dict[int, float]]:
        main = [self.main] if self.main else []
        return {
            "main": _cpu_of(main),
            "pool": _cpu_of([c for m in main for c in _children(m)]),
            "broker": _cpu_of([self.broker] if self.broker else []),
            "postgres": {
                **_cpu_of([self.postmaster, *_children(self.postmaster)]),
                -1: _reaped_cpu(self.postmaster),
            },
        }

    @staticmethod
    def spent(
        before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
    ) -> dict[str, float]:
        return {
            part: sum(t - before[part].get(pid, 0.0) for pid, t in after[part].items())
            for part in _Cpu.PARTS
        }


def _fresh(checkpoints: list[Checkpoint], ids: list[str]) -> list[Checkpoint]:
    return [
        checkpoints[n % len(checkpoints)].model_copy(update={"session_id": i})
        for n, i in enumerate(ids)
    ]


def _loop(url: str, ids: list[str], ready: Any = None) -> tuple[float, float, float]:
    """Save a fresh session per id, one ``PostgresStore.save`` after another on one
    connection, starting at ``ready``'s release when given (a barrier): (start, end, CPU
    seconds of this process)."""
    store = PostgresStore(url, schema=SCHEMA)
    checkpoints = _fresh([make_checkpoint(f"loop-t{n}", SIZE) for n in range(16)], ids)
    store.ping()  # connected before the clock starts
    if ready is not None:
        ready.wait(timeout=120)
    cpu = time.process_time()
    start = time.perf_counter()
    for checkpoint in checkpoints:
        store.save(checkpoint)
    end = time.perf_counter()
    cpu = time.process_time() - cpu
    store.close()
    return start, end, cpu


def _loop_child(url: str, ids: list[str], ready: Any, results: Any) -> None:
    """One of the parallel loops: ready, then saving at the barrier's release."""
    results.put(_loop(url, ids, ready))


def _parallel_loops(
    url: str, ids: list[str], meter: _Cpu
) -> tuple[float, float, dict[str, dict[int, float]]]:
    """``LOOPS`` processes (forked), each saving its share of ``ids`` with its own
    connection, released together: (seconds from the first start to the last end, their
    CPU seconds, ``meter`` read as they were released, their connections made)."""
    context = multiprocessing.get_context("fork")
    ready = context.Barrier(LOOPS + 1)
    results = context.Queue()
    processes = [
        context.Process(target=_loop_child, args=(url, ids[k::LOOPS], ready, results))
        for k in range(LOOPS)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait(timeout=120)
        released = meter.read()
        done = [results.get(timeout=600) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError("a parallel loop failed")
    elapsed = max(d[1] for d in done) - min(d[0] for d in done)
    return elapsed, sum(d[2] for d in done), released


def _drains(
    broker: RedisServer,
    pg: PostgresServer,
    url: str,
    admin_url: str,
    link: str,
    messages: int,
    config: RunConfig,
) -> Drains:
    """Our worker on ``url`` draining ``messages`` staged saves, and both loops saving as
    many fresh sessions, interleaved; the table emptied before each."""
    repeats = 1 if config.quick else min(config.repeats, 3)
    client = broker.client()
    client.flushdb()
    admin = psycopg.connect(admin_url, autocommit=True)
    found = Drains(
        {w: [] for w in WAYS},
        {w: [] for w in WAYS},
        {w: {p: [] for p in (*_Cpu.PARTS, "total")} for w in WAYS},
        0.0,
        0,
        [],
    )
    ids = [f"loop-{i}" for i in range(messages)]
    try:
        staged = worker_drain.stage(client, "bench-pg-staged", messages, SIZE, "pg", staged=True)
        with worker_drain.running_worker(broker, url) as worker:
            meter = _Cpu(worker, broker, pg)
            xid = _next_xid(admin)
            time.sleep(1.0 if config.quick else IDLE_SECONDS)
            idle = (_next_xid(admin) - xid) / (1.0 if config.quick else IDLE_SECONDS)
            found.idle_xacts_per_second = idle
            for rep in range(repeats):
                for way in WAYS[rep % 3 :] + WAYS[: rep % 3]:
                    admin.execute(f"TRUNCATE {SCHEMA}.sessions")
                    found.loads.append(os.getloadavg()[0])
                    before, xid = meter.read(), _next_xid(admin)
                    if way == DRAIN:
                        rate = staged.rate(client, f"postgres drain, {link}")
                        elapsed = messages / rate
                        found.applied = _count(admin)
                        client_cpu = 0.0
                    elif way == LOOP:
                        start, end, client_cpu = _loop(url, ids)
                        elapsed = end - start
                    else:
                        elapsed, client_cpu, before = _parallel_loops(url, ids, meter)
                    xacts = _next_xid(admin) - xid
                    spent = _Cpu.spent(before, meter.read())
                    if way != DRAIN:  # the idle worker's share is not the loops'
                        spent.update(main=client_cpu, pool=0.0, broker=0.0)
                    xacts_of_way = xacts - idle * elapsed if way == DRAIN else xacts
                    found.rates[way].append(messages / elapsed)
                    found.saves_per_xact[way].append(messages / max(1.0, xacts_of_way))
                    for part, seconds in spent.items():
                        found.cpu_us[way][part].append(seconds * 1e6 / messages)
                    found.cpu_us[way]["total"].append(sum(spent.values()) * 1e6 / messages)
    finally:
        admin.close()
        client.close()
    return found


def _count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(f"SELECT count(*) FROM {SCHEMA}.sessions").fetchone()
    return int(row[0]) if row else 0


# -- a million sessions ----------------------------------------------------------------


def _populate(conn: psycopg.Connection[Any], store: PostgresStore, sessions: int) -> float:
    """``sessions`` live rows as ``{schema}.apply`` writes a save (checked against a real
    one), in one ``INSERT ... SELECT``; seconds, VACUUM ANALYZE included (autovacuum's
    work on a table of that age)."""
    sample = make_checkpoint("bench", 500)
    value = store.encode(sample).value
    metadata = orjson.dumps(sample.metadata.model_dump(mode="json", by_alias=True)).decode()
    now_ms = int(time.time() * 1000)
    deadline = now_ms + store.ttl_ms
    started = time.perf_counter()
    conn.execute(
        f"INSERT INTO {store.schema}.sessions (session_key, session_id, value, value_deadline_ms,"
        " version, last_run_ref, metadata, fence_seq, fence_deleted, fence_request_id,"
        " fence_lapsed, fence_expires_ms)"
        f" SELECT {store.schema}.session_key(id), id, %(value)s, %(deadline)s, %(version)s,"
        " %(ref)s, %(metadata)s::jsonb, %(seq)s, false,"
        " ''::bytea, false, %(expires)s FROM generate_series(0, %(n)s - 1) AS g,"
        " convert_to('live-' || lpad(g::text, 7, '0'), 'UTF8') AS id",
        {
            "value": value,
            "deadline": deadline,
            "version": sample.version,
            "ref": sample.last_run_ref,
            "metadata": metadata,
            "seq": now_ms * 1000,
            "expires": deadline + store.tombstone_ms,
            "n": sessions,
        },
    )
    conn.execute(f"VACUUM ANALYZE {store.schema}.sessions")
    elapsed = time.perf_counter() - started
    _check_layout(conn, store)
    return elapsed


def _shape(conn: psycopg.Connection[Any], schema: str, session_id: bytes) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT value IS NULL, version IS NULL, metadata IS NULL, fence_deleted,"
        " fence_lapsed, fence_expires_ms - value_deadline_ms, fence_seq > 0,"
        " value_deadline_ms - (fence_seq / 1000) BETWEEN 0 AND %s"
        f" FROM {schema}.sessions WHERE session_key = {schema}.session_key(%s)",
        (10 * 60 * 1000 + 30 * DAY_MS, session_id),
    ).fetchone()
    return tuple(row) if row else ()


def _check_layout(conn: psycopg.Connection[Any], store: PostgresStore) -> None:
    """Refuse to measure if populated rows differ from what ``save`` writes."""
    store.save(make_checkpoint("bench-reference", 500))
    schema = store.schema
    mine, real = _shape(conn, schema, b"live-0000000"), _shape(conn, schema, b"bench-reference")
    conn.execute(f"DELETE FROM {schema}.sessions WHERE session_key = 'bench-reference'::bytea")
    if mine != real:
        raise RuntimeError(f"populated row {mine} differs from a saved one {real}")


def _make_stale(conn: psycopg.Connection[Any], schema: str, first: int, count: int) -> None:
    """Sessions ``first`` .. ``first + count - 1`` an hour past their deadline."""
    conn.execute(
        f"UPDATE {schema}.sessions SET value_deadline_ms = %s WHERE session_key >= %s"
        " AND session_key < %s",  # (short ids are their own keys)
        (
            int(time.time() * 1000) - 60 * 60 * 1000,
            f"live-{first:07d}".encode(),
            f"live-{first + count:07d}".encode(),
        ),
    )


def _sweep_all(sweep: Callable[[], list[str]]) -> tuple[int, float]:
    """Sweep until a sweep finds nothing: (expired, seconds, the last sweep included)."""
    expired = 0
    started = time.perf_counter()
    while found := sweep():
        expired += len(found)
    return expired, time.perf_counter() - started


def _plan(conn: psycopg.Connection[Any], schema: str, clock: str) -> str:
    """The plan of the sweep's lookup of due values (node types only)."""
    rows = conn.execute(
        f"EXPLAIN SELECT session_id FROM {schema}.sessions WHERE value IS NOT NULL"
        f" AND value_deadline_ms <= {clock} ORDER BY value_deadline_ms LIMIT 1000"
    ).fetchall()
    nodes = [str(r[0]).strip().lstrip("-> ").split("  (cost")[0] for r in rows]
    return " / ".join(f"`{n}`" for n in nodes if not n.startswith("Sort Key"))


def _sweeps(url: str, size: Sizes, config: RunConfig, schema: str, partitions: int = 0) -> Sweeps:
    """The sweeps in ``schema``; with ``partitions``, its sessions table hash-partitioned
    that many ways first, as docs/scaling.md has an operator do it."""
    repeats = min(config.repeats, 3)
    calls = 3 if config.quick else 5
    conn = psycopg.connect(url, autocommit=True)
    if partitions:
        _partitioned_table(conn, schema, partitions)
    store = PostgresStore(url, schema=schema)
    store.ping()  # the schema
    ways: dict[str, Callable[[], list[str]]] = {
        DB_CLOCK: lambda: store.expire_stale(limit=SWEEP_LIMIT),
        GIVEN_NOW: lambda: store.expire_stale(now=time.time(), limit=SWEEP_LIMIT),
    }
    empty: dict[str, list[float]] = {w: [] for w in ways}
    rates: dict[str, list[float]] = {w: [] for w in ways}
    runs: list[tuple[str, int, float]] = []
    try:
        populate = _populate(conn, store, size.sessions)
        plans = {
            DB_CLOCK: _plan(conn, schema, f"(SELECT {schema}.now_ms())"),
            GIVEN_NOW: _plan(conn, schema, "0"),
        }
        first = 0
        for rep in range(repeats):
            order = list(ways) if rep % 2 == 0 else list(reversed(ways))
            for name in order:
                times = [1000 * _timed(ways[name]) for _ in range(calls)]
                empty[name].append(sorted(times)[len(times) // 2])
            for name in order:
                if first + size.stale > size.sessions:
                    raise RuntimeError("not enough sessions left to make stale")
                _make_stale(conn, schema, first, size.stale)
                fences = _fence_rows(conn, schema)
                first += size.stale
                expired, seconds = _sweep_all(ways[name])
                if expired != size.stale:
                    raise RuntimeError(f"swept {expired} sessions, made {size.stale} stale")
                rates[name].append(expired / seconds)
                runs.append((name, fences, expired / seconds))
    finally:
        conn.close()
        store.close()
    return Sweeps(
        populate,
        {w: summarize(v) for w, v in empty.items()},
        {w: summarize(v) for w, v in rates.items()},
        plans,
        runs,
    )


def _partitioned_table(conn: psycopg.Connection[Any], schema: str, partitions: int) -> None:
    """``{schema}.sessions`` with the columns of ``store/sql/v2.sql``, partitioned by hash of
    the row's key, before the store's upgrade adds the rest."""
    conn.execute(
        f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.sessions (session_key bytea PRIMARY KEY,"
        " session_id bytea NOT NULL, value bytea, value_deadline_ms bigint, version bigint,"
        " last_run_ref text,"
        " metadata jsonb, fence_seq bigint NOT NULL, fence_deleted boolean NOT NULL,"
        " fence_request_id bytea NOT NULL DEFAULT '', fence_lapsed boolean NOT NULL DEFAULT"
        " false, fence_expires_ms bigint NOT NULL, updated_at timestamptz NOT NULL DEFAULT"
        " clock_timestamp()) PARTITION BY HASH (session_key)"
    )
    for n in range(partitions):
        conn.execute(
            f"CREATE TABLE {schema}.sessions_{n} PARTITION OF {schema}.sessions"
            f" FOR VALUES WITH (MODULUS {partitions}, REMAINDER {n})"
        )


def _fence_rows(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {schema}.sessions WHERE value IS NULL")
    found = row.fetchone()
    return int(found[0]) if found else 0


def _timed(fn: Callable[[], list[str]]) -> float:
    started = time.perf_counter()
    if fn():
        raise RuntimeError("a sweep with nothing stale expired sessions")
    return time.perf_counter() - started


# -- the report ------------------------------------------------------------------------


def _write_setup(
    report: SectionReport, config: RunConfig, rtt: Rtt, after: Rtt, commits: Commits, version: str
) -> None:
    report.lines += [
        f"A private PostgreSQL {version} (`tests/support/postgres.py`: fsync and "
        "`synchronous_commit` on, `shared_buffers` 64MB, its data in a temp directory on "
        "this machine's disk) and a private broker redis-server; every figure is the median "
        f"of {config.repeats} interleaved repetitions (worker drains and sweeps: at most 3) "
        "with its min-max. A one-row write commits in "
        f"{commits.on_us.fmt()} us p50 with `synchronous_commit` on, "
        f"{commits.off_us.fmt()} us off: waiting for the WAL flush costs about "
        f"{commits.on_us.median - commits.off_us.median:,.0f} us per commit on this disk.",
        "",
        f"**The far database** ({TARGET_RTT_MS:g} ms of round trip): this kernel has no "
        "`sch_netem` (`tc qdisc add dev lo root netem delay 1ms` in a network namespace "
        "fails: `Specified qdisc kind is unknown`), so a delaying TCP proxy stands in front "
        "of PostgreSQL (`bench/delay_proxy.py`, a process of its own: each chunk is sent on "
        "no earlier than its arrival plus the delay, in order, both ways). Its delay was set "
        f"to {rtt.delay_ms:.3f} ms per direction after a first try at "
        f"{TARGET_RTT_MS / 2:g} ms, so that the round trip it adds comes close to "
        f"{TARGET_RTT_MS:g} ms: `SELECT 1` p50 directly {rtt.direct_us.fmt(',.0f')} us, "
        f"through the proxy {rtt.proxied_us.fmt(',.0f')} us: **{rtt.added_us.fmt(',.0f')} us "
        f"added** (measured again after the drains: {after.added_us.fmt(',.0f')} us). The "
        "broker stays on loopback: it sits near the API servers, the managed database is the "
        "far one.",
    ]


def _write_latencies(
    report: SectionReport, latencies: dict[str, Latencies], size: Sizes, config: RunConfig
) -> None:
    report.lines += [
        "",
        f"### Producer save against a synchronous upsert ({SIZE // 1000} KB checkpoint)",
        "",
        f"{size.calls:,} calls per way per repetition, 32 sessions in turn; p50 and p99 per "
        "repetition. Ours: `CheckpointClient.save` (a staged save: its value and pending "
        "record on the broker, one round trip); the plain alternative: `PostgresStore.save` "
        "on one connection, the fenced single-row upsert (`{schema}.apply`) committed "
        "before it returns.",
        "",
        "| database | way | p50 us | p99 us | **p50 ours / upsert** |",
        "|---|---|---:|---:|---:|",
    ]
    for link, found in latencies.items():
        ratio = found.p50[PRODUCER].median / found.p50[DIRECT].median
        for way in (PRODUCER, DIRECT):
            cell = f"**{ratio:.2f}x**" if way == PRODUCER else ""
            report.lines.append(
                f"| {link} | {way} | {found.p50[way].fmt()} | {found.p99[way].fmt()} | {cell} |"
            )
        goal = PRODUCER_TARGETS[link]
        report.targets.append(
            Target(
                f"postgres: producer save p50 vs PostgresStore.save, {link}",
                f"<= {goal:g}x",
                f"{ratio:.2f}x",
                None if config.quick else ratio <= goal,
            )
        )


def _write_drains(
    report: SectionReport, drains: dict[str, Drains], size: Sizes, config: RunConfig
) -> None:
    loads = [load for d in drains.values() for load in d.loads]
    first = next(iter(drains.values()))
    report.lines += [
        "",
        "### Worker drain into PostgreSQL against loops of upserts",
        "",
        f"The same {size.messages:,} queued `checkpoint.save_staged` messages of a "
        f"{SIZE // 1000} KB checkpoint (our producers' default), released at once "
        "(`bench/worker_drain.py`) and drained by our production worker (prefork -c 2, "
        "coalescing as deployed, `CHECKPOINTQ_STORE_URL=postgresql://...`, broker on "
        f"loopback), one worker per database link; against {size.messages:,} fresh sessions "
        f"saved by a loop of `PostgresStore.save` on one connection, and by {LOOPS} such "
        "loops in parallel processes (each its own connection, its share of the sessions, "
        "released together). The sessions table is emptied before each way: every save "
        f"inserts a row. {len(first.rates[DRAIN])} repetition(s), ways interleaved. "
        f"1-minute load average while measuring: {min(loads):.2f}-{max(loads):.2f}.",
        "",
        "| database | way | saves/s | **vs one loop** | vs parallel loops | saves per "
        "transaction | CPU us/save |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for link, found in drains.items():
        rate = {w: summarize(v) for w, v in found.rates.items()}
        for way in WAYS:
            ratio = rate[way].median / rate[LOOP].median
            versus = rate[way].median / rate[PARALLEL].median
            per_xact = summarize(found.saves_per_xact[way])
            cpu = summarize(found.cpu_us[way]["total"])
            report.lines.append(
                f"| {link} | {way} | {rate[way].fmt()} | **{ratio:.2f}x** | {versus:.2f}x | "
                f"{per_xact.fmt('.1f')} | {cpu.fmt()} |"
            )
        for name, baseline, goal in (
            ("one loop of PostgresStore.save", LOOP, LOOP_TARGET),
            (f"{LOOPS} parallel loops", PARALLEL, PARALLEL_TARGET),
        ):
            ratio = rate[DRAIN].median / rate[baseline].median
            report.targets.append(
                Target(
                    f"postgres: worker drain saves/s vs {name}, {link}",
                    f">= {goal:g}x",
                    f"{ratio:.2f}x",
                    None if config.quick else ratio >= goal,
                )
            )
    report.lines += [
        "",
        "Saves per transaction: write transactions counted by the transaction ids the "
        "server assigned while a way ran (`pg_snapshot_xmax(pg_current_snapshot())` before "
        "and after: each write transaction takes one id, reads take none, and nothing else "
        "writes to this private server), divided into the saves. The worker's own write "
        "probes (one small write a second while idle: "
        + ", ".join(f"{d.idle_xacts_per_second:.1f}/s {link}" for link, d in drains.items())
        + ", watched before the first drain) are subtracted for the drain's duration. "
        "`pg_stat_database.xact_commit` would count the same but lags: each backend flushes "
        "its counts at most once a second, and an idle one up to 10 s later. The loops show "
        "the count is exact (1.0: one commit per `save`).",
        "",
        "CPU per save (user + system from /proc, median over repetitions, microseconds): the "
        "worker's main process, its pool processes, the broker and every PostgreSQL process "
        "for the drain; the loops' own processes (as 'client') and PostgreSQL for the loops. "
        "The delay proxy's CPU is not counted.",
        "",
        "| database | way | worker main / client | pool | broker | postgres | total |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for link, found in drains.items():
        for way in WAYS:
            cells = " | ".join(
                f"{summarize(found.cpu_us[way][p]).median:,.0f}" for p in (*_Cpu.PARTS, "total")
            )
            report.lines.append(f"| {link} | {way} | {cells} |")
    report.lines += [
        "",
        "After each drain the sessions table held "
        + ", ".join(f"{d.applied:,} ({link})" for link, d in drains.items())
        + f" of {size.messages:,} sessions.",
    ]


def _write_sweeps(report: SectionReport, sweeps: Sweeps, size: Sizes, config: RunConfig) -> None:
    report.lines += [
        "",
        f"### Sweeps among {size.sessions:,} sessions",
        "",
        f"{size.sessions:,} live sessions (30-day deadlines) written in one `INSERT ... "
        "SELECT generate_series` with a real encoded 500-byte checkpoint's value, metadata "
        "and fence, checked column by column against a row `PostgresStore.save` wrote, then "
        f"`VACUUM ANALYZE` (what autovacuum does to a table that age): "
        f"{sweeps.populate_seconds:.1f} s. Nothing stale: the median of {3 if config.quick else 5} "
        "sweeps per repetition. Stale: "
        f"{size.stale:,} sessions (a fresh set each time) moved an hour past their deadline "
        f"with one UPDATE, then `expire_stale(limit={SWEEP_LIMIT:,})` called until it finds "
        "none (the last, empty call included). Rows swept keep their fences (their values "
        "go), as in production. Two ways to call it: as the beat's sweep task does (the "
        "database's clock, read once per statement as `(SELECT {schema}.now_ms())`: the "
        "function is VOLATILE, so compared bare it would run per row and keep the index from "
        "bounding the scan) and with the time given (`now=`: a query parameter).",
        "",
        "| sweep | nothing stale, ms | **expirations/s** | plan of the due-values lookup |",
        "|---|---:|---:|---|",
    ]
    for way in (DB_CLOCK, GIVEN_NOW):
        report.lines.append(
            f"| {way} | {sweeps.empty_ms[way].fmt(',.2f')} | "
            f"**{sweeps.expirations[way].fmt()}** | {sweeps.plans[way]} |"
        )
    report.lines += [
        "",
        "Each stale sweep, in the order run (expirations/s; rows holding only a fence when "
        "it began: the values earlier sweeps expired keep their fences for a day, as in "
        "production, and each `expire_stale` call also looks for fences due):",
        "",
        *(
            f"* {way.split(' (')[0]}: {rate:,.0f}/s with {fences:,} fence-only rows"
            for way, fences, rate in sweeps.runs
        ),
        "",
        "The targets judge the sweep as the beat runs it (`expire_stale()`), with the store "
        "as it is in this commit.",
    ]
    empty, rate = sweeps.empty_ms[DB_CLOCK].median, sweeps.expirations[DB_CLOCK].median
    report.targets += [
        Target(
            f"postgres: sweep with nothing stale among {size.sessions:,} sessions",
            f"<= {EMPTY_SWEEP_TARGET_MS:g} ms",
            f"{empty:,.2f} ms",
            None if config.quick else empty <= EMPTY_SWEEP_TARGET_MS,
        ),
        Target(
            f"postgres: expirations/s, {size.stale:,} stale among {size.sessions:,}",
            f">= {EXPIRATIONS_TARGET:,.0f}/s",
            f"{rate:,.0f}/s",
            None if config.quick else rate >= EXPIRATIONS_TARGET,
        ),
    ]


def _write_parted(report: SectionReport, sweeps: Sweeps, parted: Sweeps, size: Sizes) -> None:
    """The sweeps again on a hash-partitioned table: what partitioning costs the sweep."""
    report.lines += [
        "",
        f"The same sessions in a table hash-partitioned {PARTITIONS} ways by session id, made "
        "before the store's upgrade as docs/scaling.md has an operator do it (populated in "
        f"{parted.populate_seconds:.1f} s): each sweep reads every partition's index head.",
        "",
        "| sweep | one table: nothing stale, ms | partitioned | one table: expirations/s "
        "| partitioned |",
        "|---|---:|---:|---:|---:|",
    ]
    for way in (DB_CLOCK, GIVEN_NOW):
        report.lines.append(
            f"| {way} | {sweeps.empty_ms[way].fmt(',.2f')} | {parted.empty_ms[way].fmt(',.2f')}"
            f" | {sweeps.expirations[way].fmt()} | {parted.expirations[way].fmt()} |"
        )
    report.lines.append("")
    plan = parted.plans[DB_CLOCK]
    report.lines.append(f"Plan of the partitioned lookup (database clock): {plan}")
