"""``checkpointq top`` and ``checkpointq stats``: what the system is doing, from Redis alone.

Where the numbers come from, and why:

* queue depth and the oldest queued request's age: from the broker, whatever its kind
  (``worker/ops/broker_probe.py``: LLEN and LINDEX of the list's far end on Redis and Sentinel,
  whose ``seq`` says when it was made; a passive queue declare on RabbitMQ, which cannot
  show the oldest message without consuming it, so its age is "unknown" there);
* dead-letter depth (XLEN), sessions (ZCOUNT of the deadline index), events (XLEN): read
  directly from the store, each O(1) or O(log n);
* the next sweep: RedBeat's schedule in Redis (``health.next_sweep``);
* throughput, lag and dead letters by reason: the workers' heartbeats. Every worker already
  writes a heartbeat every few seconds (``worker/ops/health.py``) carrying its totals so far
  (summed over its pool processes from the metrics files), so ``top`` costs the workers
  nothing per request: no extra Redis command per task (a per-request HINCRBY would add a
  round trip to every save), and no need to reach each worker's metrics port (which ``top``
  could not even find in a fleet). Throughput is the difference between two heartbeats of
  the same worker over their own timestamps, so clocks never need to agree. The price is
  resolution: rates move in steps of one heartbeat interval (5 s by default).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.urls import redact_url, redact_urls
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.worker import connections
from checkpointq.worker.ops import broker_probe, health
from checkpointq.worker.settings import Settings

#: Outcomes in the order the throughput table shows them.
OUTCOME_ORDER = (
    "applied",
    "stale",
    "deleted",
    "refreshed",
    "absent",
    "swept",
    "locked_out",
    "retried",
    "dead_lettered",
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything ``top`` shows, read at one moment (``stats --json`` prints it)."""

    time: float
    queue: str
    queue_depth: int
    #: Seconds since the oldest queued request was made (None: empty, it has no seq, or
    #: the broker cannot tell: see ``oldest_queued_known``).
    oldest_queued_seconds: float | None
    live_sessions: int
    stale_sessions: int
    dead_letters: int
    events: int
    #: Heartbeats of the workers alive now.
    workers: list[dict[str, Any]] = field(default_factory=list)
    #: ``task:outcome`` -> requests, summed over the live workers since each started.
    requests: dict[str, int] = field(default_factory=dict)
    #: Dead letters by reason kind, summed over the live workers since each started.
    dead_letters_by_reason: dict[str, int] = field(default_factory=dict)
    #: Epoch seconds of beat's next sweep (None: no beat ever scheduled one).
    next_sweep: float | None = None
    #: False when the broker cannot show its oldest message without consuming it (RabbitMQ).
    oldest_queued_known: bool = True

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["workers"] = len(self.workers)
        data["next_sweep_in_seconds"] = (
            None if self.next_sweep is None else round(self.next_sweep - self.time, 1)
        )
        return data


def collect(settings: Settings) -> Snapshot:
    """Read a snapshot (settings resolved: both URLs known).

    Raises:
        BrokerUnavailable: the broker could not be read.
        StoreUnavailable, redis.RedisError, redis.exceptions.RedisClusterException: nor
            could the store.
    """
    keys = connections.key_space(settings)
    with broker_probe.open_probe(settings) as probe:
        queued = probe.queue(settings.queue, oldest=True)
    store = connections.open_store(settings)
    try:
        now = time.time()
        pipe = store.client.pipeline(transaction=False)
        pipe.xlen(keys.dead_letters())
        pipe.xlen(keys.events())
        dead, events = (int(v) for v in pipe.execute())
        sessions = store.count_sessions(now)
        workers = health.live_workers(store.client, keys)
        next_sweep = health.next_sweep(settings, store.client)
    finally:
        store.close()
    made = queued.oldest_seq
    return Snapshot(
        time=now,
        queue=settings.queue,
        queue_depth=queued.depth,
        oldest_queued_seconds=None if made is None else max(0.0, now - made / 1e6),
        oldest_queued_known=queued.oldest_known,
        live_sessions=sessions.live,
        stale_sessions=sessions.expired,
        dead_letters=dead,
        events=events,
        workers=workers,
        requests=_summed(w.get("totals", {}).get("requests", {}) for w in workers),
        dead_letters_by_reason=_summed(
            w.get("totals", {}).get("dead_letters", {}) for w in workers
        ),
        next_sweep=next_sweep,
    )


