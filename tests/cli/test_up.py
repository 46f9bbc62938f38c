"""Acceptance: `checkpointq up` from a clean directory with no Redis URL is a working system.

Real processes throughout: `up` (embedded redis-server, Celery worker and beat) runs as a
subprocess; save, show and sweep run as separate `checkpointq` processes, as from another
shell; SIGINT then stops everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointq.store import RedisStore
from checkpointq.worker.embedded import pid_of
from tests.cli.conftest import Cli, running
from tests.cli.test_embedded import alive
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer, free_port, wait_until

pytestmark = pytest.mark.integration

#: Seconds `up` may take to start (or stop) on a loaded two-core machine.
DEADLINE = 90


def _checkpointq() -> list[str]:
    """The installed console script (what a user runs), beside this interpreter."""
    script = Path(sys.executable).parent / "checkpointq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "checkpointq.worker.cli"]


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def running_up(cli: Cli) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """`checkpointq up` running in ``cli``'s directory, killed if a test leaves it running."""
    return running([*_checkpointq(), "up"], cli.cwd, cli.process_env(), grace=DEADLINE)


@pytest.fixture
def system(cli_offline: Cli) -> Iterator[subprocess.Popen[bytes]]:
    with running_up(cli_offline) as process:
        yield process


def test_up_without_a_url_saves_shows_sweeps_and_stops_on_sigint(
    cli_offline: Cli, system: subprocess.Popen[bytes]
) -> None:
    data_dir = cli_offline.cwd / ".checkpointq"
    log = cli_offline.cwd / "up.log"

    # Given `up` started with nothing configured: its embedded Redis appears in ./.checkpointq
    wait_until(
        lambda: cli_offline.run("stats").returncode == 0,
        timeout=DEADLINE,
        message=f"checkpointq up to serve; log: {log}",
    )
    redis_pid = pid_of(data_dir)
    assert redis_pid is not None and alive(redis_pid)
    children = _children(system.pid)
    assert len(children) == 3  # redis-server, worker, beat

    # When a checkpoint is saved from another process and waited for
    document = {"sessionId": "demo", "version": 2, "metadata": {"totalTokens": 7}}
    saved = cli_offline.run(
        "save", "-", "--wait", "--timeout", str(DEADLINE), input=json.dumps(document).encode()
    )
    assert saved.returncode == 0, saved.stderr

    # Then show reads it back
    shown = cli_offline.run("show", "demo", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["metadata"]["totalTokens"] == 7

    # And given a session whose lifetime ended long ago, a sweep by hand expires it
    socket_url = f"unix://{data_dir / 'redis.sock'}"
    stale = RedisStore.from_url(socket_url, clock=lambda: time.time() - 60 * 24 * 3600)
    stale.save(make_checkpoint("stale"))
    stale.close()
    swept = cli_offline.run("sweep", "--json")
    assert swept.returncode == 0, swept.stderr
    assert json.loads(swept.stdout)["expired"] == 1
    listed = json.loads(cli_offline.run("ls", "--json").stdout)
    assert listed["sessions"] == ["demo"]

    # When `up` gets SIGINT (Ctrl-C)
    system.send_signal(signal.SIGINT)

    # Then it exits cleanly, its children and the embedded Redis are gone, and so is the socket
    assert system.wait(timeout=DEADLINE) == 0, log.read_text()
    for pid in children:
        wait_until(lambda pid=pid: not alive(pid), timeout=DEADLINE, message=f"pid {pid} gone")
    assert not alive(redis_pid)
    assert not (data_dir / "redis.sock").exists()
    after = cli_offline.run("show", "demo")
    assert after.returncode == 1
    assert "no broker configured" in after.stderr

    # And the data is on disk for the next `up`
    assert any(path.name.startswith("appendonly") for path in data_dir.iterdir())
    assert os.path.getsize(log) > 0


def test_up_on_a_password_url_never_shows_the_password_and_stops_on_sigterm(
    cli_offline: Cli,
) -> None:
    # Given a Redis that requires a password, and `up` configured with it
    secret = "pw-" + os.urandom(8).hex()
    server = RedisServer(password=secret).start()
    cli_offline.env["CHECKPOINTQ_BROKER_URL"] = server.url
    try:
        with running_up(cli_offline) as system:
            # When the system is used from another process
            wait_until(
                lambda: cli_offline.run("stats").returncode == 0,
                timeout=DEADLINE,
                message="checkpointq up to serve",
            )
            outputs = [
                cli_offline.run(
                    "save",
                    "-",
                    "--wait",
                    "--timeout",
                    str(DEADLINE),
                    input=b'{"sessionId": "p", "version": 1}',
                ),
                cli_offline.run("show", "p"),
                cli_offline.run("stats", "--json"),
            ]
            assert all(out.returncode == 0 for out in outputs), [o.stderr for o in outputs]

            # Then SIGTERM stops it cleanly too
            system.send_signal(signal.SIGTERM)
            assert system.wait(timeout=DEADLINE) == 0
        # And neither the commands nor any log line of up, worker or beat shows the password
        shown = "".join(out.stdout + out.stderr for out in outputs)
        shown += (cli_offline.cwd / "up.log").read_text(errors="replace")
        assert "redis://:***@127.0.0.1" in shown
        assert secret not in shown
    finally:
        server.cleanup()


def test_scripts_up_passes_celery_style_options_onto_the_settings(cli_offline: Cli) -> None:
    # Given ./scripts/up started with the options Celery users type, and a data dir of its own
    data_dir = cli_offline.cwd / "data"
    cli_offline.env["CHECKPOINTQ_DATA_DIR"] = str(data_dir)
    log_path = cli_offline.cwd / "scripts-up.log"
    script = Path(__file__).resolve().parents[2] / "scripts" / "up"
    args = ["-c", "1", "-P", "solo", "-Q", "custom-q", "-n", "one@%h", "-l", "debug"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(script), *args], env=cli_offline.process_env(), stdout=log, stderr=log
        )
    try:
        # When it is ready
        wait_until(
            lambda: "Ctrl-C to stop" in log_path.read_text(errors="replace"),
            timeout=DEADLINE,
            message=f"scripts/up ready; log: {log_path}",
        )

        # Then the worker runs with them: its name, queue, pool and log level
        health = json.loads(cli_offline.run("health", "--json").stdout)
        assert "one@" in health["checks"]["worker"]["detail"]
        text = log_path.read_text(errors="replace")
        assert "consumes queue 'custom-q'" in text
        assert "concurrency: 1 (solo)" in text
        assert "DEBUG" in text
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=DEADLINE) == 0, log_path.read_text(errors="replace")


