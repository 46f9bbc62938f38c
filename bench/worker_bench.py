"""Worker section: applied saves/s vs the same worker draining no-op tasks, per pool.

For each pool and concurrency, one worker of ``bench.noop_app`` (the production app plus a
``checkpoint.noop`` task with the same arguments and the same task base) drains, in turn:

* ``checkpoint.noop`` messages of a 20 KB checkpoint: Celery's own per-message ceiling;
* ``checkpoint.save`` messages of the same payload: what we add (validate, zstd, one script);
* ``checkpoint.apply_batch`` messages of ``BATCH`` saves each: the batching path.

Messages are staged and RENAMEd onto the queue in one step, and timed from the first taken
to the queue drained with nothing unacknowledged (``bench/worker_drain.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench import worker_drain
from bench.harness import RunConfig, SectionReport, Summary, Target, summarize
from tests.support.servers import RedisServer

SIZE = 20_000
BATCH = 50
#: Targets of the performance issue.
SAVE_VS_NOOP_TARGET = 0.9
BATCH_VS_NOOP_TARGET = 3.0


@dataclass(frozen=True, slots=True)
class Config:
    pool: str
    concurrency: int

    @property
    def label(self) -> str:
        return f"{self.pool} -c {self.concurrency}"


FULL = [
    Config("solo", 1),
    Config("prefork", 1),
    Config("prefork", 2),
    Config("prefork", 4),
    Config("threads", 2),
    Config("threads", 4),
]
QUICK = [Config("solo", 1), Config("prefork", 2)]
KINDS = ("no-op", "save", f"apply_batch x{BATCH}")


def run(config: RunConfig) -> SectionReport:
    configs = QUICK if config.quick else FULL
    messages = 30 if config.quick else 1_000
    batches = 4 if config.quick else 40
    repeats = 1 if config.quick else min(config.repeats, 2)
    results: dict[Config, dict[str, Summary]] = {}
    for cfg in configs:
        rates: dict[str, list[float]] = {k: [] for k in KINDS}
        for rep in range(repeats):
            broker, store = RedisServer().start(), RedisServer().start()
            try:
                with worker_drain.running_worker(broker, store, cfg.pool, cfg.concurrency):
                    tag = f"{cfg.pool}{cfg.concurrency}r{rep}"
                    rates[KINDS[0]].append(
                        worker_drain.drain(broker, "checkpoint.noop", messages, SIZE, f"n{tag}")
                    )
                    rates[KINDS[1]].append(
                        worker_drain.drain(broker, "checkpoint.save", messages, SIZE, f"s{tag}")
                    )
                    rates[KINDS[2]].append(
                        worker_drain.drain(
                            broker, worker_drain.APPLY_BATCH, batches, SIZE, f"b{tag}", BATCH
                        )
                    )
            finally:
                broker.cleanup()
                store.cleanup()
        results[cfg] = {k: summarize(v) for k, v in rates.items()}
    report = SectionReport("worker", "Worker: drain rate of applied saves vs no-op tasks")
    _write(report, results, messages, batches, repeats, config)
    return report


def _write(
    report: SectionReport,
    results: dict[Config, dict[str, Summary]],
    messages: int,
    batches: int,
    repeats: int,
    config: RunConfig,
) -> None:
    report.lines += [
        f"One worker per row on private broker and store redis-servers; {messages:,} messages "
        f"of a {SIZE // 1000} KB checkpoint per kind ({batches} messages of {BATCH} saves for "
        f"`apply_batch`), {repeats} repetition(s), a fresh worker and servers each; requests "
        "per second, median (min-max). `no-op` runs our task base with the same arguments and "
        "no store call: Celery's own per-message ceiling for that pool.",
        "",
        "| pool | no-op msgs/s | saves/s | **saves / no-op** | batched saves/s "
        "| **batched / no-op** |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cfg, r in results.items():
        noop, save, batched = (r[k] for k in KINDS)
        report.lines.append(
            f"| {cfg.label} | {noop.fmt()} | {save.fmt()} | "
            f"**{save.median / noop.median:.2f}x** | {batched.fmt()} | "
            f"**{batched.median / noop.median:.1f}x** |"
        )
    quick = config.quick
    worst = min(results, key=lambda c: results[c]["save"].median / results[c]["no-op"].median)
    w = results[worst]
    report.targets.append(
        Target(
            "worker: applied saves/s vs no-op drain, same worker (worst pool)",
            f">= {SAVE_VS_NOOP_TARGET}x",
            f"{w['save'].median / w['no-op'].median:.2f}x ({worst.label})",
            None if quick else w["save"].median / w["no-op"].median >= SAVE_VS_NOOP_TARGET,
        )
    )
    worst_b = min(results, key=lambda c: results[c][KINDS[2]].median / results[c]["no-op"].median)
    b = results[worst_b]
    report.targets.append(
        Target(
            "worker: batched applied saves/s vs single-message no-op ceiling (worst pool)",
            f">= {BATCH_VS_NOOP_TARGET:.0f}x",
            f"{b[KINDS[2]].median / b['no-op'].median:.1f}x ({worst_b.label})",
            None if quick else b[KINDS[2]].median / b["no-op"].median >= BATCH_VS_NOOP_TARGET,
        )
    )
    from bench import plots

    by_pool: dict[str, list[Config]] = {}
    for cfg in results:
        by_pool.setdefault(cfg.pool, []).append(cfg)
    series = {
        f"{pool} {kind}": [results[c][kind] for c in cfgs]
        for pool, cfgs in by_pool.items()
        for kind in KINDS
    }
    xs = {
        f"{pool} {kind}": [c.concurrency for c in cfgs]
        for pool, cfgs in by_pool.items()
        for kind in KINDS
    }
    plots.throughput(
        config.out_dir / "worker_throughput.png",
        f"Worker drain rate vs concurrency, {SIZE // 1000} KB checkpoints",
        xs,
        series,
        "worker concurrency (processes or threads)",
        "requests per second (log)",
    )
    report.plots.append("worker_throughput.png")
