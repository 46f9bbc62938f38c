"""Acceptance: the built wheel, installed into a clean venv, is ``checkpointq.*`` and nothing else.

A user's project usually has its own ``tasks.py`` (Celery's layout), often a ``worker.py`` or
``store.py``. Installed, checkpointq must import as ``checkpointq`` (the public API),
``checkpointq.store``, ``checkpointq.tasks`` and ``checkpointq.worker`` only, and no process it
starts may pick up the user's modules from the current directory. The wheel is built from
this checkout and installed with its dependencies into a new venv, then ``up``, ``save
--wait`` and ``show`` run in a directory whose ``tasks.py``, ``worker.py``, ``store.py`` and
``checkpointq.py`` fail loudly if imported. Before the worker extra is added to that venv,
every command run there must say, in one line, that it needs ``checkpointq[worker]``, and
exit 2; ``--version`` and ``--help`` answer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import running
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: Seconds for building and installing (pip may resolve every dependency from its index).
INSTALL_TIMEOUT = 600
#: Seconds `up` may take to start or stop on a loaded two-core machine.
DEADLINE = 90
#: Modules a user's project may have beside it; importing any of them is the failure.
SHADOWS = ("tasks", "worker", "store", "checkpointq")
#: Commands run without the worker extra: none at all, one that runs Celery, ones that read.
COMMANDS = [(), ("worker",), ("ls",), ("show", "wheel-demo"), ("dlq", "ls")]

#: What each command printed, by its arguments.
Runs = dict[tuple[str, ...], subprocess.CompletedProcess[str]]


def _run(*args: str | Path, cwd: Path | None = None, timeout: float = INSTALL_TIMEOUT) -> str:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with the wheel and no extra (``pip install checkpointq``); its bin dir."""
    base = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "venv", base / "venv")
    _run(base / "venv" / "bin" / "python", "-m", "pip", "install", "-q", wheel)
    return base / "venv" / "bin"


