"""Peers section: what one agent turn costs with checkpointq and with the Python peers.

The workload of issue 42: ``SESSIONS`` sessions x ``TURNS`` turns, one producer; each turn
loads the session, appends a message of about 1 KB and saves it (about 20 KB of history by
the last turn), into PostgreSQL. A load that does not return the session's previous turn
is counted as stale (read-your-writes broken). Four ways, repetitions interleaved, on
private servers (``tests/support/postgres.py``: fsync and ``synchronous_commit`` on; a broker
redis-server):

* **checkpointq**: ``CheckpointClient.load`` and ``.save`` (a staged save, fire and
  forget) with our production worker (prefork -c 2) applying them to the PostgreSQL store;
  a turn is durable once the worker applied it (``wait_durable`` on each session's last
  save, after the last turn);
* **checkpointq asyncio**: the same turns through ``AsyncCheckpointClient`` in one event
  loop (awaited one at a time; its PostgreSQL reads in a worker thread, as the client makes
  them), against the same worker;
* **LangGraph**: ``PostgresSaver.get_tuple`` and a synchronous ``put`` of the whole message
  list (a blob per put, as LangGraph's ``add_messages`` channel writes it);
* **Agents**: the OpenAI Agents SDK's ``SQLAlchemySession.get_items`` and ``add_items``
  (one row appended per turn) on SQLAlchemy's asyncio engine with asyncpg.

The peers are benchmark-only dependencies (``pip install -e '.[bench-peers]'``); a peer that
is not installed is skipped with a line saying so. Both links of ``bench/postgres_bench.py``
are measured: PostgreSQL on loopback and 1 ms of round trip away (``bench/delay_proxy.py``).

A rate sweep follows, for our worker alone: CPU per durable save when saves arrive at 10%,
30%, 60% of the worker's capacity (one paced producer) and at 100% (a queue of staged
saves released at once, ``bench/worker_drain.py``). With ``BENCH_PROFILE_DIR`` set, the
worker's processes are sampled by py-spy at 30% and at saturation, and the producer's turns
profiled with cProfile, into that directory (``docs/performance.md``, "Cost per turn").
"""

from __future__ import annotations

import asyncio
import cProfile
import functools
import importlib.util
import os
import pstats
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench import worker_drain
from bench.harness import RunConfig, SectionReport, Summary, percentile, summarize
from bench.postgres_bench import (
    DATABASE,
    LINKS,
    SCHEMA,
    _calibrated_proxy,
    _Cpu,
    postgres_missing,
)
from bench.workload import make_checkpoint
from checkpointq.store.model import Checkpoint, ConversationMessage
from checkpointq.store.postgres import PostgresStore
from checkpointq.tasks.producer.aio import AsyncCheckpointClient
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.outcomes import RequestOutcome
from tests.support.celery_processes import CeleryProcess
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer

_R = TypeVar("_R")

OURS = "checkpointq"
OURS_ASYNC = "checkpointq asyncio"
LANGGRAPH = "LangGraph PostgresSaver"
AGENTS = "Agents SQLAlchemySession"
#: Way -> the modules it needs (the bench-peers extra).
NEEDS = {
    OURS: (),
    OURS_ASYNC: (),
    LANGGRAPH: ("langgraph.checkpoint.postgres",),
    AGENTS: ("agents.extensions.memory.sqlalchemy_session", "asyncpg", "sqlalchemy"),
}
PARTS = ("producer", *_Cpu.PARTS)
SWEEP_FRACTIONS = (0.1, 0.3, 0.6, 1.0)
SWEEP_SECONDS = 4.0
SWEEP_SIZE = 20_000
PROFILE_ENV = "BENCH_PROFILE_DIR"
QUEUE = worker_drain.QUEUE
#: Seconds the idle worker is watched before the first way.
IDLE_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Sizes:
    sessions: int
    turns: int
    links: tuple[str, ...]
    sweep: bool


