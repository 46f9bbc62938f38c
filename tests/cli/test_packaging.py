"""Acceptance: ``pip install 'checkpointq[worker]'`` is one command beside each Celery line a
user may pin, and the base install is a producer that never imports Celery or kombu.

Each case is a fresh venv with the pip that ``python -m venv`` bundles (what a new user
has: pip 23.2 on Python 3.11, whose resolver backtracked through 86 kombu releases when the
base install's redis-py did not fit the installed kombu's redis extra). The user's Celery is
installed first, with or without its ``redis`` extra, then the wheel built from this checkout
with the worker extra, in one pip command that must neither fail nor backtrack, nor change
the user's Celery or kombu; then the venv's own ``checkpointq worker`` applies a save sent
from the venv. All venvs share pip's user cache, so only the first case downloads.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.venvs import installed, new_venv, pip

pytestmark = pytest.mark.integration

#: What pip prints when it starts backtracking through a package's releases.
BACKTRACKING = "pip is looking at multiple versions"

#: What a user's venv holds before checkpointq: each Celery line, with and without its redis
#: extra (kombu 5.5's caps redis-py at 5.2.1, 5.6's below 6.5, 5.7's starts at 6.4), and
#: nothing at all.
USER_PINS = [
    pytest.param(("celery==5.5.3",), id="celery-5.5"),
    pytest.param(("celery[redis]==5.5.3",), id="celery-redis-5.5"),
    pytest.param(("celery==5.6.3", "kombu==5.6.2"), id="celery-5.6"),
    pytest.param(("celery[redis]==5.6.3", "kombu==5.6.2"), id="celery-redis-5.6"),
    pytest.param(("celery==5.7.0",), id="celery-5.7"),
    pytest.param(("celery[redis]==5.7.0",), id="celery-redis-5.7"),
    pytest.param((), id="empty"),
]

#: Run in the user's venv: save through the public API, wait until applied, load it back,
#: and name the modules of Celery and kombu the producer imported on the way.
PRODUCER = """
import sys
from checkpointq import Checkpoint, CheckpointClient, Settings

with CheckpointClient.from_settings(Settings()) as client:
    handle = client.save(Checkpoint(session_id=sys.argv[1], version=3))
    client.wait_durable(handle, timeout=60)
    loaded = client.load(sys.argv[1])
print(loaded.version, sorted({name.split(".")[0] for name in sys.modules} & {"celery", "kombu"}))
"""


def _versions(python: Path, *names: str) -> dict[str, str | None]:
    """The installed version of each distribution named (``None``: not installed)."""
    versions = installed(python)
    return {name: versions.get(name) for name in names}


def _installed_env(settings: dict[str, object]) -> dict[str, str]:
    """``settings`` for a process of the user's venv: the checkout kept off its path."""
    env = checkpointq_env(**settings)
    del env["PYTHONPATH"]
    return env


def _produce(python: Path, session: str, env: dict[str, str], cwd: Path) -> str:
    produced = subprocess.run(
        [python, "-c", PRODUCER, session],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
        check=False,
    )
    assert produced.returncode == 0, f"{produced.stdout}\n{produced.stderr}"
    return produced.stdout.strip()


@pytest.mark.parametrize("pins", USER_PINS)
def test_the_worker_extra_installs_in_one_command_beside_each_celery_and_applies_a_save(
    pins: tuple[str, ...],
    wheel: Path,
    worker_settings: dict[str, object],
    tmp_path: Path,
) -> None:
    # Given a user's venv holding their own Celery (or nothing)
    python = new_venv(tmp_path / "venv")
    if pins:
        pinned = pip(python, "install", "-q", *pins)
        assert pinned.returncode == 0, pinned.stderr
    before = _versions(python, "celery", "kombu")

    # When the worker extra is installed, in one command
    added = pip(python, "install", f"{wheel}[worker]")

    # Then pip succeeds without backtracking, and the user's Celery and kombu stay as they were
    assert added.returncode == 0, f"{added.stdout}\n{added.stderr}"
    assert BACKTRACKING not in added.stdout + added.stderr, added.stdout
    after = _versions(python, "celery", "kombu", "redis")
    if pins:
        assert {name: after[name] for name in before} == before

    # And that venv's own worker applies a save sent from that venv
    env = _installed_env(worker_settings)
    command = [str(python.parent / "checkpointq"), "worker"]
    worker = CeleryProcess("worker", env, command=command).start(timeout=90)
    try:
        assert _produce(python, f"extra-{tmp_path.name}", env, tmp_path) == "3 []", after
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


def test_a_producer_without_celery_or_kombu_saves_waits_and_loads(
    wheel: Path,
    worker_settings: dict[str, object],
    checkout_worker: CeleryProcess,
    tmp_path: Path,
) -> None:
    # Given the base install (no extra) in a fresh venv: no Celery, no kombu
    python = new_venv(tmp_path / "venv")
    added = pip(python, "install", "-q", wheel)
    assert added.returncode == 0, added.stderr
    assert _versions(python, "celery", "kombu") == {"celery": None, "kombu": None}

    # When a producer there builds its client from Settings() and saves, waits and loads
    produced = _produce(python, "no-celery", _installed_env(worker_settings), tmp_path)

    # Then the checkpoint is applied, and nothing of Celery or kombu was imported
    assert produced == "3 []", checkout_worker.log()
