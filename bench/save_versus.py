"""The producer's save, this checkout against another one, side by side in one run.

    python -m bench.save_versus --other PATH [--label NAME] [--rounds 7] [--calls 2000]
                                [--warmup 4000] [--instructions] [--drain RATE [--pin]]
                                [--lockstep CHUNK]

``PATH`` is another checkout of checkpointq with its own ``.venv`` (e.g. ``git worktree add
/tmp/before 101094d && (cd /tmp/before && source scripts/setup-env)``): what a release
costs a save against an earlier one, which no benchmark of one tree can say. On one private
redis-server (broker and store alike, emptied before each round), each round runs one
process per checkout, alternating which goes first: ``--warmup`` saves, then ``--calls``
default-mode saves (``CheckpointClient.save`` of a ~20 KB checkpoint, staged, 100
sessions) timed one by one, the process's CPU time over them, and the server's time in
EVALSHA and in all commands (``INFO commandstats``) per save. Reports medians with min-max
and the median of the per-round ratios (this checkout / the other).

``--drain RATE`` runs each checkout's own worker in its round (prefork -c 2, store and
broker on the same server) and paces the timed saves at ``RATE`` per second once the
warm-up is drained: every save then finds its session as a deployment whose workers keep up
does, its previous request settled and its records gone, where without it each session
holds the ~60 requests queued before it. The worker shares the machine (its CPU and the
broker's single thread), as it would not in production; the broker's share is
publish.lua's own time per call, the p50 of a SLOWLOG that keeps every command. ``--pin``
puts the worker on the last CPU and the producer and broker on the first (``taskset``), so
that the worker's bursts do not preempt them (they then share one CPU).

``--lockstep CHUNK`` runs both checkouts at once instead, each on its own redis-server (and,
with ``--drain``, its own worker), in alternating chunks of ``CHUNK`` saves, and reports
the median and interquartile range of the per-chunk-pair ratios of the p50s: this machine's
speed drifts by a third from one second to the next, which a round of 2,000 saves against
the next cannot tell from a difference of 5%, and chunks of 50 taken in turns can.

``--instructions`` adds two more rounds per checkout against a redis-server run under
valgrind's callgrind, counting the instructions it spends in EVALSHA per save: the scripts'
cost on the broker, with each session's requests left queued, then with its records
removed after each save as its settle would (the state ``--drain`` measures, without the
worker's own scripts in the count), the same to about 1% from run to run whatever else the
machine runs (timings on a shared machine are not). Callgrind slows the server about 50
times: a round takes about 20 s here.

The warm-up is past what the producer's recovery window keeps (64 MiB by default, about
3,000 of these saves): until then each save's message and value are memory the process
has never used, and its page faults (about 8 a save) would be counted as the window's cost,
which a producer running for longer than that no longer pays.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench import worker_drain
from bench.harness import percentile, summarize
from bench.sweep_versus import Way
from tests.support.servers import RedisServer, end_process, free_port, wait_until

#: One round in a checkout's own interpreter: it imports that checkout's checkpointq only.
ROUND = """
import json, sys, time
import redis
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore
from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.servers import wait_until

url, calls, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rate, settled = float(sys.argv[4]), sys.argv[5] == "settled"
client = CheckpointClient(url, RedisStore.from_url(url))
raw = redis.Redis.from_url(url)
checkpoints = [make_checkpoint(f"s{i}", 20_000) for i in range(100)]
# The default key names spelled out: the other checkout's KeySpace may predate some of them.
internal = "agentorca-session.cq:"

def save(i):
    checkpoint = checkpoints[i % 100].model_copy(update={"version": i + 1})
    start = time.perf_counter()
    client.save(checkpoint)
    spent = time.perf_counter() - start
    if settled:  # what the session's last settle leaves (docs/protocol.md): no records
        sid = checkpoint.session_id
        raw.delete(internal + "pending-requests:" + sid, internal + "pending-counted:" + sid)
        raw.hdel(internal + "pending-counts", sid)
        raw.zrem(internal + "pending", sid)
    return spent

for i in range(warmup):
    save(i)
if rate:  # a worker drains: start from what it leaves, nothing queued
    wait_until(lambda: not (raw.llen("checkpoints") or raw.hlen("unacked")), timeout=300,
               interval=0.05, message="the worker drained the warm-up")
    raw.slowlog_reset()  # the broker's log of every command: the timed saves' only

def paced(i, k, start):  # save i, the k-th of saves paced from start (without a rate: now)
    if rate:  # each save at its time: a pause, not a synchronisation
        time.sleep(max(0.0, start + k / rate - time.perf_counter()))
    return save(i)