def sizes(config: RunConfig) -> Sizes:
    if config.quick:
        # Proves the section runs (CI): a few turns on loopback, no 1 ms link, no sweep.
        return Sizes(sessions=4, turns=3, links=LINKS[:1], sweep=False)
    return Sizes(sessions=100, turns=20, links=LINKS, sweep=True)


def available(way: str) -> str | None:
    """None when ``way`` can run here, else why not."""
    missing = [m for m in NEEDS[way] if not _importable(m)]
    if missing:
        return f"{', '.join(missing)} not installed (pip install -e '.[bench-peers]')"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _texts(turns: int) -> list[str]:
    """One message of about 1 KB of prose per turn."""
    texts = []
    for k in range(turns):
        history = make_checkpoint(f"turn-{k}", 2_400).conversation_history
        texts.append(" ".join(m.content for m in history)[:1_000])
    return texts


@dataclass
class Run:
    """One repetition of one way: latencies (us), elapsed seconds, CPU seconds per part."""

    loads: list[float] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    #: Loads that missed the session's previous turn (checkpointq's ways: read-your-writes).
    stale: int = 0


# -- the three ways ----------------------------------------------------------------------


def _slug(way: str) -> str:
    """The way's part of its session ids and file names: its first word (two ways that
    share it apart)."""
    return "-".join(way.split()[:2] if way == OURS_ASYNC else way.split()[:1]).lower()


def _turn(sid: str, turn: int, text: str, loaded: Checkpoint | None, run: Run) -> Checkpoint:
    """The checkpoint of ``turn`` after ``loaded`` (a stale load, not the previous turn's
    version, counted in ``run``)."""
    if (loaded.version if loaded else 0) != turn:
        run.stale += 1
    history = loaded.conversation_history if loaded else []
    role = "user" if turn % 2 == 0 else "assistant"
    return Checkpoint(
        session_id=sid,
        version=turn + 1,
        conversation_history=[*history, ConversationMessage(role=role, content=text)],
        last_run_ref=f"run-{turn}",
    )


def _turns(
    tag: str, sessions: int, texts: list[str], run: Run
) -> Generator[Any, Checkpoint | None, None]:
    """Every session's turns, in order, without I/O: yields a session id to load; sent what
    the load returned, yields the checkpoint to save."""
    for turn, text in enumerate(texts):
        for s in range(sessions):
            sid = f"{tag}-{s}"
            loaded = yield sid
            yield _turn(sid, turn, text, loaded, run)


def _timed(into: list[float], call: Callable[[Any], _R], arg: Any) -> _R:
    started = time.perf_counter()
    result = call(arg)
    into.append((time.perf_counter() - started) * 1e6)
    return result


def _ours(client: CheckpointClient, tag: str, sessions: int, texts: list[str], run: Run) -> None:
    last: dict[str, Handle] = {}
    turns = _turns(tag, sessions, texts, run)
    for sid in turns:
        checkpoint = turns.send(_timed(run.loads, client.load, sid))
        last[sid] = _timed(run.saves, client.save, checkpoint)
    for handle in last.values():
        _applied(client.wait_durable(handle, timeout=120), handle)


def _applied(outcome: RequestOutcome, handle: Handle) -> None:
    if outcome.outcome != "applied":
        raise RuntimeError(f"session {handle.session_id}: {outcome.outcome}")


async def _atimed(into: list[float], call: Callable[[Any], Awaitable[_R]], arg: Any) -> _R:
    started = time.perf_counter()
    result = await call(arg)
    into.append((time.perf_counter() - started) * 1e6)
    return result


def _ours_async(
    broker_url: str, url: str, tag: str, sessions: int, texts: list[str], run: Run
) -> None:
    """``_ours`` through ``AsyncCheckpointClient``, in an event loop of its own."""

    async def main() -> None:
        store = PostgresStore(url, schema=SCHEMA)
        async with AsyncCheckpointClient(broker_url, store, queue=QUEUE) as client:
            last: dict[str, Handle] = {}
            turns = _turns(tag, sessions, texts, run)
            for sid in turns:
                checkpoint = turns.send(await _atimed(run.loads, client.load, sid))
                last[sid] = await _atimed(run.saves, client.save, checkpoint)
            for handle in last.values():
                _applied(await client.wait_durable(handle, timeout=120), handle)

    asyncio.run(main())