@pytest.fixture(scope="module")
def without_extra(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Each of COMMANDS as run in ``venv`` before ``installed`` adds the worker extra to it."""
    cwd = tmp_path_factory.mktemp("no-extra")
    answered = (("--version",), ("--help",))
    return {args: _checkpointq(venv, cwd, *args) for args in (*COMMANDS, *answered)}


@pytest.fixture(scope="module")
def installed(
    wheel: Path,
    venv: Path,
    without_extra: Runs,
) -> Path:
    """``venv`` with the worker extra added (`up` runs a worker and beat); its bin dir.

    One venv serves both installs, so the test without the extra costs one more pip call,
    not a venv of its own; ``without_extra`` is a dependency so that it runs first.
    """
    _run(venv / "python", "-m", "pip", "install", "-q", f"{wheel}[worker]")
    return venv


@pytest.fixture
def user_project() -> Iterator[Path]:
    """A project directory whose own top-level modules must never be imported by checkpointq.

    Directly under the temp directory, not pytest's: `up` keeps its Redis socket under
    ``project/.checkpointq``, and pytest's numbered base (``pytest-108/popen-gw1/<test>``)
    once made that path longer than a unix socket may be, which `up` rightly refuses.
    """
    project = Path(tempfile.mkdtemp(prefix="cq-project-"))
    for name in SHADOWS:
        (project / f"{name}.py").write_text(
            f"open({str(project / (name + '.imported'))!r}, 'w').close()\n"
            f"raise ImportError('the user project\\'s {name}.py was imported')\n"
        )
    yield project
    shutil.rmtree(project, ignore_errors=True)


def _tail(log: Path, lines: int = 60) -> str:
    """The end of a process's log, for a failure message."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _env(bin_dir: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINTQ_", "PYTHON"))}
    return {**base, "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"}


def _checkpointq(
    bin_dir: Path, cwd: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``checkpointq ARGS`` from ``bin_dir``, run in ``cwd`` as a user's shell runs it."""
    return subprocess.run(
        [bin_dir / "checkpointq", *args],
        cwd=cwd,
        env=_env(bin_dir),
        input=input,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )


def test_wheel_installs_only_the_checkpointq_namespace(installed: Path) -> None:
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run(installed / "python", "-c", where).strip())
    ours = {p.name for p in site.iterdir() if p.name.lower().startswith("checkpointq")}
    assert "checkpointq" in ours
    assert not any((site / name).exists() for name in ("store", "tasks", "worker"))
    package = site / "checkpointq"
    assert sorted(p.name for p in package.iterdir() if p.name != "__pycache__") == [
        "__init__.py",
        "integrations",
        "py.typed",
        "store",
        "tasks",
        "worker",
    ]
    # The package root is the public API (checkpointq/__init__.py), with the installed version.
    version = "import checkpointq; print(checkpointq.__version__, checkpointq.CheckpointClient)"
    # (Run outside the checkout, whose own checkpointq/ would come first on sys.path.)
    assert _run(installed / "python", "-c", version, cwd=site).startswith("0.1.0 <class")
    # The Lua scripts are package data, read at import time by the store.
    assert {p.name for p in (package / "store" / "lua").glob("*.lua")} >= {"save.lua"}


def test_without_the_worker_extra_every_command_names_it_in_one_line(
    without_extra: Runs,
) -> None:
    # Given the wheel installed with no extra: no Celery, kombu, click, redbeat or rich
    # When each command runs (in the fixture, before the extra is added)
    for args in COMMANDS:
        done = without_extra[args]
        # Then it fails with exit 2 (a missing dependency), one line naming the extra, no
        # traceback
        lines = done.stderr.splitlines()
        assert (done.returncode, len(lines), done.stdout) == (2, 1, ""), (args, done.stderr)
        assert "pip install 'checkpointq[worker]'" in lines[0], (args, lines)
        assert "Traceback" not in done.stderr, (args, done.stderr)
    # And --version still answers
    version = without_extra[("--version",)]
    assert (version.returncode, version.stdout, version.stderr) == (
        0,
        "checkpointq, version 0.1.0\n",
        "",
    )
    # And --help says what this install holds and which extra the commands need
    help_ = without_extra[("--help",)]
    assert (help_.returncode, help_.stderr) == (0, ""), help_.stderr
    assert help_.stdout.startswith("Usage: checkpointq [OPTIONS] COMMAND [ARGS]...\n")
    assert "pip install 'checkpointq[worker]'" in help_.stdout


@pytest.fixture
def up(installed: Path, user_project: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [str(installed / "checkpointq"), "up"]
    with running(command, user_project, _env(installed), grace=DEADLINE) as process:
        yield process


def test_installed_up_save_show_never_import_the_users_modules(
    installed: Path, user_project: Path, up: subprocess.Popen[bytes]
) -> None:
    def checkpointq(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return _checkpointq(installed, user_project, *args, input=input)

    log = user_project / "up.log"

    def serving_or_exited() -> bool:
        return up.poll() is not None or checkpointq("stats").returncode == 0

    # Given `up` from the installed wheel, started in a project with its own tasks.py etc.
    # (an `up` that exited never serves: the wait ends there, and the failure shows its log)
    try:
        wait_until(serving_or_exited, timeout=DEADLINE, message="installed checkpointq up")
    except AssertionError as failure:
        raise AssertionError(f"{failure} to serve; up.log:\n{_tail(log)}") from failure
    assert up.poll() is None, f"up exited with code {up.returncode}; up.log:\n{_tail(log)}"

    # When a checkpoint is saved and waited for, then shown, from the same directory
    document = {"sessionId": "wheel-demo", "version": 3, "metadata": {"totalTokens": 11}}
    wait = ("--wait", "--timeout", str(DEADLINE))
    saved = checkpointq("save", "-", *wait, input=json.dumps(document))
    assert saved.returncode == 0, saved.stderr
    shown = checkpointq("show", "wheel-demo", "--json")
    assert shown.returncode == 0, shown.stderr

    # Then it round-trips, `up` stops cleanly, and none of the user's modules was ever imported
    assert json.loads(shown.stdout)["metadata"]["totalTokens"] == 11
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=DEADLINE) == 0, log.read_text(errors="replace")
    imported = sorted(p.name for p in user_project.glob("*.imported"))
    assert imported == [], log.read_text(errors="replace")
