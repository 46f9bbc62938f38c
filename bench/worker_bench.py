"""Worker section: drain rates against plain Celery, measured side by side in one run.

One prefork -c 2 worker at a time (the deployed default) on private broker and store
redis-servers. The same ``MESSAGES`` queued save messages of a 20 KB checkpoint are built
once and released (COPY, then RENAME) for each worker in turn (``bench/worker_drain.py``);
single saves carry zstd bodies, as our Python producers send them:

* **plain Celery no-op**: stock Celery, our delivery settings, a no-op ``checkpoint.save``
  (``bench/plain_app.py``): the honest baseline every ratio is taken against;
* **our no-op**: our worker with ``checkpoint.save`` replaced by a no-op: what our task base,
  consumer and transport cost per message;
* **saves, one task per message**: our production worker with coalescing off;
* **saves, coalesced**: our production worker as deployed (``worker/coalesce.py`` groups up
  to 32 single saves per store round trip);
* **apply_batch**: the same number of saves sent as ``checkpoint.apply_batch`` messages of
  ``BATCH`` saves each;
* **saves, coalesced, task events on**: as deployed with ``-E`` (``CHECKPOINTQ_TASK_EVENTS``):
  each request's received, started and succeeded events published, nobody listening. The
  deployed way above has events off and no signal receivers, so builds none of them;
* **staged saves**: the same saves as ``checkpoint.save_staged`` messages naming their values
  on the broker (our Python producers' default, docs/protocol.md "Staged saves"), drained
  by plain Celery's no-op and by our worker as deployed; their ratio is to that no-op.

Repetitions interleave the workers (plain, ours, ...) so that load from other work on the
machine falls on all of them alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from bench import worker_drain
from bench.harness import RunConfig, SectionReport, Summary, Target, summarize
from tests.support.servers import RedisServer

SIZE = 20_000
BATCH = 50
#: Targets of the performance issue, as multiples of the plain Celery no-op drain.
SAVE_TARGET = 0.9
COALESCED_TARGET = 3.0
BATCH_TARGET = 5.0
#: Issue 23: task events on may cost the coalesced drain at most 15%.
EVENTS_TARGET = 0.85


@dataclass(frozen=True, slots=True)
class Way:
    """One drain: a worker kind, its extra settings, and whether it drains batches."""

    label: str
    kind: str
    batched: bool = False
    settings: tuple[tuple[str, object], ...] = ()
    #: Drains staged saves (``checkpoint.save_staged``, our producers' default) instead of
    #: saves carrying their checkpoint.
    staged: bool = False


WAYS = (
    Way("plain Celery no-op", "plain"),
    Way("our no-op (one task per message)", "noop"),
    Way("saves, one task per message", "save", settings=(("coalesce_max_items", 0),)),
    Way("saves, coalesced (default)", "save"),
    Way(f"apply_batch x{BATCH}", "save", batched=True),
    Way("saves, coalesced, task events on (-E)", "save", settings=(("task_events", True),)),
    Way("plain Celery no-op, staged save messages", "plain", staged=True),
    Way("staged saves, coalesced (default)", "save", staged=True),
)


def run(config: RunConfig) -> SectionReport:
    messages = 60 if config.quick else 3_000
    repeats = 1 if config.quick else min(config.repeats, 3)
    rates: dict[str, list[float]] = {w.label: [] for w in WAYS}
    # CPU microseconds per save, per way and part (worker_drain.CPU_PARTS), per repetition.
    cpu: dict[str, dict[str, list[float]]] = {
        w.label: {part: [] for part in (*worker_drain.CPU_PARTS, "total")} for w in WAYS
    }
    loads: list[float] = []
    broker, store = RedisServer().start(), RedisServer().start()
    client, stored = broker.client(), store.client()
    try:
        singles = worker_drain.stage(client, "bench-singles", messages, SIZE, "s", compressed=True)
        batches = worker_drain.stage(
            client, "bench-batches", messages // BATCH, SIZE, "b", per_message=BATCH
        )
        staged_singles = worker_drain.stage(
            client, "bench-staged", messages, SIZE, "st", staged=True
        )
        applied = 0
        for _ in range(repeats):
            for way in WAYS:
                stored.flushall()
                staged = batches if way.batched else staged_singles if way.staged else singles
                with worker_drain.running_worker(
                    broker, store, kind=way.kind, settings=dict(way.settings)
                ) as worker:
                    loads.append(os.getloadavg()[0])
                    meter = worker_drain.CpuMeter.of(worker, broker, store)
                    before = meter.read()
                    rates[way.label].append(staged.rate(client, way.label))
                    after = meter.read()
                saves = staged.messages * staged.saves_per_message
                for part in worker_drain.CPU_PARTS:
                    cpu[way.label][part].append((after[part] - before[part]) * 1e6 / saves)
                spent = sum(after.values()) - sum(before.values())
                cpu[way.label]["total"].append(spent * 1e6 / saves)
                if way is WAYS[3]:
                    applied = worker_drain.applied(store, "s", messages)
    finally:
        client.close()
        stored.close()
        broker.cleanup()
        store.cleanup()
    results = {label: summarize(values) for label, values in rates.items()}
    report = SectionReport("worker", "Worker: drain rates against plain Celery")
    _write(report, results, messages, repeats, loads, applied, config.quick)
    per_way = {label: {p: summarize(v) for p, v in parts.items()} for label, parts in cpu.items()}
    _write_cpu(report, per_way)
    return report


def _baseline(label: str) -> str:
    """The plain Celery drain of the same messages as the way ``label``."""
    staged = next(w.staged for w in WAYS if w.label == label)
    return next(w.label for w in WAYS if w.kind == "plain" and w.staged == staged)


def _write_cpu(report: SectionReport, cpu: dict[str, dict[str, Summary]]) -> None:
    """CPU per save of each part, and plain Celery's total over ours: what the drains cost
    whatever share of a loaded machine they got."""
    report.lines += [
        "",
        "CPU per save (user + system, from /proc; median of the repetitions, microseconds): "
        "the worker's main process, its pool processes, the broker and the store "
        "redis-servers. Plain Celery's total over a way's total is how many more saves that "
        "way gets from the same CPU time, whatever share of the machine it was given.",
        "",
        "| way | main | pool | broker | store | total | **plain CPU / this CPU** |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, parts in cpu.items():
        cells = " | ".join(f"{parts[p].median:,.0f}" for p in (*worker_drain.CPU_PARTS, "total"))
        total = parts["total"].median
        plain = cpu[_baseline(label)]["total"].median
        # (CPU time is counted in clock ticks: a quick run may spend too little to count)
        ratio = f"{plain / total:.2f}x" if total > 0 else "n/a"
        report.lines.append(f"| {label} | {cells} | **{ratio}** |")


def _write(
    report: SectionReport,
    results: dict[str, Summary],
    messages: int,
    repeats: int,
    loads: list[float],
    applied: int,
    quick: bool,
) -> None:
    plain = results[WAYS[0].label].median
    report.lines += [
        f"prefork -c 2, one worker at a time on private broker and store redis-servers; the "
        f"same {messages:,} queued save messages of a {SIZE // 1000} KB generated checkpoint "
        f"(COPY of one staged list, released with RENAME; `apply_batch`: the same number of "
        f"saves in {messages // BATCH} messages of {BATCH}); drained = queue and `unacked` "
        f"both empty. {repeats} repetition(s), workers interleaved, a fresh worker each; "
        f"median (min-max). 1-minute load average while measuring: "
        f"{min(loads):.2f}-{max(loads):.2f}. The last saves drain left {applied:,} of "
        f"{messages:,} sessions in the store.",
        "",
        "| way | saves/s | **vs plain Celery no-op** |",
        "|---|---:|---:|",
    ]
    for label, summary in results.items():
        base = results[_baseline(label)].median
        report.lines.append(f"| {label} | {summary.fmt()} | **{summary.median / base:.2f}x** |")

    def target(name: str, label: str, goal: float) -> Target:
        ratio = results[label].median / plain
        return Target(name, f">= {goal:g}x", f"{ratio:.2f}x", None if quick else ratio >= goal)

    check: Callable[[str, str, float], Target] = target
    report.targets += [
        check("worker: single-save messages vs plain Celery no-op", WAYS[3].label, SAVE_TARGET),
        check(
            "worker: single-save messages (coalesced) vs plain Celery no-op",
            WAYS[3].label,
            COALESCED_TARGET,
        ),
        check("worker: apply_batch saves/s vs plain Celery no-op", WAYS[4].label, BATCH_TARGET),
    ]
    staged_ratio = results[WAYS[7].label].median / results[WAYS[6].label].median
    report.targets.append(
        Target(
            "worker: staged single saves (coalesced) vs plain Celery no-op of the same messages",
            f">= {COALESCED_TARGET:g}x",
            f"{staged_ratio:.2f}x",
            None if quick else staged_ratio >= COALESCED_TARGET,
        )
    )
    events = results[WAYS[5].label].median / results[WAYS[3].label].median
    report.targets.append(
        Target(
            "worker: coalesced saves/s with task events on (-E) vs off",
            f">= {EVENTS_TARGET:g}x",
            f"{events:.2f}x",
            None if quick else events >= EVENTS_TARGET,
        )
    )