def _langgraph(url: str, tag: str, sessions: int, texts: list[str], run: Run) -> None:
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.postgres import PostgresSaver

    clock = time.perf_counter
    with PostgresSaver.from_conn_string(url) as saver:
        saver.setup()
        for turn, text in enumerate(texts):
            for s in range(sessions):
                config: Any = {"configurable": {"thread_id": f"{tag}-{s}", "checkpoint_ns": ""}}
                started = clock()
                found = saver.get_tuple(config)
                loaded_at = clock()
                messages = list(found.checkpoint["channel_values"]["messages"]) if found else []
                role = "user" if turn % 2 == 0 else "assistant"
                messages.append({"role": role, "content": text})
                checkpoint = empty_checkpoint()
                checkpoint["channel_values"] = {"messages": messages}
                checkpoint["channel_versions"] = {"messages": turn + 1}
                if found:
                    config = found.config
                saving = clock()
                saver.put(
                    config, checkpoint, {"source": "loop", "step": turn}, {"messages": turn + 1}
                )
                done = clock()
                run.loads.append((loaded_at - started) * 1e6)
                run.saves.append((done - saving) * 1e6)


def _agents(url: str, tag: str, sessions: int, texts: list[str], run: Run) -> None:
    asyncio.run(_agents_async(url, tag, sessions, texts, run))


async def _agents_async(url: str, tag: str, sessions: int, texts: list[str], run: Run) -> None:
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
    from sqlalchemy.ext.asyncio import create_async_engine

    clock = time.perf_counter
    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        handles = [
            SQLAlchemySession(f"{tag}-{s}", engine=engine, create_tables=True)
            for s in range(sessions)
        ]
        for turn, text in enumerate(texts):
            for session in handles:
                started = clock()
                items = await session.get_items()
                loaded_at = clock()
                if len(items) != turn:
                    raise RuntimeError(f"{session.session_id}: {len(items)} items at turn {turn}")
                role = "user" if turn % 2 == 0 else "assistant"
                item: Any = {"role": role, "content": text}
                saving = clock()
                await session.add_items([item])
                done = clock()
                run.loads.append((loaded_at - started) * 1e6)
                run.saves.append((done - saving) * 1e6)
    finally:
        await engine.dispose()


def _measure(
    way: str,
    do: Callable[[Run], None],
    meter: _Cpu,
) -> Run:
    run = Run()
    before = meter.read()
    cpu = time.process_time()
    started = time.perf_counter()
    do(run)
    run.elapsed = time.perf_counter() - started
    producer = time.process_time() - cpu
    spent = _Cpu.spent(before, meter.read())
    if way not in (OURS, OURS_ASYNC):  # the idle worker and broker: not the peers' bill
        spent.update(main=0.0, pool=0.0, broker=0.0)
    run.cpu = {"producer": producer, **spent}
    return run


# -- the section ---------------------------------------------------------------------------


@dataclass
class LinkResult:
    runs: dict[str, list[Run]]
    idle_cpu_per_s: dict[str, float]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    fraction: float
    offered: float
    achieved: float
    saves: int
    cpu_us: dict[str, float]


