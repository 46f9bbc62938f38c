"""Random histories, run and checked; a failing one shrunk to a minimal reproducer and kept.

    python -m tests.history [--seconds N] [--seed S] [--variant NAME] [--keep DIR]
                            [--store redis|postgres]

runs histories (alternating one-Redis and two-Redis worlds; with ``--store postgres``, worlds
whose store is PostgreSQL beside a Redis broker) for N seconds (default 3600: the long mode,
whose figures docs/reliability.md reports), and prints what it explored. A
history that breaks an invariant is shrunk (``shrink``: delta debugging over its actions,
re-running each candidate on a clean world) and written to tests/history/regressions/, where
``test_histories.py`` replays every file on each run of the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.history.checker import check
from tests.history.world import Action, History, Servers, World, servers

REGRESSIONS = Path(__file__).with_name("regressions")
VARIANTS = Path(__file__).with_name("variants")

#: How often each step is drawn: producers act about as often as workers do, so queues
#: lag, drain and lag again; crashes, restores, long jumps of time and broker losses are
#: rarer, but every history of 40-120 steps is likely to hold a few.
_WEIGHTS: tuple[tuple[str, int], ...] = (
    ("save", 18),
    ("delete", 10),
    ("race", 14),
    ("load", 10),
    ("list", 2),
    ("outcome", 4),
    ("take", 12),
    ("apply", 12),
    ("settle", 8),
    ("ack", 6),
    ("crash", 2),
    ("restore", 3),
    ("advance", 8),
    ("loss", 1),
    ("hijack", 1),
)
#: The broker's faults of issue 44, after about one step in thirty, from a stream of their
#: own (so that the other steps are still the seed's): a purged queue, a broker that goes
#: back to a snapshot taken earlier, and records deleted by hand (``drop``).
_BROKER_FAULTS = ("purge", "snapshot", "snapshot", "rewind", "drop")
_BROKER_FAULT_RATE = 1 / 30
#: The database's faults, drawn in PostgreSQL worlds only (about one step in twenty): a row
#: held by another client and released, the schema moved under the workers and back, the
#: standby cut off and streaming again, and (rarer) a failover to it.
_PG_WEIGHTS: tuple[tuple[str, int], ...] = (
    ("lock", 3),
    ("unlock", 2),
    ("schema", 2),
    ("lag", 3),
    ("promote", 1),
)
_NAMES = [name for name, _ in _WEIGHTS]
_CUMULATIVE = [weight for _, weight in _WEIGHTS]
_PG_NAMES = [name for name, _ in _PG_WEIGHTS]
_PG_CUMULATIVE = [weight for _, weight in _PG_WEIGHTS]


def random_action(rng: random.Random) -> Action:
    name = rng.choices(_NAMES, weights=_CUMULATIVE)[0]
    producer = rng.choice((0, 0, 1, 1, 2, 2, 3, 4))  # the healthy three most often
    worker = rng.randrange(2)
    loaded = int(rng.random() < 0.8)
    args: tuple[int, ...]
    if name == "save":
        args = (producer, rng.randrange(2), rng.randrange(2), loaded)
    elif name == "delete":
        args = (producer, rng.randrange(2), loaded)
    elif name == "load":
        args = (producer, rng.randrange(2))
    elif name == "race":
        args = (producer, rng.choice((0, 0, 1, 1, 2, 2, 3, 4)), rng.randrange(2), rng.randrange(4))
    elif name == "list":
        args = (producer,)
    elif name == "outcome":
        args = (rng.randrange(64),)
    elif name == "take":
        args = (worker, rng.choice((1, 1, 1, 2, 4)))
    elif name in ("apply", "settle", "ack", "crash"):
        args = (worker,)
    elif name == "restore":
        args = (rng.randrange(2),)
    elif name == "advance":
        scale = rng.choices(("ms", "s", "ttl"), weights=(6, 3, 1))[0]
        ms = {"ms": (0, 300), "s": (1_000, 8_000), "ttl": (20_000, 40_000)}[scale]
        args = (rng.randint(*ms),)
    elif name == "hijack":
        args = (rng.randrange(64), rng.randrange(2), rng.randrange(2))
    else:
        args = ()
    return Action(name, args)


def random_database_fault(rng: random.Random) -> Action:
    """One of the database's faults (``_PG_WEIGHTS``), with its arguments."""
    name = rng.choices(_PG_NAMES, weights=_PG_CUMULATIVE)[0]
    if name == "lock":
        return Action(name, (rng.randrange(2),))
    if name in ("schema", "lag"):
        return Action(name, (rng.randrange(2),))
    return Action(name)


#: The share of steps followed by a sweep, in histories that sweep.
_SWEEP_RATE = 0.05


#: The share of steps followed by one of the database's faults, in histories that have them.
_DATABASE_FAULT_RATE = 0.05


