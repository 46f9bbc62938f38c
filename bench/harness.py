"""What every benchmark section shares: private servers, repetition, summaries, results.

Each measurement runs against its own ``redis-server`` on a free loopback port (the test
suite's ``RedisServer``, so there is one way to start and stop one), never the machine's
Redis. Figures are medians of several repetitions with their min-max, and the targets the
performance issue sets are checked as ratios measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.servers import RedisServer


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How big and how often: ``quick`` only proves the suite runs (CI), tiny sizes."""

    quick: bool
    repeats: int
    out_dir: Path


@dataclass(frozen=True, slots=True)
class Summary:
    """The median of several repetitions, with the lowest and highest."""

    median: float
    low: float
    high: float
    runs: int

    def fmt(self, spec: str = ",.0f", unit: str = "") -> str:
        """``median (low-high)`` with ``spec`` applied to each number."""
        m, lo, hi = (format(v, spec) for v in (self.median, self.low, self.high))
        return f"{m}{unit} ({lo}-{hi})"


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("nothing to summarize")
    return Summary(statistics.median(values), min(values), max(values), len(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass(frozen=True, slots=True)
class Target:
    """One goal of the performance issue and whether this run met it (None: not checked)."""

    name: str
    goal: str
    measured: str
    met: bool | None


@dataclass
class SectionReport:
    """One section's Markdown body, plots (file names in the output dir) and targets."""

    key: str
    title: str
    lines: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)


def ops_per_second(op: Callable[[int], object], seconds: float, min_ops: int = 20) -> float:
    """Call ``op(i)`` for i = 0, 1, ... for at least ``seconds`` and ``min_ops`` calls."""
    clock = time.perf_counter
    done = 0
    start = clock()
    deadline = start + seconds
    while True:
        # Check the clock every few calls only: it is not free next to a 30 us GET.
        for _ in range(10):
            op(done)
            done += 1
        now = clock()
        if now >= deadline and done >= min_ops:
            return done / (now - start)


def per_call_seconds(fn: Callable[[], object], calls: int) -> float:
    """Mean wall time of ``fn()`` over ``calls`` calls, in seconds."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_calls(op: Callable[[int], object], calls: int) -> list[float]:
    """Microseconds of each call ``op(i)``, i = 0 .. ``calls`` - 1."""
    clock = time.perf_counter
    micros: list[float] = []
    for i in range(calls):
        start = clock()
        op(i)
        micros.append((clock() - start) * 1e6)
    return micros


@contextmanager
def private_redis(*extra_args: str) -> Iterator[redis.Redis]:
    """A client of a fresh ``redis-server`` on a free loopback port, stopped afterwards.

    The client uses bytes (``decode_responses=False``), as ``RedisStore`` expects.
    """
    server = RedisServer(extra_args=list(extra_args)).start()
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=60)
    try:
        yield client
    finally:
        client.close()
        server.cleanup()