def run(config: RunConfig) -> SectionReport:
    report = SectionReport("peers", "Cost per turn: checkpointq against the Python peers")
    if postgres_missing(report):
        return report
    size = sizes(config)
    ways = [w for w in NEEDS if available(w) is None]
    skipped = {w: why for w in NEEDS if (why := available(w)) is not None}
    for way, why in skipped.items():
        print(f"peers: skipping {way}: {why}", flush=True)
    texts = _texts(size.turns)
    repeats = 1 if config.quick else min(config.repeats, 3)
    pg = PostgresServer().start()
    broker = RedisServer().start()
    results: dict[str, LinkResult] = {}
    sweep: list[SweepPoint] = []
    loads: list[float] = []
    rtt_added: Summary | None = None
    try:
        direct_url = pg.create_database(DATABASE)
        PostgresStore(direct_url, schema=SCHEMA).ping()
        results[LINKS[0]] = _link(
            broker, pg, direct_url, LINKS[0], ways, size, texts, repeats, loads
        )
        if LINKS[1] in size.links:
            with _calibrated_proxy(pg, direct_url, config) as (proxied_url, rtt):
                rtt_added = rtt.added_us
                results[LINKS[1]] = _link(
                    broker, pg, proxied_url, LINKS[1], ways, size, texts, repeats, loads
                )
        if size.sweep:
            sweep = _sweep(broker, pg, direct_url, config)
    finally:
        broker.cleanup()
        pg.cleanup()
    _write(report, results, sweep, size, repeats, ways, skipped, rtt_added, loads)
    return report


def _link(
    broker: RedisServer,
    pg: PostgresServer,
    url: str,
    link: str,
    ways: list[str],
    size: Sizes,
    texts: list[str],
    repeats: int,
    loads: list[float],
) -> LinkResult:
    found = LinkResult({w: [] for w in ways}, {})
    with worker_drain.running_worker(broker, url) as worker:
        meter = _Cpu(worker, broker, pg)
        client = CheckpointClient(broker.url, PostgresStore(url, schema=SCHEMA), queue=QUEUE)
        idle_before, idle_started = meter.read(), time.perf_counter()
        time.sleep(IDLE_SECONDS / 4 if size.sessions < 10 else IDLE_SECONDS)
        idle = _Cpu.spent(idle_before, meter.read())
        seconds = time.perf_counter() - idle_started
        found.idle_cpu_per_s = {p: t / seconds for p, t in idle.items()}
        ways_of: dict[str, Callable[[str, int, list[str], Run], None]] = {
            OURS: lambda tag, n, t, r: _ours(client, tag, n, t, r),
            OURS_ASYNC: lambda tag, n, t, r: _ours_async(broker.url, url, tag, n, t, r),
            LANGGRAPH: lambda tag, n, t, r: _langgraph(url, tag, n, t, r),
            AGENTS: lambda tag, n, t, r: _agents(url, tag, n, t, r),
        }
        do: dict[str, Callable[[str, Run], None]] = {
            w: functools.partial(_full, f, size.sessions, texts) for w, f in ways_of.items()
        }
        profile_dir = os.environ.get(PROFILE_ENV)
        try:
            for way in ways:  # imports, tables, connections, the worker's first group
                ways_of[way](f"{link[:4]}-warm-{_slug(way)}", 2, texts[:2], Run())
            for rep in range(repeats):
                order = ways[rep % len(ways) :] + ways[: rep % len(ways)]
                for way in order:
                    tag = f"{link[:4]}-{rep}-{_slug(way)}"
                    loads.append(os.getloadavg()[0])
                    result = _measure(way, functools.partial(do[way], tag), meter)
                    found.runs[way].append(result)
                    turns = len(result.saves)
                    print(
                        f"peers {link} {way}: {turns / result.elapsed:,.0f} durable turns/s, "
                        f"{sum(result.cpu.values()) * 1e6 / turns:,.0f} us CPU/turn",
                        flush=True,
                    )
            if profile_dir and link == LINKS[0]:
                _profile_producer(Path(profile_dir), do, ways)
        finally:
            client.close()
    return found


def _full(
    way: Callable[[str, int, list[str], Run], None],
    sessions: int,
    texts: list[str],
    tag: str,
    run: Run,
) -> None:
    way(tag, sessions, texts, run)