if len(sys.argv) > 6:  # lockstep: chunks of saves as the parent asks, figures after each
    i = warmup
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "end":
            break
        cpu, start = time.process_time(), time.perf_counter()
        micros = [paced(i + k, k, start) * 1e6 for k in range(int(line))]
        i += len(micros)
        print(json.dumps({"micros": micros, "cpu": (time.process_time() - cpu) * 1e6}),
              flush=True)
    sys.exit(0)

cpu, due = time.process_time(), time.perf_counter()
micros = sorted(paced(i, i - warmup, due) * 1e6 for i in range(warmup, warmup + calls))
cpu = (time.process_time() - cpu) * 1e6 / calls
client.close()
raw.close()
print(json.dumps({"p50": micros[len(micros) // 2], "p99": micros[int(len(micros) * 0.99)],
                  "cpu": cpu}))
"""

METRICS = {
    "p50": "save p50 (us)",
    "p99": "save p99 (us)",
    "cpu": "producer CPU per save (us)",
    "evalsha": "server time in EVALSHA per save (us)",
    "server": "server time in all commands per save (us)",
    "publish": "broker's time in publish.lua, p50 of its calls (us, SLOWLOG)",
}
#: How many commands the broker's SLOWLOG keeps in ``--drain`` (every command, then).
SLOWLOG_LENGTH = 400_000


def _saves(
    tree: Path,
    url: str,
    calls: int,
    warmup: int,
    rate: float = 0,
    settled: bool = False,
    pinned: bool = False,
) -> dict[str, float]:
    """One round's saves in ``tree``'s own interpreter: its figures (p50, p99, cpu), paced
    at ``rate`` saves/s after the queue drained (0: back to back, no waiting); ``settled``:
    each save's session records removed after it, as its settle would."""
    python = tree / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [
            *(["taskset", "-c", "0"] if pinned else []),
            *(str(python), "-c", ROUND, url, str(calls), str(warmup), str(rate)),
            "settled" if settled else "queued",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        sys.exit(f"the round in {tree} failed:\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


@dataclass(frozen=True, slots=True)
class Plan:
    """What each round does: ``warmup`` saves, then ``calls`` timed ones, paced at ``rate``
    per second with each checkout's worker draining (0: none, back to back), ``pinned``
    to CPUs."""

    calls: int
    warmup: int
    rate: float = 0
    pinned: bool = False


def _round(tree: Path, server: RedisServer, raw: redis.Redis, plan: Plan) -> dict[str, float]:
    raw.flushall()
    raw.config_resetstat()
    if plan.rate:
        return _drained_round(tree, server, raw, plan)
    figures = _saves(tree, server.url, plan.calls, plan.warmup)
    stats: dict[str, Any] = raw.info("commandstats")
    saves = plan.calls + plan.warmup
    figures["evalsha"] = stats.get("cmdstat_evalsha", {}).get("usec", 0) / saves
    figures["server"] = sum(v.get("usec", 0) for v in stats.values()) / saves
    return figures


def _drained_round(
    tree: Path, server: RedisServer, raw: redis.Redis, plan: Plan
) -> dict[str, float]:
    """A round with ``tree``'s own worker draining the queue (prefork -c 2, as
    ``sweep_versus`` starts it), the timed saves paced at ``rate``: each finds its session as
    a deployment whose workers keep up does (the previous request settled, its records
    gone). The broker's per-command statistics then mix in the worker's calls, so its share
    is publish.lua's own time per call, from a SLOWLOG that keeps every command."""
    publish = hashlib.sha1(
        (tree / "tasks" / "lua" / "publish.lua").read_bytes(), usedforsecurity=False
    ).hexdigest()
    command = Way("worker", tree).command()
    if plan.pinned:  # the worker on the last CPU, broker and producer (_saves) on the first
        command = ["taskset", "-c", str((os.cpu_count() or 2) - 1), *command]
        assert server.process is not None
        pid = str(server.process.pid)
        subprocess.run(["taskset", "-p", "-c", "0", pid], check=True, capture_output=True)
    with worker_drain.running_worker(
        server, server, command=command, extra_env={"PYTHONPATH": str(tree)}
    ):
        raw.config_set("slowlog-log-slower-than", 0)
        raw.config_set("slowlog-max-len", SLOWLOG_LENGTH)
        figures = _saves(tree, server.url, plan.calls, plan.warmup, plan.rate, pinned=plan.pinned)
        log = raw.slowlog_get(SLOWLOG_LENGTH)
        raw.config_set("slowlog-log-slower-than", 10_000)
    durations = sorted(
        entry["duration"]
        for entry in log
        if entry["command"].startswith(b"EVALSHA " + publish.encode())
    )
    if durations:
        figures["publish"] = durations[len(durations) // 2]
    return figures


def _chunk(process: subprocess.Popen[str], tree: Path, saves: int) -> dict[str, Any]:
    """One chunk of ``saves`` by a lockstep round's process: its save times and CPU."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{saves}\n")
    process.stdin.flush()
    line = process.stdout.readline()
    if not line:  # its traceback went to stderr, which it shares with us
        sys.exit(f"the lockstep round in {tree} failed")
    reply: dict[str, Any] = json.loads(line)
    return reply


def _lockstep(
    trees: dict[str, Path], calls: int, warmup: int, chunk: int, rate: float = 0
) -> tuple[dict[str, list[float]], dict[str, float], list[float]]:
    """Both checkouts' saves at once, in alternating chunks of ``chunk``: each process on
    its own redis-server, warmed up, then ``chunk`` saves of one while the other waits,
    which goes first alternating. A machine whose speed drifts from one second to the next
    (this one's does, by a third) then drifts under both alike: the per-chunk ratios are
    what a round-by-round comparison cannot resolve. ``rate``: each checkout's own worker
    drains its server, and each chunk's saves are paced at ``rate`` per second (the other
    side's worker idles meanwhile). Returns each checkout's save times (us), its CPU per
    save (us) and the per-pair ratios of the chunks' p50s (first / second).
    """
    servers = {name: RedisServer().start() for name in trees}
    processes: dict[str, subprocess.Popen[str]] = {}
    workers = contextlib.ExitStack()
    try:
        for name, tree in trees.items():
            if rate:
                workers.enter_context(
                    worker_drain.running_worker(
                        servers[name],
                        servers[name],
                        command=Way("worker", tree).command(),
                        extra_env={"PYTHONPATH": str(tree)},
                    )
                )
            processes[name] = subprocess.Popen(
                [
                    str(tree / ".venv" / "bin" / "python"),
                    *("-c", ROUND, servers[name].url, "0", str(warmup), str(rate), "queued"),
                    "lockstep",
                ],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        for name, process in processes.items():
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                sys.exit(f"the lockstep round in {trees[name]} failed to start")
        micros: dict[str, list[float]] = {name: [] for name in trees}
        cpu = dict.fromkeys(trees, 0.0)
        ratios: list[float] = []
        for n in range(max(1, calls // chunk)):
            p50s: dict[str, float] = {}
            for name in list(trees) if n % 2 == 0 else list(reversed(trees)):
                reply = _chunk(processes[name], trees[name], chunk)
                micros[name] += reply["micros"]
                cpu[name] += reply["cpu"]
                p50s[name] = percentile(reply["micros"], 50)
            first, second = list(trees)
            ratios.append(p50s[first] / p50s[second])
        for process in processes.values():
            assert process.stdin is not None
            process.stdin.write("end\n")
            process.stdin.flush()
        for process in processes.values():
            process.wait(timeout=60)
    finally:
        for process in processes.values():
            if process.poll() is None:
                end_process(process, kill=True)
        workers.close()
        for server in servers.values():
            server.cleanup()
    return micros, {name: cpu[name] / len(micros[name]) for name in trees}, ratios


def _print_lockstep(
    trees: dict[str, Path], rounds: int, calls: int, warmup: int, chunk: int, rate: float
) -> None:
    """``rounds`` lockstep rounds (fresh servers and processes each), pooled."""
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    rounds = max(1, rounds)
    micros: dict[str, list[float]] = {name: [] for name in trees}
    cpus: dict[str, list[float]] = {name: [] for name in trees}
    ratios: list[float] = []
    for _ in range(rounds):
        round_micros, round_cpu, round_ratios = _lockstep(trees, calls, warmup, chunk, rate)
        for name in trees:
            micros[name] += round_micros[name]
            cpus[name].append(round_cpu[name])
        ratios += round_ratios
    cpu = {name: statistics.mean(values) for name, values in cpus.items()}
    first, second = list(trees)
    print(
        f"{began}, lockstep: {rounds} rounds of {len(ratios) // rounds} "
        f"chunks of {chunk} saves each way after {warmup}"
        + (f", paced at {rate:g}/s, each checkout's worker draining" if rate else "")
        + f", load {load:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; ratio = this / other"
    )
    print(f"| figure | this checkout | {second} | ratio |\n|---|---:|---:|---:|")
    for title, q in (("save p50 (us), all saves", 50), ("save p99 (us), all saves", 99)):
        mine, theirs = percentile(micros[first], q), percentile(micros[second], q)
        print(f"| {title} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.3f} |")
    print(
        f"| chunks' p50 ratio, median (min-max) of {len(ratios)} pairs | | | "
        f"{summarize(ratios).fmt('.3f')} |"
    )
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"| chunks' p50 ratio, interquartile range | | | {quartiles[0]:.3f}-{quartiles[2]:.3f} |")
    print(
        f"| producer CPU per save (us) | {cpu[first]:.1f} | {cpu[second]:.1f} | "
        f"{cpu[first] / cpu[second]:.3f} |"
    )


def _instructions(tree: Path, calls: int, warmup: int, settled: bool) -> float:
    """The instructions a fresh redis-server under callgrind spends in EVALSHA per save,
    for one round of ``tree``'s saves (``settled``: each session's records removed after
    each save, as a worker that keeps up leaves them)."""
    if shutil.which("valgrind") is None or shutil.which("redis-server") is None:
        sys.exit("--instructions needs valgrind and redis-server on PATH")
    workdir = Path(tempfile.mkdtemp(prefix="cq-callgrind-"))
    out, port = workdir / "callgrind.out", free_port()
    server = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--toggle-collect=evalShaCommand",
            f"--callgrind-out-file={out}",
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    raw = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    try:
        wait_until(raw.ping, timeout=120, interval=0.2, message="redis-server under callgrind")
        _saves(tree, f"redis://127.0.0.1:{port}/0", calls, warmup, settled=settled)
        raw.shutdown(nosave=True)
        server.wait(timeout=120)
    finally:
        raw.close()
        if server.poll() is None:
            end_process(server, kill=True)
    totals = [line for line in out.read_text().splitlines() if line.startswith("totals:")]
    shutil.rmtree(workdir, ignore_errors=True)
    return int(totals[0].split()[1]) / (calls + warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="another checkout")
    parser.add_argument("--label", default=None, help="its name in the report")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument(
        "--instructions", action="store_true", help="and count the broker's instructions"
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=0,
        metavar="RATE",
        help="saves/s: each checkout's own worker drains while the timed saves are paced",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="with --drain: the worker on the last CPU, producer and broker on the first",
    )
    parser.add_argument(
        "--lockstep",
        type=int,
        default=0,
        metavar="CHUNK",
        help="both checkouts at once, in alternating chunks of CHUNK saves",
    )
    options = parser.parse_args()
    if options.pin and (not options.drain or shutil.which("taskset") is None):
        sys.exit("--pin needs --drain and taskset (util-linux)")
    if options.lockstep and options.pin:
        sys.exit("--lockstep runs both checkouts' workers at once: not with --pin")
    here = Path(__file__).resolve().parents[1]
    other: Path = options.other.resolve()
    if not (other / ".venv" / "bin" / "python").exists():
        sys.exit(f"{other} has no .venv: run `source scripts/setup-env` there first")
    trees = {"this checkout": here, options.label or str(other): other}
    if options.lockstep:
        _print_lockstep(
            trees, options.rounds, options.calls, options.warmup, options.lockstep, options.drain
        )
        return
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    plan = Plan(options.calls, options.warmup, options.drain, options.pin)
    server = RedisServer().start()
    raw = server.client()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    try:
        for i in range(options.rounds):
            names = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in names:
                figures[name].append(_round(trees[name], server, raw, plan))
    finally:
        raw.close()
        server.cleanup()
    mine, theirs = figures["this checkout"], figures[list(trees)[1]]
    print(
        f"{began}, {options.rounds} rounds of {options.calls} saves after {options.warmup}"
        + (
            f", paced at {options.drain:g}/s, each checkout's worker draining"
            if options.drain
            else ""
        )
        + (", pinned" if options.pin else "")
        + ", "
        f"load {load:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; medians (min-max); ratio = this / other, per round"
    )
    print(f"| figure | this checkout | {list(trees)[1]} | ratio |\n|---|---:|---:|---:|")
    for key, title in METRICS.items() if options.rounds else ():  # --rounds 0: counts only
        if key not in mine[0] or key not in theirs[0]:
            continue
        a, b = [f[key] for f in mine], [f[key] for f in theirs]
        ratios = [x / y for x, y in zip(a, b, strict=True) if y]
        ratio = summarize(ratios).fmt(".3f")
        print(f"| {title} | {summarize(a).fmt('.1f')} | {summarize(b).fmt('.1f')} | {ratio} |")
    if options.instructions:
        for settled, state in ((False, "queued"), (True, "settled")):
            counts = [
                _instructions(tree, options.calls, options.warmup, settled)
                for tree in trees.values()
            ]
            print(
                f"| broker's instructions in EVALSHA per save, sessions {state} (thousands, "
                f"callgrind, one round) | {counts[0] / 1000:.1f} | {counts[1] / 1000:.1f} "
                f"| {counts[0] / counts[1]:.3f} |"
            )


if __name__ == "__main__":
    main()
