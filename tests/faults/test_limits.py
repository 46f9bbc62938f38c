"""Secrets stay out of logs and errors; memory stays bounded under a flood of big messages."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from tests.faults.harness import (
    SAVE,
    Deployment,
    Request,
    checkpointq_env,
    envelope,
    push,
    rss_bytes,
    seq_base,
)
from tests.support.servers import RedisServer, free_port, wait_until

SECRET = "s3cret-Pa55word-" + uuid.uuid4().hex[:8]


def test_passwords_never_appear_in_worker_logs_cli_output_or_errors(tmp_path: Path) -> None:
    # Given a broker and store that require a password
    broker = RedisServer(password=SECRET).start()
    store = RedisServer(password=SECRET).start()
    dep = Deployment(broker, store)
    try:
        # When a worker runs against them and applies a save
        worker = dep.worker()
        good = Request(SAVE, "secret-test", seq_base(), version=1)
        push(dep.broker_client(), [good.envelope()])
        dep.settle([good], timeout=30)
        # and the CLI is used, with the right password and against a server that is down
        down = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
        outputs = []
        for url in (broker.url, down):
            env = checkpointq_env(broker_url=url, store_url=url)
            for args in (["stats"], ["ls"], ["show", "secret-test"], ["dlq", "ls"]):
                done = subprocess.run(
                    [sys.executable, "-m", "checkpointq.worker.cli", *args],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                outputs.append(done.stdout + done.stderr)
        # and a worker is started with a wrong password (its errors name the URL)
        wrong = dep.env()
        wrong["CHECKPOINTQ_STORE_URL"] = f"redis://:{SECRET}x@127.0.0.1:{store.port}/0"
        bad = subprocess.run(
            [sys.executable, "-m", "checkpointq.worker.cli", "sweep"],
            cwd=tmp_path,
            env=wrong,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        outputs.append(bad.stdout + bad.stderr)
        # Then the password shows up nowhere
        assert worker.running()
        assert SECRET not in worker.log()
        for text in outputs:
            assert SECRET not in text, text[-2000:]
        assert any("secret-test" in text for text in outputs), "the CLI never reached the store"
        assert bad.returncode != 0
    finally:
        dep.cleanup()
        broker.cleanup()
        store.cleanup()


def test_worker_memory_stays_bounded_under_a_flood_of_large_messages(
    deployment: Deployment,
) -> None:
    # Given a worker with a 512 KiB message limit
    deployment.settings["max_message_bytes"] = 512 * 1024
    worker = deployment.worker()
    baseline = rss_bytes(worker.pid)
    # When 40 oversize (2 MiB) and 200 large valid (~300 KiB) messages arrive at once
    big = "z" * (2 * 1024 * 1024)

    def flood(round_: int) -> tuple[int, int]:
        """Push 40 oversize (2 MiB) and 200 large valid (~300 KiB) messages; return the
        flood's size and the peak RSS of the worker (all processes) while it drained."""
        oversize = [
            envelope(SAVE, [{"sessionId": f"huge-{i}", "version": 1, "lastRunRef": big}], {})
            for i in range(40)
        ]
        base = seq_base()
        valid = [
            Request(
                SAVE,
                f"large-{i:03d}",
                base + i,
                round_ * 1000 + i,
                messages=30,
                content_size=10_000,
            )
            for i in range(200)
        ]
        messages = [*oversize, *(r.envelope() for r in valid)]
        push(deployment.broker_client(), messages)
        peak = [baseline]

        def drained() -> bool:
            peak.append(rss_bytes(worker.pid))
            return deployment.backlog() == 0

        wait_until(drained, timeout=240, interval=0.05, message="the flood to drain")
        deployment.settle(valid, timeout=60)
        return sum(len(m) for m in messages), max(peak)

    # When two floods of 40 oversize and 200 large valid messages arrive, one after the other
    total, first = flood(1)
    _, second = flood(2)
    # Then the oversize ones are dead-lettered, the worker never held a flood at once (its
    # growth stays below the flood's size) and a second flood adds next to nothing: memory
    # is bounded by the prefetch window and the size limit, not by the queue
    mib = 1 << 20
    summary = (
        f"baseline {baseline // mib} MiB, peak {first // mib} then {second // mib} MiB, "
        f"flood {total // mib} MiB"
    )
    assert deployment.dead_letters().count() == 80
    assert worker.running()
    assert first - baseline < total, summary
    assert second - first < total / 4, summary