def _profile_producer(
    out: Path, do: dict[str, Callable[[str, Run], None]], ways: list[str]
) -> None:
    """cProfile of one more repetition of each way's producer, cumulative top 40."""
    out.mkdir(parents=True, exist_ok=True)
    for way in ways:
        profiler = cProfile.Profile()
        profiler.enable()
        do[way](f"prof-{_slug(way)}", Run())
        profiler.disable()
        with (out / f"producer-{_slug(way)}.txt").open("w") as fh:
            stats = pstats.Stats(profiler, stream=fh)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)


# -- the rate sweep ------------------------------------------------------------------------


@contextmanager
def _sampled(pids: list[int], out: Path | None, name: str, seconds: float) -> Iterator[None]:
    """py-spy sampling ``pids`` for ``seconds`` into ``out``/``name``-<pid>.txt (raw stacks),
    when ``out`` is given and py-spy is installed; else nothing."""
    spy = shutil.which("py-spy")
    procs: list[subprocess.Popen[bytes]] = []
    if out is not None and spy:
        out.mkdir(parents=True, exist_ok=True)
        for pid in pids:
            procs.append(
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(int(seconds)),
                        "--rate",
                        "200",
                        "--format",
                        "raw",
                        "--nonblocking",
                        "-o",
                        str(out / f"{name}-{pid}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    try:
        yield
    finally:
        for proc in procs:
            proc.wait(timeout=seconds + 60)
        for path in out.glob(f"{name}-*.txt") if procs and out else ():
            if not path.name.endswith("-top.txt"):
                path.with_name(path.stem + "-top.txt").write_text(summarize_stacks(path))


def summarize_stacks(raw: Path, top: int = 25) -> str:
    """py-spy's raw (collapsed) stacks, in per cent of the samples: by the function the
    sample was in (self), and by the innermost three of our frames with that function (which
    of our code paths the time went to: the inclusive view is all Celery's frames)."""
    own: dict[str, int] = {}
    paths: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        n = int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        ours = [f.split(" (")[0] for f in frames if "checkpointq/" in f][-3:]
        path = " > ".join(ours) + " | " + frames[-1].split(" (")[0]
        paths[path] = paths.get(path, 0) + n
    lines = [f"{raw.name}: {total} samples", "", "self %  function"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / max(1, total):5.1f}  {frame}")
    lines += ["", "   %    our innermost frames | function sampled"]
    for path, n in sorted(paths.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / max(1, total):5.1f}  {path}")
    return "\n".join(lines) + "\n"


def _pids(worker: CeleryProcess) -> list[int]:
    main = worker.process.pid if worker.process else 0
    path = Path(f"/proc/{main}/task/{main}/children")
    return [main, *(int(c) for c in path.read_text().split())]


def _drained(raw: Any) -> None:
    deadline = time.monotonic() + 300
    while raw.llen(QUEUE) or raw.hlen("unacked"):
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not drain the queue in 300 s")
        time.sleep(0.005)


def _sweep(
    broker: RedisServer, pg: PostgresServer, url: str, config: RunConfig
) -> list[SweepPoint]:
    """CPU per durable save of our worker at fractions of its capacity (loopback)."""
    raw = broker.client()
    profile = os.environ.get(PROFILE_ENV)
    out = Path(profile) if profile else None
    points: list[SweepPoint] = []
    messages = 3_000
    try:
        staged = worker_drain.stage(
            raw, "bench-peers-staged", messages, SWEEP_SIZE, "sw", staged=True
        )
        with worker_drain.running_worker(broker, url) as worker:
            meter = _Cpu(worker, broker, pg)
            capacity = staged.rate(raw, "peers sweep: capacity")
            client = CheckpointClient(broker.url, PostgresStore(url, schema=SCHEMA), queue=QUEUE)
            checkpoints = [make_checkpoint(f"sw-p{n}", SWEEP_SIZE) for n in range(100)]
            try:
                for rep in range(min(config.repeats, 3)):
                    for fraction in SWEEP_FRACTIONS:
                        name = f"{int(fraction * 100)}pct" if rep == 0 else ""
                        sample = out if name in ("30pct", "100pct") else None
                        before = meter.read()
                        started = time.perf_counter()
                        if fraction >= 1.0:
                            # the staging writes come first, and the drain may be slower
                            # than the capacity measured: sampled for long enough
                            seconds = 3 * messages / capacity + 3
                            with _sampled(_pids(worker), sample, name, seconds):
                                rate = staged.rate(raw, "peers sweep: 100%")
                            saves = messages
                        else:
                            target = fraction * capacity
                            saves = int(target * SWEEP_SECONDS)
                            with _sampled(_pids(worker), sample, name, SWEEP_SECONDS):
                                _paced(client, checkpoints, target, saves)
                                _drained(raw)
                            rate = saves / (time.perf_counter() - started)
                        spent = _Cpu.spent(before, meter.read())
                        points.append(
                            SweepPoint(
                                fraction,
                                fraction * capacity,
                                rate,
                                saves,
                                {p: t * 1e6 / saves for p, t in spent.items()},
                            )
                        )
                        print(
                            f"peers sweep {fraction:.0%}: {rate:,.0f} saves/s, "
                            f"{sum(spent.values()) * 1e6 / saves:,.0f} us CPU/save",
                            flush=True,
                        )
            finally:
                client.close()
    finally:
        raw.close()
    return points


def _paced(
    client: CheckpointClient, checkpoints: list[Checkpoint], rate: float, saves: int
) -> None:
    """``saves`` saves at ``rate`` per second, on a schedule (late ones go at once)."""
    start = time.perf_counter()
    for i in range(saves):
        due = start + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        client.save(checkpoints[i % len(checkpoints)])


# -- the report ----------------------------------------------------------------------------


def _per_turn(runs: list[Run], part: str) -> Summary:
    return summarize([r.cpu[part] * 1e3 / len(r.saves) for r in runs])


def _async_ratios(results: dict[str, LinkResult], ways: list[str]) -> list[str]:
    """Issue 40's goal: the asyncio client's save p50 within 1.2x of the sync client's, per
    repetition (the two ran side by side), then their median."""
    if OURS not in ways or OURS_ASYNC not in ways:
        return []
    lines = ["", "Asyncio client's save p50 / the sync client's, per repetition (goal <= 1.2x):"]
    for link, found in results.items():
        pairs = zip(found.runs[OURS_ASYNC], found.runs[OURS], strict=True)
        ratio = summarize([percentile(a.saves, 50) / percentile(s.saves, 50) for a, s in pairs])
        lines.append(f"{link} **{ratio.fmt('.2f')}x**;")
    return lines


def _write(
    report: SectionReport,
    results: dict[str, LinkResult],
    sweep: list[SweepPoint],
    size: Sizes,
    repeats: int,
    ways: list[str],
    skipped: dict[str, str],
    rtt_added: Summary | None,
    loads: list[float],
) -> None:
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "n/a"
    report.lines += [
        f"{size.sessions} sessions x {size.turns} turns, one producer; each turn loads the "
        "session, appends a ~1 KB message and saves (about 20 KB by the last turn) into a "
        "private PostgreSQL (fsync on). Ways interleaved, "
        f"{repeats} repetition(s): medians with min-max. "
        + (
            f"Added round trip of the far link: {rtt_added.fmt(',.0f')} us. "
            if rtt_added
            else "Loopback only (`--quick`: a few turns, no far link, no rate sweep). "
        )
        + f"1-minute load average while measuring: {load}.",
        "",
    ]
    for way, why in skipped.items():
        report.lines.append(f"* **{way}: skipped**, {why}.")
    if skipped:
        report.lines.append("")
    report.lines += [
        "| database | way | save p50 / p99 ms | load p50 / p99 ms | durable turns/s |"
        " **CPU ms/turn** | stale loads |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for link, found in results.items():
        for way in ways:
            runs = found.runs[way]
            sp50 = summarize([percentile(r.saves, 50) / 1e3 for r in runs])
            sp99 = summarize([percentile(r.saves, 99) / 1e3 for r in runs])
            lp50 = summarize([percentile(r.loads, 50) / 1e3 for r in runs])
            lp99 = summarize([percentile(r.loads, 99) / 1e3 for r in runs])
            rate = summarize([len(r.saves) / r.elapsed for r in runs])
            total = summarize([sum(r.cpu.values()) * 1e3 / len(r.saves) for r in runs])
            stale = sum(r.stale for r in runs) if way in (OURS, OURS_ASYNC) else "n/a"
            report.lines.append(
                f"| {link} | {way} | {sp50.median:.2f} / {sp99.median:.2f} | "
                f"{lp50.median:.2f} / {lp99.median:.2f} | {rate.fmt()} | "
                f"**{total.fmt('.2f')}** | {stale} |"
            )
    report.lines += _async_ratios(results, ways)
    report.lines += [
        "",
        "CPU per turn by process (ms, median; user + system from /proc): the producer (this "
        "process: every load and save, and for checkpointq the final `wait_durable`), the "
        "worker's main process and pool processes and the broker (checkpointq only: the peers "
        "have none), and every PostgreSQL process (the idle worker's write probe, about one a "
        "second, lands in the peers' PostgreSQL share too).",
        "",
        "| database | way | " + " | ".join(PARTS) + " | total | vs LangGraph |",
        "|---|---|" + "---:|" * (len(PARTS) + 2),
    ]
    for link, found in results.items():
        base = (
            summarize([sum(r.cpu.values()) / len(r.saves) for r in found.runs[LANGGRAPH]]).median
            if LANGGRAPH in ways
            else None
        )
        for way in ways:
            runs = found.runs[way]
            cells = " | ".join(f"{_per_turn(runs, p).median:.2f}" for p in PARTS)
            mine = summarize([sum(r.cpu.values()) / len(r.saves) for r in runs]).median
            ratio = f"{mine / base:.2f}x" if base else "n/a"
            report.lines.append(f"| {link} | {way} | {cells} | {mine * 1e3:.2f} | {ratio} |")
    idle = next(iter(results.values())).idle_cpu_per_s if results else {}
    if idle:
        report.lines += [
            "",
            "The idle worker, watched before the first way: "
            + ", ".join(f"{p} {t * 1e3:.1f} ms/s" for p, t in idle.items())
            + " of CPU.",
        ]
    if not sweep:
        report.lines += ["", "The rate sweep runs in the full bench only (not `--quick`)."]
        return
    report.lines += [
        "",
        f"### Rate sweep: our worker's CPU per durable save ({SWEEP_SIZE // 1000} KB, loopback)",
        "",
        "Capacity: a queue of 3,000 staged saves released at once and drained (100%). Below "
        f"it, one producer paces `CheckpointClient.save` at the fraction of that capacity for "
        f"{SWEEP_SECONDS:g} s (100 sessions in turn), until the queue is drained. CPU per "
        "save of the worker's main and pool processes, the broker (at 100% without the "
        "staging writes, made before the release; below, with the producer's publishes) and "
        "PostgreSQL; median of the repetitions (us).",
        "",
        "| rate | saves/s offered | achieved | main | pool | broker | postgres | **total** "
        "| worker-side (main+pool+postgres) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fraction in SWEEP_FRACTIONS:
        points = [p for p in sweep if p.fraction == fraction]
        cells = " | ".join(
            f"{summarize([p.cpu_us[part] for p in points]).median:,.0f}" for part in _Cpu.PARTS
        )
        total = summarize([sum(p.cpu_us.values()) for p in points])
        worker = summarize(
            [p.cpu_us["main"] + p.cpu_us["pool"] + p.cpu_us["postgres"] for p in points]
        )
        offered = "saturation" if fraction >= 1.0 else f"{points[0].offered:,.0f}"
        report.lines.append(
            f"| {fraction:.0%} | {offered} | {summarize([p.achieved for p in points]).fmt()} "
            f"| {cells} | **{total.fmt()}** | {worker.fmt()} |"
        )