def test_up_with_a_broker_it_cannot_reach_names_the_url_in_one_line(cli_offline: Cli) -> None:
    # Given a broker URL with a password, on a port where nothing listens
    port = free_port()
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    env = {**cli_offline.process_env(), "CHECKPOINTQ_BROKER_URL": url}

    # When `up` starts with it
    done = subprocess.run(
        [*_checkpointq(), "up"],
        cwd=cli_offline.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )

    # Then it fails at once, in one line naming the URL with its password hidden, and blames
    # neither beat nor the worker
    errors = [line for line in done.stderr.splitlines() if "checkpointq: error:" in line]
    assert done.returncode == 1, done.stderr
    assert errors == [line for line in done.stderr.splitlines() if line.strip()], done.stderr
    assert errors[0].startswith(
        f"checkpointq: error: cannot reach the broker at redis://:***@127.0.0.1:{port}/0: "
    ), errors
    assert "hunter2" not in done.stderr


def test_up_with_one_variable_keeps_sessions_in_postgresql(
    cli_offline: Cli, postgres_server: PostgresServer
) -> None:
    # Given `up` with nothing configured but a PostgreSQL store URL (and a schema of its own)
    cli_offline.env["CHECKPOINTQ_STORE_URL"] = postgres_server.url
    cli_offline.env["CHECKPOINTQ_PG_SCHEMA"] = "up_readme"
    try:
        with running_up(cli_offline) as system:
            wait_until(
                lambda: cli_offline.run("health").returncode == 0,
                timeout=DEADLINE,
                message="checkpointq up to serve, its store the database",
            )
            # When a checkpoint is saved from another process and waited for
            document = {"sessionId": "pg-demo", "version": 3, "metadata": {}}
            saved = cli_offline.run(
                "save",
                "-",
                "--wait",
                "--timeout",
                str(DEADLINE),
                input=json.dumps(document).encode(),
            )
            assert saved.returncode == 0, saved.stderr
            # Then it is a row of the database, and show reads it back
            assert postgres_server.psql("SELECT version FROM up_readme.sessions") == "3"
            shown = cli_offline.run("show", "pg-demo", "--json")
            assert json.loads(shown.stdout)["version"] == 3
            # And the ready block names the broker and the store apart, with both exports
            log = (cli_offline.cwd / "up.log").read_text(errors="replace")
            block = log[log.index("checkpointq is ready") :]
            assert "  store         postgresql://" in block
            assert "export CHECKPOINTQ_BROKER_URL=unix://" in block
            assert "export CHECKPOINTQ_STORE_URL=postgresql://" in block
            # And a shell that knows only the broker (no store URL) is told it reads
            # another store than the workers', instead of missing the session
            cli_offline.env.pop("CHECKPOINTQ_STORE_URL")
            for command in (["show", "pg-demo"], ["ls"], ["health"]):
                wrong = cli_offline.run(*command)
                assert wrong.returncode == 1, (command, wrong.stdout, wrong.stderr)
                said = wrong.stdout + wrong.stderr
                assert "identity" in said and "postgresql://" in said, (command, said)
            cli_offline.env["CHECKPOINTQ_STORE_URL"] = postgres_server.url
            system.send_signal(signal.SIGINT)
            assert system.wait(timeout=DEADLINE) == 0
    finally:
        postgres_server.psql("DROP SCHEMA IF EXISTS up_readme CASCADE")
