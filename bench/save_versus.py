"""The producer's save, this checkout against another one, side by side in one run.

    python -m bench.save_versus --other PATH [--label NAME] [--rounds 7] [--calls 2000]
                                [--warmup 4000] [--instructions]

``PATH`` is another checkout of checkpointq with its own ``.venv`` (e.g. ``git worktree add
/tmp/before 101094d && (cd /tmp/before && source scripts/setup-env)``): what a release
costs a save against an earlier one, which no benchmark of one tree can say. On one private
redis-server (broker and store alike, emptied before each round), each round runs one
process per checkout, alternating which goes first: ``--warmup`` saves, then ``--calls``
default-mode saves (``CheckpointClient.save`` of a ~20 KB checkpoint, staged, 100
sessions) timed one by one, the process's CPU time over them, and the server's time in
EVALSHA and in all commands (``INFO commandstats``) per save. Reports medians with min-max
and the median of the per-round ratios (this checkout / the other).

``--instructions`` adds one more round per checkout against a redis-server run under
valgrind's callgrind, counting the instructions it spends in EVALSHA per save: the scripts'
cost on the broker, the same to about 1% from run to run whatever else the machine runs
(timings on a shared machine are not). Callgrind slows the server about 50 times: a round
takes about 20 s here.

The warm-up is past what the producer's recovery window keeps (64 MiB by default, about
3,000 of these saves): until then each save's message and value are memory the process
has never used, and its page faults (about 8 a save) would be counted as the window's cost,
which a producer running for longer than that no longer pays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import summarize
from tests.support.servers import RedisServer, end_process, free_port, wait_until

#: One round in a checkout's own interpreter: it imports that checkout's checkpointq only.
ROUND = """
import json, sys, time
from bench.workload import make_checkpoint
from checkpointq.store import RedisStore
from checkpointq.tasks.producer.client import CheckpointClient

url, calls, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
client = CheckpointClient(url, RedisStore.from_url(url))
checkpoints = [make_checkpoint(f"s{i}", 20_000) for i in range(100)]

def save(i):
    checkpoint = checkpoints[i % 100].model_copy(update={"version": i + 1})
    start = time.perf_counter()
    client.save(checkpoint)
    return time.perf_counter() - start

for i in range(warmup):
    save(i)
cpu = time.process_time()
micros = sorted(save(i) * 1e6 for i in range(warmup, warmup + calls))
cpu = (time.process_time() - cpu) * 1e6 / calls
client.close()
print(json.dumps({"p50": micros[len(micros) // 2], "p99": micros[int(len(micros) * 0.99)],
                  "cpu": cpu}))
"""

METRICS = {
    "p50": "save p50 (us)",
    "p99": "save p99 (us)",
    "cpu": "producer CPU per save (us)",
    "evalsha": "server time in EVALSHA per save (us)",
    "server": "server time in all commands per save (us)",
}


def _saves(tree: Path, url: str, calls: int, warmup: int) -> dict[str, float]:
    """One round's saves in ``tree``'s own interpreter: its figures (p50, p99, cpu)."""
    python = tree / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [str(python), "-c", ROUND, url, str(calls), str(warmup)],
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


def _round(
    tree: Path, server: RedisServer, raw: redis.Redis, calls: int, warmup: int
) -> dict[str, float]:
    raw.flushall()
    raw.config_resetstat()
    figures = _saves(tree, server.url, calls, warmup)
    stats: dict[str, Any] = raw.info("commandstats")
    saves = calls + warmup
    figures["evalsha"] = stats.get("cmdstat_evalsha", {}).get("usec", 0) / saves
    figures["server"] = sum(v.get("usec", 0) for v in stats.values()) / saves
    return figures


def _instructions(tree: Path, calls: int, warmup: int) -> float:
    """The instructions a fresh redis-server under callgrind spends in EVALSHA per save,
    for one round of ``tree``'s saves."""
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
        _saves(tree, f"redis://127.0.0.1:{port}/0", calls, warmup)
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
    options = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    other: Path = options.other.resolve()
    if not (other / ".venv" / "bin" / "python").exists():
        sys.exit(f"{other} has no .venv: run `source scripts/setup-env` there first")
    trees = {"this checkout": here, options.label or str(other): other}
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    server = RedisServer().start()
    raw = server.client()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    try:
        for i in range(options.rounds):
            names = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in names:
                figures[name].append(
                    _round(trees[name], server, raw, options.calls, options.warmup)
                )
    finally:
        raw.close()
        server.cleanup()
    mine, theirs = figures["this checkout"], figures[list(trees)[1]]
    print(
        f"{began}, {options.rounds} rounds of {options.calls} saves after {options.warmup}, "
        f"load {load:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; medians (min-max); ratio = this / other, per round"
    )
    print(f"| figure | this checkout | {list(trees)[1]} | ratio |\n|---|---:|---:|---:|")
    for key, title in METRICS.items() if options.rounds else ():  # --rounds 0: counts only
        a, b = [f[key] for f in mine], [f[key] for f in theirs]
        ratios = [x / y for x, y in zip(a, b, strict=True) if y]
        ratio = summarize(ratios).fmt(".3f")
        print(f"| {title} | {summarize(a).fmt('.1f')} | {summarize(b).fmt('.1f')} | {ratio} |")
    if options.instructions:
        counts = [_instructions(tree, options.calls, options.warmup) for tree in trees.values()]
        print(
            f"| broker's instructions in EVALSHA per save (thousands, callgrind, one round) "
            f"| {counts[0] / 1000:.1f} | {counts[1] / 1000:.1f} | {counts[0] / counts[1]:.3f} |"
        )


if __name__ == "__main__":
    main()
