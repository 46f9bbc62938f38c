"""``checkpointq top`` and ``checkpointq stats``: what the system is doing, from Redis alone.

Each figure comes from the cheapest place that knows it:

* queue depth and the oldest request's age: the broker (``worker/ops/broker_probe.py``);
* dead letters (XLEN), sessions (ZCOUNT of the deadline index), events: the store, each
  O(1) or O(log n); the next sweep: RedBeat's schedule (``health.next_sweep``);
* whether the store accepts writes: the one probe write ``health`` and backpressure make.
  A store out of memory or read-only still answers every read above while the workers
  pause and the queue grows; this line says why;
* throughput, lag and dead letters by reason: the heartbeats (``worker/ops/health.py``),
  which carry each worker's totals so far. So ``top`` costs the workers nothing per request
  (no extra Redis command per task) and needs no worker's metrics port, and rates are the
  difference between two heartbeats of one worker over its own timestamps, so clocks need
  not agree. The price: rates move in steps of one heartbeat (5 s by default).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import IO, Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.urls import redact_url, redact_urls
from checkpointq.tasks import held_rows
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.worker import connections
from checkpointq.worker.console import quiet_stdout
from checkpointq.worker.ops import broker_probe, health
from checkpointq.worker.settings import Settings

#: Outcomes in the order the throughput table shows them.
OUTCOME_ORDER = (
    "applied",
    "superseded",
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
    #: Why the store refuses writes (workers pause meanwhile); None while it accepts them.
    store_refusing_writes: str | None = None
    #: Sessions waiting on a database row another client holds, one line each
    #: (``tasks/held_rows.py``): the workers apply every other session meanwhile.
    held_rows: list[str] = field(default_factory=list)

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
    side = connections.store_client(settings)
    try:
        now = time.time()
        pipe = side.pipeline(transaction=False)
        pipe.xlen(keys.dead_letters())
        pipe.xlen(keys.events())
        dead, events = (int(v) for v in pipe.execute())
        sessions = store.count_sessions(now)
        workers = health.live_workers(side, keys)
        next_sweep = health.next_sweep(settings, side)
        held = [row.line(now) for row in held_rows.read(side, keys, now)]
        refusal = store.write_refusal()
    finally:
        store.close()
        side.close()
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
        store_refusing_writes=refusal,
        held_rows=held,
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


#: Rows of the throughput table and of the workers table that fit an 80x24 terminal with
#: everything else on the screen; more are summed up in one "+N more" row.
MAX_FLOW_ROWS = 7
MAX_WORKER_ROWS = 4
#: Sessions waiting on held rows shown one a line; more are counted.
MAX_HELD_ROWS = 2


def _table(title: str, *columns: str) -> Table:
    """A borderless table (a rule under its header): every line of the screen is data."""
    # min_width: a title longer than the columns under it would wrap onto a second line,
    # into the panel beside it ("refused, by reason" did, at 80 and 120 columns).
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        min_width=len(title),
    )
    table.show_edge = False
    for column in columns:
        table.add_column(column, justify="left" if column in ("task", "outcome") else "right")
    return table


def _capped(table: Table, rows: Sequence[tuple[str, ...]], limit: int) -> Table:
    for row in rows[:limit]:
        table.add_row(*row)
    if len(rows) > limit:
        table.add_row(f"+{len(rows) - limit} more", *([""] * (len(table.columns) - 1)))
    return table


def render(
    snapshot: Snapshot, throughput: Throughput, settings: Settings, error: str | None = None
) -> RenderableType:
    """The screen, within 80x24: a header, queue and sessions, throughput, dead letters by
    reason beside the workers."""
    clock = datetime.fromtimestamp(snapshot.time, UTC).strftime("%H:%M:%SZ")
    header = Table.grid(expand=True)
    header.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
    header.add_column(justify="right", no_wrap=True)
    header.add_row(
        Text.assemble(
            ("checkpointq top", "bold"),
            f"  {clock}  queue {snapshot.queue}  {redact_url(settings.broker_url or '')}",
        ),
        Text("  q: quit", style="reverse"),
    )
    lines: list[RenderableType] = [header]
    if error:
        lines.append(Text(error, style="bold red", no_wrap=True, overflow="ellipsis"))
    if snapshot.store_refusing_writes:
        lines.append(
            Text(
                f"store refusing writes: {snapshot.store_refusing_writes}; workers paused",
                style="bold red",
                no_wrap=True,
                overflow="ellipsis",
            )
        )

    for line in snapshot.held_rows[:MAX_HELD_ROWS]:
        lines.append(Text(line, style="bold yellow", no_wrap=True, overflow="ellipsis"))
    if len(snapshot.held_rows) > MAX_HELD_ROWS:
        more = len(snapshot.held_rows) - MAX_HELD_ROWS
        lines.append(Text(f"+{more} more session(s) waiting on held rows", style="yellow"))

    due = None if snapshot.next_sweep is None else snapshot.next_sweep - snapshot.time
    state = Table.grid(padding=(0, 2))
    for _ in range(4):
        state.add_column()
    state.add_row("queue depth", str(snapshot.queue_depth), "oldest queued", _oldest(snapshot))
    state.add_row(
        "lag (mean)",
        _duration(throughput.mean_lag()),
        "next sweep",
        "no beat" if due is None else f"in {_duration(max(0.0, due))}",
    )
    state.add_row(
        "live sessions",
        str(snapshot.live_sessions),
        "expired, unswept",
        str(snapshot.stale_sessions),
    )
    state.add_row("dead letters", str(snapshot.dead_letters), "workers", str(len(snapshot.workers)))

    rates = throughput.rates()
    order = {name: i for i, name in enumerate(OUTCOME_ORDER)}
    flow_rows = []
    for name in sorted(snapshot.requests, key=lambda n: (order.get(n.split(":")[1], 99), n)):
        task, outcome = name.split(":", 1)
        rate = rates.get(name)
        per_s = "-" if rate is None else f"{rate:.1f}"
        flow_rows.append((task, outcome, per_s, str(snapshot.requests[name])))
    flow = _capped(
        _table("throughput (live workers)", "task", "outcome", "per s", "total"),
        flow_rows,
        MAX_FLOW_ROWS,
    )

    letters = _capped(
        _table("refused, by reason", "reason", "total"),
        [(kind, str(count)) for kind, count in sorted(snapshot.dead_letters_by_reason.items())],
        MAX_WORKER_ROWS,
    )
    workers = _capped(
        _table("workers", "name", "pid", "up", "last beat"),
        [
            (
                str(beat.get("worker")),
                str(beat.get("pid")),
                _duration(snapshot.time - float(beat.get("started", snapshot.time))),
                _duration(max(0.0, snapshot.time - float(beat.get("time", snapshot.time)))),
            )
            for beat in snapshot.workers
        ],
        MAX_WORKER_ROWS,
    )
    below = Table.grid(padding=(0, 3))
    below.add_column()
    below.add_column()
    below.add_row(letters, workers)
    return Group(*lines, Text(""), state, Text(""), flow, below)


def stats_lines(snapshot: Snapshot) -> list[str]:
    """``checkpointq stats`` for people: the same numbers as ``top``, one per line, in
    words and units (``--json`` has the raw values)."""
    due = None if snapshot.next_sweep is None else snapshot.next_sweep - snapshot.time
    shown = {
        "queue": snapshot.queue,
        "queue_depth": str(snapshot.queue_depth),
        "oldest_queued": _oldest(snapshot) if snapshot.queue_depth else "- (queue empty)",
        "live_sessions": str(snapshot.live_sessions),
        "stale_sessions": f"{snapshot.stale_sessions} (expired, not yet swept)",
        "dead_letters": str(snapshot.dead_letters),
        "events": str(snapshot.events),
        "workers": str(len(snapshot.workers)),
        "store_writes": "accepted"
        if snapshot.store_refusing_writes is None
        else f"REFUSED: {snapshot.store_refusing_writes} (workers paused until it accepts)",
        "next_sweep": "no beat has scheduled one"
        if due is None
        else f"in {_duration(max(0.0, due))}",
    }
    lines = [f"{name:<22} {value}" for name, value in shown.items()]
    lines += [f"{'held_row':<22} {line}" for line in snapshot.held_rows]
    lines += [f"requests {name:<13} {count}" for name, count in sorted(snapshot.requests.items())]
    lines += [
        f"dead_lettered {kind:<8} {count}"
        for kind, count in sorted(snapshot.dead_letters_by_reason.items())
    ]
    return lines


def run(settings: Settings, *, interval: float = 1.0, once: bool = False) -> bool:
    """Redraw the view every ``interval`` seconds until ``q`` or Ctrl-C (or once, with
    ``once``). Returns whether the last snapshot could be read.

    A broker or store that stops answering is shown on the screen, and the view keeps trying.
    """
    import redis
    from redis.exceptions import RedisClusterException
    from rich.console import Console
    from rich.live import Live

    console = Console()
    throughput = Throughput()
    last: Snapshot | None = None

    failed: str | None = None

    def frame() -> RenderableType:
        nonlocal last, failed
        error = None
        try:
            last = collect(settings)
            throughput.update(last.workers)
        except BrokerUnavailable as exc:
            error = f"broker {redact_urls(str(exc))}"
        except (redis.RedisError, RedisClusterException, StoreUnavailable) as exc:
            error = f"store unreachable: {type(exc).__name__}: {redact_urls(str(exc))}"
        failed = error
        if last is None:
            return Text(f"checkpointq top: {error}", style="bold red")
        return render(last, throughput, settings, error)

    if once:
        console.print(frame())
        return failed is None
    with _keys() as key:
        try:
            with (
                _interruptible(console.file, QUIT_DEADLINE),
                Live(frame(), console=console, auto_refresh=False, screen=False) as live,
            ):
                while key(interval) not in ("q", "Q"):
                    live.update(frame(), refresh=True)
        except (KeyboardInterrupt, _Abandoned):
            # Ctrl-C; the last frame drawn, or not: nothing left in stdout's buffer may hold
            # the exit (``main`` flushes it, and the terminal may take no more).
            _show_cursor(console.file)
            quiet_stdout()
    return True


#: The terminal's "show the cursor" sequence (``Live`` hid it).
SHOW_CURSOR = b"\x1b[?25h"


def _show_cursor(output: IO[str]) -> None:
    """Show the cursor again, whatever became of ``Live``'s own attempt: a wind-down cut
    short by Ctrl-C or the deadline may leave it in a buffer that is then dropped. Written
    straight to the terminal without waiting; one that takes nothing more has what it still
    holds dropped first (the frames it was not shown), so the sequence fits."""
    if not output.isatty():
        return
    fd = output.fileno()
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    try:
        try:
            os.write(fd, SHOW_CURSOR)
        except BlockingIOError:
            termios.tcflush(fd, termios.TCOFLUSH)
            os.write(fd, SHOW_CURSOR)
    except OSError:
        pass  # a terminal gone or still full: nothing left to show it on
    finally:
        os.set_blocking(fd, blocking)


#: Seconds ``top`` may take to wind down after Ctrl-C (close its connections, draw its last
#: frame, show the cursor) before it leaves what it was waiting on.
QUIT_DEADLINE = 0.5


class _Abandoned(BaseException):
    """The view did not wind down within ``QUIT_DEADLINE`` of Ctrl-C. (Not an
    ``Exception``, like ``KeyboardInterrupt``, so that no library's handler swallows it.)"""


@contextlib.contextmanager
def _interruptible(output: IO[str], deadline: float) -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` as usual, drops the output the terminal has not
    shown yet, and leaves ``deadline`` seconds to wind down, after which ``_Abandoned`` is
    raised in whatever still waits.

    Python raises ``KeyboardInterrupt`` once, in the call that was waiting; what runs after
    it may wait again with nothing to interrupt it. The usual wait is the terminal: one that
    is slow or not read (or stopped with Ctrl-S) fills its buffer, and the last frame and
    the cursor wait for room. Dropping the frames not yet shown makes room, as the terminal
    does itself when Ctrl-C is typed at it (but not for ``kill -INT``); the deadline covers
    the rest.
    """

    def interrupted(signum: int, frame: FrameType | None) -> None:
        if output.isatty():
            termios.tcflush(output.fileno(), termios.TCOFLUSH)
        if signal.getitimer(signal.ITIMER_REAL)[0] == 0:  # again: the first one's deadline
            signal.setitimer(signal.ITIMER_REAL, deadline)
        raise KeyboardInterrupt

    def late(signum: int, frame: FrameType | None) -> None:
        raise _Abandoned

    before_interrupt = signal.signal(signal.SIGINT, interrupted)
    before_alarm = signal.signal(signal.SIGALRM, late)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGINT, before_interrupt)
            signal.signal(signal.SIGALRM, before_alarm)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """``key(timeout)``: the key pressed within ``timeout`` seconds, or None. The terminal
    is in cbreak mode meanwhile (keys arrive unbuffered, unechoed; Ctrl-C still works)."""
    if not sys.stdin.isatty():

        def no_key(timeout: float) -> str | None:
            time.sleep(timeout)
            return None

        yield no_key
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def key(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        pressed = os.read(fd, 1)
        if not pressed:  # the terminal closed: wait out the interval
            time.sleep(timeout)
            return None
        return pressed.decode(errors="replace")

    try:
        yield key
    finally:
        # Now, not once output drains (TCSADRAIN): a terminal that is not read never drains.
        termios.tcsetattr(fd, termios.TCSANOW, saved)
