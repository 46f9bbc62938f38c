"""Fixtures of the CLI tests: a clean working directory and environment per test.

Settings read ``CHECKPOINTQ_*`` variables and a ``.env`` file in the working directory, so
every test runs in its own empty directory with every inherited ``CHECKPOINTQ_*`` removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner, Result

from checkpointq.store import RedisStore
from checkpointq.worker.cli import cli
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.servers import RedisServer
from tests.support.workers import TEST_WORKER_SETTINGS

#: Seconds a CLI subprocess may run before the test fails.
COMMAND_TIMEOUT = 60
#: The checkout the install tests build their wheel from.
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Cli:
    """Runs ``checkpointq`` in-process (CliRunner) or as a real process, in one directory."""

    cwd: Path
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, *args: str, input: str | bytes | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)

    def process_env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTQ_")}
        return {**base, **self.env}

    def run(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """``python -m checkpointq.worker.cli ARGS`` in a process of its own, as a shell runs it."""
        return subprocess.run(
            [sys.executable, "-m", "checkpointq.worker.cli", *args],
            cwd=self.cwd,
            env=self.process_env(),
            input=input.decode() if input is not None else None,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )


@contextlib.contextmanager
def running(
    command: list[str], cwd: Path, env: dict[str, str], *, grace: float
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running in ``cwd`` with its output in ``cwd/up.log``; stopped on exit.

    SIGTERM first, SIGKILL after ``grace`` seconds, so a test that fails midway never leaves
    a system running behind it.
    """
    log = (cwd / "up.log").open("wb")
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, with no CHECKPOINTQ_* variable inherited."""
    for name in list(os.environ):
        if name.startswith("CHECKPOINTQ_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def cli_offline(workdir: Path) -> Cli:
    """The CLI with no broker configured at all."""
    return Cli(workdir)


@pytest.fixture
def cli_env(
    workdir: Path,
    redis_client: redis.Redis,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> Cli:
    """The CLI pointed at the private redis-server (emptied for this test)."""
    env = {"CHECKPOINTQ_BROKER_URL": redis_server.url}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Cli(workdir, env)


@pytest.fixture
def store(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[RedisStore]:
    """The store the CLI reads, with the default prefix, on the private server."""
    opened = RedisStore.from_url(redis_server.url)
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, once per run (the install tests share it)."""
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (found,) = dist.glob("checkpointq-*.whl")
    return found


@pytest.fixture(scope="module")
def worker_settings(broker_server: RedisServer, store_server: RedisServer) -> dict[str, object]:
    """The ``CHECKPOINTQ_*`` settings of the install tests' workers and producers."""
    return {
        **TEST_WORKER_SETTINGS,
        "broker_url": broker_server.url,
        "store_url": store_server.url,
    }


@pytest.fixture(scope="module")
def checkout_worker(worker_settings: dict[str, object]) -> Iterator[CeleryProcess]:
    """A worker run from this checkout, applying what a user's venv sends."""
    process = CeleryProcess("worker", checkpointq_env(**worker_settings)).start()
    try:
        yield process
    finally:
        code = process.stop()
        print(f"--- worker log (exit {code}) ---\n{process.log()}")