def _summed(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, count in part.items():
            total[key] = total.get(key, 0) + int(count)
    return total


# -- throughput -----------------------------------------------------------------------------


@dataclass
class _Seen:
    time: float
    requests: dict[str, int]
    lag: tuple[float, int]


class Throughput:
    """Requests per second by ``task:outcome``, and mean lag, from successive heartbeats."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}
        self._rates: dict[str, dict[str, float]] = {}
        self._lag: dict[str, tuple[float, int]] = {}

    def update(self, workers: list[dict[str, Any]]) -> None:
        alive = set()
        for beat in workers:
            key = f"{beat.get('worker')}/{beat.get('started')}"  # a restart is a new worker
            alive.add(key)
            totals = beat.get("totals", {})
            seen = _Seen(
                float(beat.get("time", 0)),
                {k: int(v) for k, v in totals.get("requests", {}).items()},
                (float(totals.get("lag", [0, 0])[0]), int(totals.get("lag", [0, 0])[1])),
            )
            before = self._seen.get(key)
            if before is not None and seen.time > before.time:
                elapsed = seen.time - before.time
                self._rates[key] = {
                    name: (count - before.requests.get(name, 0)) / elapsed
                    for name, count in seen.requests.items()
                }
                self._lag[key] = (seen.lag[0] - before.lag[0], seen.lag[1] - before.lag[1])
            if before is None or seen.time > before.time:
                self._seen[key] = seen
        for gone in set(self._seen) - alive:
            self._seen.pop(gone)
            self._rates.pop(gone, None)
            self._lag.pop(gone, None)

    def rates(self) -> dict[str, float]:
        """Requests per second over each worker's last heartbeat interval, summed."""
        total: dict[str, float] = {}
        for rates in self._rates.values():
            for name, rate in rates.items():
                total[name] = total.get(name, 0.0) + rate
        return total

    def mean_lag(self) -> float | None:
        """Mean enqueue-to-apply seconds over the last heartbeat interval (None: no requests)."""
        seconds = sum(lag[0] for lag in self._lag.values())
        count = sum(lag[1] for lag in self._lag.values())
        return seconds / count if count else None


# -- rendering ------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min"


def _oldest(snapshot: Snapshot) -> str:
    if not snapshot.oldest_queued_known:
        return "unknown (the broker cannot show it without consuming)"
    return _duration(snapshot.oldest_queued_seconds)


def render(
    snapshot: Snapshot, throughput: Throughput, settings: Settings, error: str | None = None
) -> RenderableType:
    """The screen: a header, queue and sessions, throughput, dead letters, workers."""
    clock = datetime.fromtimestamp(snapshot.time, UTC).strftime("%H:%M:%SZ")
    header = Text.assemble(
        ("checkpointq top", "bold"),
        f"  broker {redact_url(settings.broker_url or '')}  queue {snapshot.queue}  {clock}",
    )
    if error:
        header.append(f"\n{error}", style="bold red")

    state = Table.grid(padding=(0, 2))
    state.add_row("queue depth", str(snapshot.queue_depth))
    state.add_row("oldest queued", _oldest(snapshot))
    state.add_row("lag (mean)", _duration(throughput.mean_lag()))
    state.add_row("live sessions", str(snapshot.live_sessions))
    state.add_row("expired, unswept", str(snapshot.stale_sessions))
    state.add_row("dead letters", str(snapshot.dead_letters))
    due = None if snapshot.next_sweep is None else snapshot.next_sweep - snapshot.time
    state.add_row("next sweep", "no beat" if due is None else f"in {_duration(max(0.0, due))}")
    state.add_row("workers", str(len(snapshot.workers)))

    rates = throughput.rates()
    flow = Table(title="throughput (live workers)", title_justify="left")
    flow.add_column("task")
    flow.add_column("outcome")
    flow.add_column("per s", justify="right")
    flow.add_column("total", justify="right")
    order = {name: i for i, name in enumerate(OUTCOME_ORDER)}
    for name in sorted(snapshot.requests, key=lambda n: (order.get(n.split(":")[1], 99), n)):
        task, outcome = name.split(":", 1)
        rate = rates.get(name)
        flow.add_row(
            task, outcome, "-" if rate is None else f"{rate:.1f}", str(snapshot.requests[name])
        )

    letters = Table(title="dead-lettered by reason (live workers)", title_justify="left")
    letters.add_column("reason")
    letters.add_column("total", justify="right")
    for kind, count in sorted(snapshot.dead_letters_by_reason.items()):
        letters.add_row(kind, str(count))

    workers = Table(title="workers", title_justify="left")
    for column in ("name", "host", "pid", "up", "last beat"):
        workers.add_column(column)
    for beat in snapshot.workers:
        workers.add_row(
            str(beat.get("worker")),
            str(beat.get("host")),
            str(beat.get("pid")),
            _duration(snapshot.time - float(beat.get("started", snapshot.time))),
            _duration(max(0.0, snapshot.time - float(beat.get("time", snapshot.time)))),
        )
    return Group(header, Text(""), state, Text(""), flow, letters, workers)


def stats_lines(snapshot: Snapshot) -> list[str]:
    """``checkpointq stats`` for people: the same numbers as ``top``, one per line."""
    data = snapshot.as_json()
    if not snapshot.oldest_queued_known:
        data["oldest_queued_seconds"] = "unknown"
    lines = [
        f"{name:<22} {data[name]}"
        for name in (
            "queue",
            "queue_depth",
            "oldest_queued_seconds",
            "live_sessions",
            "stale_sessions",
            "dead_letters",
            "events",
            "workers",
            "next_sweep_in_seconds",
        )
    ]
    lines += [f"requests {name:<13} {count}" for name, count in sorted(snapshot.requests.items())]
    lines += [
        f"dead_lettered {kind:<8} {count}"
        for kind, count in sorted(snapshot.dead_letters_by_reason.items())
    ]
    return lines


def run(settings: Settings, *, interval: float = 1.0, once: bool = False) -> None:
    """Redraw the view every ``interval`` seconds until Ctrl-C (or once, with ``once``).

    A broker or store that stops answering is shown on the screen, and the view keeps trying.
    """
    import redis
    from redis.exceptions import RedisClusterException
    from rich.console import Console
    from rich.live import Live

    console = Console()
    throughput = Throughput()
    last: Snapshot | None = None

    def frame() -> RenderableType:
        nonlocal last
        error = None
        try:
            last = collect(settings)
            throughput.update(last.workers)
        except BrokerUnavailable as exc:
            error = f"broker {redact_urls(str(exc))}"
        except (redis.RedisError, RedisClusterException, StoreUnavailable) as exc:
            error = f"store unreachable: {type(exc).__name__}: {redact_urls(str(exc))}"
        if last is None:
            return Text(f"checkpointq top: {error}", style="bold red")
        return render(last, throughput, settings, error)

    if once:
        console.print(frame())
        return
    with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(frame(), refresh=True)
        except KeyboardInterrupt:
            pass
