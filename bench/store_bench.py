"""Store section: ``RedisStore.save``/``load`` against a plain ``SET``/``GET`` of the same bytes.

Same client, same server, same run, interleaved repetitions: the ratio is what the fenced
Lua write plus serialization and compression cost over the cheapest possible Redis write of
the value Go would store. ``SET`` carries ``PX`` (the TTL), as the Go store's write does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import redis
import zstandard

from bench.harness import (
    RunConfig,
    SectionReport,
    Summary,
    Target,
    ops_per_second,
    per_call_seconds,
    private_redis,
    summarize,
)
from bench.workload import make_checkpoint
from checkpointq.store import (
    Checkpoint,
    RedisStore,
    checkpoint_from_wire,
    deserialize_checkpoint,
    serialize_checkpoint,
)
from checkpointq.store.redis import STAGE_FROM_BYTES
from checkpointq.store.serde import checkpoint_to_wire

SIZES = (("2 KB", 2_000), ("20 KB", 20_000), ("200 KB", 200_000))
#: Distinct sessions saved in turn, so no measurement rewrites one hot key only.
SESSIONS = 32
OPS = ("save", "SET", "load", "GET")
#: Target of the performance issue: save at least half as fast as SET of the same bytes.
SAVE_VS_SET_TARGET = 0.5
#: zstd levels compared at each size: the store's (1) and its neighbours.
LEVELS = (-1, 1, 3)


@dataclass(frozen=True, slots=True)
class SizeResult:
    """Everything measured for one checkpoint size."""

    label: str
    json_bytes: int
    stored_bytes: int
    rates: dict[str, Summary]
    save_vs_set: Summary
    load_vs_get: Summary
    #: Where one save's and one load's time goes, in microseconds (medians).
    save_split: dict[str, float]
    load_split: dict[str, float]
    #: Redis's own CPU per call (INFO commandstats), microseconds: the script and a SET.
    server_us: dict[str, float]
    #: zstd level -> (stored bytes, compress microseconds), for this size's JSON.
    levels: dict[int, tuple[int, float]]


def run(config: RunConfig) -> SectionReport:
    seconds = 0.05 if config.quick else 1.0
    results = [_measure_size(label, size, config, seconds) for label, size in SIZES]
    report = SectionReport("store", "Store: RedisStore vs plain SET/GET")
    _write(report, results, config, seconds)
    return report


def _measure_size(label: str, size: int, config: RunConfig, seconds: float) -> SizeResult:
    with private_redis() as client:
        store = RedisStore(client, prefix="bench")
        checkpoints = [make_checkpoint(f"s{i}", size) for i in range(SESSIONS)]
        ids = [cp.session_id for cp in checkpoints]
        stored = [store.encode(cp).value for cp in checkpoints]
        plain = [f"bench-plain:{i}" for i in range(SESSIONS)]
        ttl_ms = int(store.options.ttl_seconds * 1000)
        ops: dict[str, Callable[[int], object]] = {
            "save": lambda i: store.save(checkpoints[i % SESSIONS]),
            "SET": lambda i: client.set(plain[i % SESSIONS], stored[i % SESSIONS], px=ttl_ms),
            "load": lambda i: store.load(ids[i % SESSIONS]),
            "GET": lambda i: client.get(plain[i % SESSIONS]),
        }
        for op in ops.values():  # warm up: scripts loaded, keys present, connection open
            for i in range(SESSIONS):
                op(i)
        rates: dict[str, list[float]] = {name: [] for name in OPS}
        for rep in range(config.repeats):
            # Rotate the order so drift in machine load does not always favour one side.
            for name in OPS[rep % 4 :] + OPS[: rep % 4]:
                rates[name].append(ops_per_second(ops[name], seconds))
        save_split, load_split = _cpu_split(store, client, checkpoints[0], config)
        server_us = _server_split(store, client, checkpoints, stored, config)
    return SizeResult(
        label,
        len(serialize_checkpoint(checkpoints[0])),
        len(stored[0]),
        {name: summarize(values) for name, values in rates.items()},
        summarize([s / p for s, p in zip(rates["save"], rates["SET"], strict=True)]),
        summarize([g / p for g, p in zip(rates["load"], rates["GET"], strict=True)]),
        save_split,
        load_split,
        server_us,
        _levels(serialize_checkpoint(checkpoints[0]), config),
    )


def _cpu_split(
    store: RedisStore, client: redis.Redis, checkpoint: Checkpoint, config: RunConfig
) -> tuple[dict[str, float], dict[str, float]]:
    """Median microseconds of each step of a save and of a load, timed one at a time."""
    session_id = checkpoint.session_id
    json_bytes = serialize_checkpoint(checkpoint)
    value = store.codec.encode(json_bytes)
    keys = store.keys.session(session_id).as_list()

    def script_call() -> object:
        # The script as ``save`` calls it: the value as its argument, or staged (sent to a
        # staging key in the same round trip) from ``store.stage_from_bytes``.
        return store._save_direct(session_id, value, store.now_seq(), "")

    wire = checkpoint_to_wire(checkpoint)
    steps: dict[str, Callable[[], object]] = {
        "validate (task's JSON data -> pydantic)": lambda: checkpoint_from_wire(wire),
        "serialize (pydantic -> Go JSON)": lambda: serialize_checkpoint(checkpoint),
        "compress (zstd)": lambda: store.codec.encode(json_bytes),
        "save.lua round trip": script_call,
        "GET round trip": lambda: client.get(keys[0]),
        "decompress (zstd)": lambda: store.codec.decode(value),
        "deserialize (JSON -> pydantic)": lambda: deserialize_checkpoint(json_bytes),
    }
    calls = 20 if config.quick else 200
    micros = {
        name: summarize([per_call_seconds(fn, calls) * 1e6 for _ in range(config.repeats)]).median
        for name, fn in steps.items()
    }
    names = list(steps)
    return {n: micros[n] for n in names[:4]}, {n: micros[n] for n in names[4:]}


def _server_split(
    store: RedisStore,
    client: redis.Redis,
    checkpoints: list[Checkpoint],
    stored: list[bytes],
    config: RunConfig,
) -> dict[str, float]:
    """Redis's own microseconds per call (INFO commandstats) of save.lua, of the other commands
    of a save (those it runs, and a staged save's staging SET), and of a SET of the same
    bytes, each measured on its own after a stats reset."""
    calls = 50 if config.quick else 2_000
    ttl_ms = int(store.options.ttl_seconds * 1000)

    def per_call(run: Callable[[int], object]) -> dict[str, dict[str, float]]:
        client.config_resetstat()
        for i in range(calls):
            run(i)
        stats: dict[str, dict[str, float]] = client.info("commandstats")
        return stats

    saves = per_call(lambda i: store.save(checkpoints[i % SESSIONS]))
    script = saves["cmdstat_evalsha"]["usec_per_call"]
    inside = (
        sum(stat["usec"] for name, stat in saves.items() if name != "cmdstat_evalsha")
        / saves["cmdstat_evalsha"]["calls"]
    )
    sets = per_call(
        lambda i: client.set(f"bench-plain:{i % SESSIONS}", stored[i % SESSIONS], px=ttl_ms)
    )
    return {
        "save.lua (EVALSHA)": script,
        "the save's other commands (HMGET, SET or RENAME, HSET, ...)": inside,
        "SET of the same bytes": sets["cmdstat_set"]["usec_per_call"],
    }


def _levels(json_bytes: bytes, config: RunConfig) -> dict[int, tuple[int, float]]:
    """Stored size and compression time of ``json_bytes`` at each of ``LEVELS``."""
    calls = 20 if config.quick else 200
    out: dict[int, tuple[int, float]] = {}
    for level in LEVELS:
        cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        compress = partial(cctx.compress, json_bytes)
        times = [per_call_seconds(compress, calls) for _ in range(config.repeats)]
        out[level] = (len(cctx.compress(json_bytes)), summarize(times).median * 1e6)
    return out


def _write(
    report: SectionReport, results: list[SizeResult], config: RunConfig, seconds: float
) -> None:
    lines = report.lines
    lines += [
        f"Each figure: median of {config.repeats} runs of {seconds:g} s (min-max), one "
        f"private redis-server per size, {SESSIONS} sessions saved in turn, one client. "
        "`SET`/`GET` move the very bytes `save` stores (zstd of the Go JSON), `SET` with "
        "`PX` like the Go store. Checkpoints are generated conversations (Zipf-distributed "
        "words, numbers, JSON tool traces; seeded), not repeated characters.",
        "",
        "| size | JSON bytes | stored bytes | zstd ratio | save ops/s | SET ops/s | "
        "**save / SET** | load ops/s | GET ops/s | **load / GET** |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.json_bytes:,} | {r.stored_bytes:,} | "
            f"{r.json_bytes / r.stored_bytes:.2f}x | {r.rates['save'].fmt()} | "
            f"{r.rates['SET'].fmt()} | **{r.save_vs_set.fmt('.2f', 'x')}** | "
            f"{r.rates['load'].fmt()} | {r.rates['GET'].fmt()} | "
            f"**{r.load_vs_get.fmt('.2f', 'x')}** |"
        )
    lines += [
        "",
        "Where one operation's time goes (microseconds per call, medians, each step timed "
        "alone in a loop; the steps of `save` after validation, and those of `load`, add up "
        "to roughly their cost):",
        "",
        "| size | "
        + " | ".join(results[0].save_split)
        + " | "
        + " | ".join(results[0].load_split)
        + " |",
        "|---|" + "---:|" * (len(results[0].save_split) + len(results[0].load_split)),
    ]
    for r in results:
        cells = [f"{v:,.0f}" for v in (*r.save_split.values(), *r.load_split.values())]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Validation is the worker task's step before `save` (the task argument checked into "
        "a model), not part of `RedisStore.save`; the other save steps are.",
        "",
        f"Values of {STAGE_FROM_BYTES // 1024} KB or more stored are staged: `save` sends "
        "them to a staging key of their own and runs `save.lua` in the same round trip, and "
        "the script renames the staging key onto the data key, so Redis never copies the "
        "value through Lua (below that size staging measured no gain). Here that is the "
        "largest size; its script round trip and Redis's time below are the staged ones, "
        "the staging `SET` counted among the save's other commands.",
        "",
        "What Redis itself spends per call (microseconds, INFO commandstats over "
        f"{50 if config.quick else 2_000:,} calls each, after a stats reset):",
        "",
        "| size | " + " | ".join(results[0].server_us) + " |",
        "|---|" + "---:|" * len(results[0].server_us),
    ]
    for r in results:
        lines.append(
            f"| {r.label} | " + " | ".join(f"{v:,.1f}" for v in r.server_us.values()) + " |"
        )
    lines += [
        "",
        "zstd level against stored size and compression time (the store uses level 1; Go "
        "reads any level; median microseconds per call, timed alone):",
        "",
        "| size | " + " | ".join(f"level {level}: bytes, ratio, us" for level in LEVELS) + " |",
        "|---|" + "---:|" * len(LEVELS),
    ]
    for r in results:
        cells = [
            f"{size:,}, {r.json_bytes / size:.2f}x, {micros:,.0f}"
            for size, micros in r.levels.values()
        ]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    report.targets += [
        Target(
            f"store save >= {SAVE_VS_SET_TARGET}x SET ({r.label})",
            f">= {SAVE_VS_SET_TARGET:.2f}x",
            r.save_vs_set.fmt(".2f", "x"),
            None if config.quick else r.save_vs_set.median >= SAVE_VS_SET_TARGET,
        )
        for r in results
    ]
    _plot(report, results, config)


def _plot(report: SectionReport, results: list[SizeResult], config: RunConfig) -> None:
    from bench import plots

    labels = [r.label for r in results]
    plots.grouped_bars(
        config.out_dir / "store_ops.png",
        "RedisStore vs plain SET/GET of the same stored bytes",
        labels,
        {name: [r.rates[name] for r in results] for name in OPS},
        "operations per second (log)",
        log=True,
    )
    names = list(results[0].save_split) + list(results[0].load_split)
    parts = {n: [{**r.save_split, **r.load_split}[n] for r in results] for n in names}
    plots.grouped_bars(
        config.out_dir / "store_split.png",
        "Cost of each step of a save and a load (median us per call)",
        labels,
        {n: [Summary(v, v, v, 1) for v in values] for n, values in parts.items()},
        "microseconds per call (log)",
        log=True,
    )
    report.plots += ["store_ops.png", "store_split.png"]