def random_history(
    seed: int, *, sweeps: bool = False, database: bool = False, rekeys: bool = False
) -> list[Action]:
    """The seed's history; one of the broker's faults after about one step in thirty; with
    ``sweeps``, a sweep after about one step in twenty, with ``database`` one of the
    database's faults after about one in twenty, and with ``rekeys`` a rekey after about
    one in twenty, each drawn from a stream of its own, so that the other steps are still
    the seed's."""
    rng = random.Random(seed)
    actions = [random_action(rng) for _ in range(rng.randint(40, 120))]
    sweep_rng = random.Random(f"sweeps {seed}")
    fault_rng = random.Random(f"database {seed}")
    broker_rng = random.Random(f"broker {seed}")
    rekey_rng = random.Random(f"rekeys {seed}")
    extended: list[Action] = []
    for action in actions:
        extended.append(action)
        if broker_rng.random() < _BROKER_FAULT_RATE:
            extended.append(Action(broker_rng.choice(_BROKER_FAULTS)))
        if sweeps and sweep_rng.random() < _SWEEP_RATE:
            extended.append(Action("sweep"))
        if database and fault_rng.random() < _DATABASE_FAULT_RATE:
            extended.append(random_database_fault(fault_rng))
        if rekeys and rekey_rng.random() < _SWEEP_RATE:
            extended.append(Action("rekey"))
    return extended


@dataclass
class Finding:
    """A history that broke an invariant, shrunk."""

    seed: int
    one_redis: bool
    variant: str | None
    actions: list[Action]
    violations: list[str]
    postgres: bool = False
    encrypted: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "found": f"seed {self.seed}",
            "violation": self.violations[0],
            "one_redis": self.one_redis,
            "store": "postgres" if self.postgres else "redis",
            "encrypted": self.encrypted,
            "variant": self.variant,
            "actions": [a.as_json() for a in self.actions],
        }


@dataclass
class Figures:
    """What a run of ``explore`` covered."""

    histories: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    reads: int = 0
    listings: int = 0
    outcomes: int = 0
    losses: int = 0
    refused_at_publish: int = 0
    seconds: float = 0.0

    def add(self, history: History) -> None:
        self.histories += 1
        self.actions.update(a.name for a in history.actions)
        self.requests += len(history.requests)
        self.reads += len(history.reads)
        self.listings += len(history.listings)
        self.outcomes += len(history.outcomes)
        self.losses += len(history.losses)
        self.refused_at_publish += len(history.refused_at_publish)

    def summary(self) -> str:
        steps = sum(self.actions.values())
        faults = {
            k: self.actions[k]
            for k in ("crash", "restore", "loss", "hijack", "advance", "purge", "drop", "rewind")
        }
        for name in ("sweep", "rekey", *_PG_NAMES):
            if self.actions[name]:
                faults[name] = self.actions[name]
        return (
            f"{self.histories} histories, {steps} steps in {self.seconds:.0f} s: "
            f"{self.requests} requests accepted, {self.refused_at_publish} refused at publish, "
            f"{self.reads} loads, {self.listings} lists and {self.outcomes} outcome reads "
            f"checked; faults {faults}"
        )


def variant_source(variant: str | None) -> str | None:
    """The settle.lua of a broken variant (tests/history/variants/<name>.lua), or None."""
    return None if variant is None else (VARIANTS / f"{variant}.lua").read_text()


