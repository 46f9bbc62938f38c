"""What encryption at rest costs: producer save p50, worker drain and load p50, with and
without ``CHECKPOINTQ_ENCRYPTION_KEYS``, in one run, as medians of interleaved repeats.

    .venv/bin/python bench/encryption_bench.py [--rounds 5] [--saves 300] [--size 20000]
        [--turns 1]

Two private redis-servers (broker, store) and two real workers, one with keys and one
without, each on a queue of its own. Each round, for each mode in alternating order: a
producer (with or without the keys) saves ``--saves`` checkpoints to a queue no worker
reads, timing each ``save`` (staged saves, the default on Redis); the queue is then renamed
onto its worker's queue and timed until drained; then each session is loaded once through
the producer (pending records, then the store), timing each ``load``. ``--turns``: saves
per session (1: every save a new session, so every seal derives its session's key; an
agent's turns save one session again and again, and its key is then derived once).
Each save's wall time and the producer thread's CPU time are reported (two
``time.thread_time`` calls a save, the same in both modes), and the load average: on a
shared machine the CPU p50 says what the wall-clock p50 cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import summarize  # noqa: E402
from bench.workload import make_checkpoint  # noqa: E402
from checkpointq.store import RedisStore, StoreOptions  # noqa: E402
from checkpointq.store.encryption import Keyring, generate_key  # noqa: E402
from checkpointq.tasks.producer.client import CheckpointClient  # noqa: E402
from tests.support.celery_processes import CeleryProcess, checkpointq_env  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained  # noqa: E402

MODES = ("clear", "encrypted")


def _p50_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def one_round(
    mode: str,
    round_no: int,
    broker: RedisServer,
    client: CheckpointClient,
    saves: int,
    size: int,
    turns: int = 1,
) -> tuple[float, float, float, float]:
    """(save p50 us, drain saves/s, load p50 us, save CPU p50 us) of one mode's round: the
    CPU is the producer thread's own (``time.thread_time``), which a loaded machine's
    waits for a core do not inflate as they do the wall-clock p50."""
    held, queue = f"held-{mode}", f"q-{mode}"
    checkpoints = [
        make_checkpoint(f"{mode}-{round_no}-{i // turns}", size, seed=i).model_copy(
            update={"version": i % turns + 1}
        )
        for i in range(saves)
    ]
    assert client.queue == held
    save_times, save_cpu = [], []
    for cp in checkpoints:
        cpu, started = time.thread_time(), time.perf_counter()
        client.save(cp)
        save_times.append(time.perf_counter() - started)
        save_cpu.append(time.thread_time() - cpu)
    redis_client = broker.client()
    started = time.perf_counter()
    redis_client.rename(held, queue)
    wait_redis_queue_drained(broker.client, timeout=600, queue=queue)
    drain = saves / (time.perf_counter() - started)
    load_times = []
    for cp in checkpoints[turns - 1 :: turns]:  # each session's last save
        started = time.perf_counter()
        loaded = client.load(cp.session_id)
        load_times.append(time.perf_counter() - started)
        assert loaded is not None and loaded.version == cp.version
    redis_client.close()
    return _p50_us(save_times), drain, _p50_us(load_times), _p50_us(save_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--saves", type=int, default=300)
    parser.add_argument("--size", type=int, default=20_000, help="checkpoint JSON bytes")
    parser.add_argument("--turns", type=int, default=1, help="saves per session")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    keys = f"bench:{generate_key()}"
    broker, store = RedisServer().start(), RedisServer().start()
    workers: dict[str, CeleryProcess] = {}
    clients: dict[str, CheckpointClient] = {}
    try:
        for mode in MODES:
            settings = {
                **TEST_WORKER_SETTINGS,
                "broker_url": broker.url,
                "store_url": store.url,
                "queue": f"q-{mode}",
                "max_message_bytes": 8 * 1024 * 1024,
            }
            if mode == "encrypted":
                settings["encryption_keys"] = keys
            workers[mode] = CeleryProcess("worker", checkpointq_env(**settings)).start()
            options = StoreOptions(encryption=Keyring.parse(keys) if mode == "encrypted" else None)
            clients[mode] = CheckpointClient(
                broker.url, RedisStore.from_url(store.url, options=options), queue=f"held-{mode}"
            )
        results: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in MODES}
        for round_no in range(args.rounds):
            order = MODES if round_no % 2 == 0 else MODES[::-1]
            for mode in order:
                result = one_round(
                    mode, round_no, broker, clients[mode], args.saves, args.size, args.turns
                )
                results[mode].append(result)
                print(
                    f"round {round_no} {mode:9}: save p50 {result[0]:.0f} us, drain "
                    f"{result[1]:.0f}/s, load p50 {result[2]:.0f} us, save CPU p50 "
                    f"{result[3]:.0f} us",
                    flush=True,
                )
        print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(
            f"\n{args.rounds} interleaved rounds, {args.saves} saves of ~{args.size} B JSON, "
            f"{args.turns} per session"
        )
        print("| | save p50 (us) | worker drain (saves/s) | load p50 (us) | save CPU p50 (us) |")
        print("|---|---|---|---|---|")
        for mode in MODES:
            cols = []
            for i in range(4):
                cols.append(summarize([r[i] for r in results[mode]]).fmt(".0f"))
            print(f"| {mode} | " + " | ".join(cols) + " |")
        for i, name in enumerate(("save p50", "drain", "load p50", "save CPU p50")):
            clear = statistics.median(r[i] for r in results["clear"])
            enc = statistics.median(r[i] for r in results["encrypted"])
            print(f"{name}: encrypted / clear = {enc / clear:.3f}")
    finally:
        for client in clients.values():
            client.close()
        for worker in workers.values():
            worker.stop()
        broker.cleanup()
        store.cleanup()


if __name__ == "__main__":
    main()
