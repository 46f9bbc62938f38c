"""The worker's CPU per durable save at fixed rates, workers of several checkouts (or
settings) side by side in one run: issue 42's rate sweep as an A/B.

    python -m bench.sweep_versus WAY [WAY ...] [--rates 136,407] [--repeats 5] [--seconds 4]

Each ``WAY`` is ``NAME=PATH[:setting=value,...]``: a checkout of checkpointq (``.`` for this
one; its ``.venv``'s Python if it has one, else this one's, with ``PYTHONPATH`` on the
checkout) and ``CHECKPOINTQ_*`` settings for its worker (``new20=.:wake_linger_ms=20``).
On one private PostgreSQL and one broker redis-server, each repetition starts each way's
worker in turn (the order reversed every other repetition), prefork -c 2 as the peers
section runs it, and measures it at each rate: one producer paces
``CheckpointClient.save`` of 20 KB checkpoints (100 sessions) at that many saves/s for
``--seconds``, until the queue is drained; then at saturation, a queue of 3,000 staged saves
released at once (``bench/worker_drain.py``). Reported per way and rate, medians with
min-max: CPU us per save of the worker's main and pool processes, the broker and
PostgreSQL (``bench/peers_bench.py``'s sweep: below saturation the broker's share includes
the producer's publishes, at saturation not the staging writes), saves per group (the
broker's EXEC calls: one per group's ack), and the main process's CPU per group.
Fixed rates, not fractions of a capacity measured in the run: every way gets the same load
(``docs/performance.md``, "Cost per turn").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import worker_drain
from bench.harness import summarize
from bench.peers_bench import SWEEP_SIZE, _drained, _paced
from bench.postgres_bench import DATABASE, SCHEMA, _Cpu
from bench.workload import make_checkpoint
from checkpointq.store.postgres import PostgresStore
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer

HERE = Path(__file__).resolve().parents[1]
SATURATION = "sat"
#: Staged saves released at once for the saturation point.
MESSAGES = 3_000


@dataclass(frozen=True, slots=True)
class Way:
    name: str
    tree: Path
    settings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Way:
        name, _, spec = text.partition("=")
        path, _, pairs = spec.partition(":")
        if not name or not path:
            raise argparse.ArgumentTypeError(f"{text!r}: NAME=PATH[:setting=value,...]")
        settings = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
        tree = HERE if path == "." else Path(path).resolve()
        return cls(name, tree, settings)

    def command(self) -> list[str]:
        own = self.tree / ".venv" / "bin" / "python"
        python = str(own) if own.exists() else sys.executable
        return [
            python,
            "-m",
            "celery",
            "-A",
            worker_drain.APPS["save"],
            "worker",
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            f"versus-{uuid.uuid4().hex[:8]}@%h",
        ]


def _calls(stats: dict[str, Any], command: str) -> int:
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _point(
    rate: float,
    seconds: float,
    meter: _Cpu,
    raw: Any,
    client: CheckpointClient,
    checkpoints: list[Any],
    staged: worker_drain.Staged,
) -> dict[str, float]:
    """CPU us per save by part, saves per group and the main process's CPU us per group, of
    one point (``rate`` 0: saturation)."""
    before, stats = meter.read(), raw.info("commandstats")
    if rate:
        saves = int(rate * seconds)
        _paced(client, checkpoints, rate, saves)
        _drained(raw)
    else:
        saves = MESSAGES
        staged.release_and_time_drain(raw)
    spent = _Cpu.spent(before, meter.read())
    groups = max(1, _calls(raw.info("commandstats"), "exec") - _calls(stats, "exec"))
    figures = {part: seconds_ * 1e6 / saves for part, seconds_ in spent.items()}
    figures["total"] = sum(figures.values())
    figures["saves/group"] = saves / groups
    figures["main/group"] = spent["main"] * 1e6 / groups
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ways", nargs="+", type=Way.parse, help="NAME=PATH[:setting=value,...]")
    parser.add_argument("--rates", default="136,407", help="saves/s, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    options = parser.parse_args()
    ways: list[Way] = options.ways
    rates = [float(r) for r in options.rates.split(",") if r]
    labels = [f"{r:,.0f}/s" for r in rates] + [SATURATION]
    found: dict[tuple[str, str], list[dict[str, float]]] = {}
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads: list[float] = []
    pg, broker = PostgresServer().start(), RedisServer().start()
    try:
        url = pg.create_database(DATABASE)
        PostgresStore(url, schema=SCHEMA).ping()
        raw = broker.client()
        staged = worker_drain.stage(raw, "versus-staged", MESSAGES, SWEEP_SIZE, "sv", staged=True)
        client = CheckpointClient(
            broker.url, PostgresStore(url, schema=SCHEMA), queue=worker_drain.QUEUE
        )
        checkpoints = [make_checkpoint(f"sv-p{n}", SWEEP_SIZE) for n in range(100)]
        for repeat in range(options.repeats):
            for way in ways if repeat % 2 == 0 else ways[::-1]:
                with worker_drain.running_worker(
                    broker,
                    url,
                    settings=dict(way.settings),
                    command=way.command(),
                    extra_env={"PYTHONPATH": str(way.tree)},
                ) as worker:
                    meter = _Cpu(worker, broker, pg)
                    for rate, label in zip([*rates, 0.0], labels, strict=True):
                        loads.append(os.getloadavg()[0])
                        figures = _point(
                            rate, options.seconds, meter, raw, client, checkpoints, staged
                        )
                        found.setdefault((way.name, label), []).append(figures)
                        print(
                            f"{repeat} {way.name} {label}: {figures['total']:,.0f} us/save, "
                            f"{figures['saves/group']:.1f} saves/group",
                            flush=True,
                        )
        client.close()
        raw.close()
    finally:
        broker.cleanup()
        pg.cleanup()
    _report(ways, labels, found, began, loads, options.repeats)


def _report(
    ways: list[Way],
    labels: list[str],
    found: dict[tuple[str, str], list[dict[str, float]]],
    began: str,
    loads: list[float],
    repeats: int,
) -> None:
    print(
        f"\n{began}, {repeats} repetitions, 1-minute load {min(loads):.1f}-{max(loads):.1f}; "
        "CPU us per save, medians (min-max of the total)\n"
    )
    print(
        "| rate | way | main | pool | broker | postgres | **total** | saves/group "
        "| main us/group | total / saturation |\n|---|---|" + "---:|" * 8
    )
    for label in labels:
        for way in ways:
            runs = found[(way.name, label)]
            med = {k: summarize([r[k] for r in runs]).median for k in runs[0]}
            saturated = summarize([r["total"] for r in found[(way.name, SATURATION)]]).median
            cells = " | ".join(f"{med[p]:,.0f}" for p in _Cpu.PARTS)
            total = summarize([r["total"] for r in runs]).fmt(",.0f")
            print(
                f"| {label} | {way.name} | {cells} | **{total}** | {med['saves/group']:.1f} "
                f"| {med['main/group']:,.0f} | {med['total'] / saturated:.2f}x |"
            )


if __name__ == "__main__":
    main()