#: A long run goes on past a finding, up to this many.
_MAX_FINDINGS = 5


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The workers' log lines (dead letters of hijacks and faulty producers, retries) would
    drown the run's own report; the levels are put back after, as tests that read the log
    run later in the same process."""
    loggers = [logging.getLogger(name) for name in ("checkpointq", "celery")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def explore(
    running: Servers,
    *,
    seconds: float,
    first_seed: int = 0,
    variant: str | None = None,
    stop_at_first: bool = True,
    progress: Callable[[Figures], None] | None = None,
    histories: int | None = None,
    postgres: bool = False,
    encrypted: bool = False,
) -> tuple[Figures, list[Finding]]:
    """Run random histories for ``seconds`` (or ``histories`` of them, if fewer); shrink
    each one that fails. ``postgres``: every history in a PostgreSQL world (``running``
    must run PostgreSQL). ``encrypted``: in encrypted worlds, with rekeys among the steps."""
    source = variant_source(variant)
    worlds = (
        {
            False: World(
                running, one_redis=False, settle_source=source, postgres=True, encrypted=encrypted
            )
        }
        if postgres
        else {
            flag: World(running, one_redis=flag, settle_source=source, encrypted=encrypted)
            for flag in (True, False)
        }
    )
    try:
        with _quiet():
            return _explore(
                worlds, seconds, first_seed, variant, stop_at_first, progress, histories
            )
    finally:
        for world in worlds.values():
            world.close()


def _explore(
    worlds: dict[bool, World],
    seconds: float,
    first_seed: int,
    variant: str | None,
    stop_at_first: bool,
    progress: Callable[[Figures], None] | None,
    histories: int | None,
) -> tuple[Figures, list[Finding]]:
    figures, findings = Figures(), []
    started = time.monotonic()
    seed = first_seed
    while time.monotonic() - started < seconds and (
        histories is None or figures.histories < histories
    ):
        world = worlds[seed % 2 == 0] if len(worlds) == 2 else next(iter(worlds.values()))
        # PostgreSQL worlds sweep: there the sweep rewrites rows (values due, spent fences).
        history = world.run(
            random_history(
                seed, sweeps=world.postgres, database=world.postgres, rekeys=world.encrypted
            )
        )
        figures.add(history)
        violations = check(history)
        if violations:
            actions = shrink(world, history.actions)
            shrunk = world.run(actions)
            findings.append(
                Finding(
                    seed,
                    world.one_redis,
                    variant,
                    actions,
                    check(shrunk) or violations,
                    world.postgres,
                    world.encrypted,
                )
            )
            if stop_at_first or len(findings) >= _MAX_FINDINGS:
                break
        seed += 1
        if progress is not None and figures.histories % 100 == 0:
            figures.seconds = time.monotonic() - started
            progress(figures)
    figures.seconds = time.monotonic() - started
    return figures, findings


def shrink(world: World, actions: Sequence[Action]) -> list[Action]:
    """The smallest sub-list of ``actions`` found to still break an invariant (ddmin: drop
    ever smaller chunks, keep whatever still fails), then each long jump of time shortened."""

    def fails(candidate: list[Action]) -> bool:
        return bool(check(world.run(candidate)))

    current = list(actions)
    chunks = 2
    while len(current) >= 2:
        size = max(1, len(current) // chunks)
        for start in range(0, len(current), size):
            candidate = current[:start] + current[start + size :]
            if candidate and fails(candidate):
                current, chunks = candidate, max(chunks - 1, 2)
                break
        else:
            if size == 1:
                break
            chunks = min(len(current), chunks * 2)
    for i, action in enumerate(current):
        if action.name == "advance" and action.args and action.args[0] > 1:
            shorter = [*current[:i], Action("advance", (action.args[0] // 2,)), *current[i + 1 :]]
            if fails(shorter):
                current = shorter
    return current


def keep(finding: Finding, directory: Path = REGRESSIONS) -> Path:
    """Write ``finding`` as a regression test (``test_histories.py`` replays the folder)."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"{finding.variant}-" if finding.variant else ""
    prefix += "postgres-" if finding.postgres else ""
    prefix += "encrypted-" if finding.encrypted else ""
    path = directory / f"{prefix}seed-{finding.seed}.json"
    path.write_text(render(finding.as_json()))
    return path


def render(data: dict[str, object]) -> str:
    """A kept history as JSON with one step a line (reviewable in a diff)."""
    head = {k: v for k, v in data.items() if k != "actions"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    steps = [f"  {json.dumps(step)}" for step in data["actions"]]  # type: ignore[attr-defined]
    return "{\n" + "\n".join(lines) + '\n "actions": [\n' + ",\n".join(steps) + "\n ]\n}\n"


def replay(path: Path, running: Servers, *, postgres: bool | None = None) -> list[str]:
    """Run a kept history again: its violations, if it fails once more. ``postgres``: in a
    PostgreSQL world (True) or a Redis one (False) whatever store it was found on; None:
    on its own (``"store"``, Redis for files older than the PostgreSQL worlds). A history
    found in a one-Redis world has no broker losses there; in another world its ``loss``
    steps do lose the broker, and the invariants must hold all the same."""
    data = json.loads(path.read_text())
    if postgres is None:
        postgres = data.get("store", "redis") == "postgres"
    world = World(
        running,
        one_redis=bool(data["one_redis"]),
        settle_source=variant_source(data["variant"]),
        postgres=postgres,
        encrypted=bool(data.get("encrypted", False)),
    )
    try:
        return check(world.run([Action.from_json(a) for a in data["actions"]]))
    finally:
        world.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.history", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--variant", help="a broken settle.lua of tests/history/variants")
    parser.add_argument("--keep", type=Path, default=REGRESSIONS, help="where reproducers go")
    parser.add_argument(
        "--store",
        choices=("redis", "postgres"),
        default="redis",
        help="redis: one- and two-Redis worlds; postgres: a PostgreSQL store beside the broker",
    )
    parser.add_argument(
        "--encrypted",
        action="store_true",
        help="encrypted worlds (two keys, a rotation under way), with rekeys among the steps",
    )
    options = parser.parse_args(argv)
    postgres = options.store == "postgres"
    with servers(postgres=postgres) as running:
        figures, findings = explore(
            running,
            seconds=options.seconds,
            first_seed=options.seed,
            variant=options.variant,
            stop_at_first=False,
            progress=lambda f: print(f.summary(), flush=True),
            postgres=postgres,
            encrypted=options.encrypted,
        )
    print(f"{options.store} worlds, seeds from {options.seed}: {figures.summary()}")
    for finding in findings:
        path = keep(finding, options.keep)
        print(f"VIOLATION (seed {finding.seed}, shrunk to {len(finding.actions)} steps, {path}):")
        for line in finding.violations[:5]:
            print(f"  {line}")
        print("  steps: " + ", ".join(map(str, finding.actions)))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
