"""Every ``sh`` and ``python`` block of README.md and docs/ runs as written against `up`.

One real `checkpointq up` (embedded Redis, Celery worker and beat) runs in a fresh directory
whose ``.venv`` is this test's own environment, as in a checkout after ``./scripts/up``; each
block then runs there in a process of its own: the README's in order, then each page of
docs/ in name order. Blocks share that one system, so each uses session ids of its own
(`test_examples_use_session_ids_of_their_own`) and runs the same in any order. A block is
skipped only when the line before its fence says why:
``<!-- readme-test: not runnable (reason) -->`` (tests/support/markdown.py reads them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import Cli
from tests.cli.test_up import DEADLINE, running_up
from tests.support.markdown import README, ROOT, Block, all_blocks, blocks
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration

#: Seconds one block may run (a save --wait included).
BLOCK_TIMEOUT = 60

RUNNABLE = [b for b in all_blocks() if b.lang in ("sh", "python")]
#: A session id a block writes, as a literal: a JSON ``"sessionId"`` or a ``session_id=``.
_SESSION_ID = re.compile(r"""(?:["']sessionId["']\s*:|session_id\s*=)\s*["']([^"']+)["']""")


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """`checkpointq up` in a directory laid out as a checkout: ``.venv`` is ours."""
    cwd = tmp_path_factory.mktemp("checkout")
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    cli = Cli(cwd)
    with running_up(cli):
        log = cwd / "up.log"
        wait_until(
            lambda: "Ctrl-C to stop" in log.read_text(errors="replace"),
            timeout=DEADLINE,
            message=f"checkpointq up's ready block; log: {log}",
        )
        yield cli


def test_the_readme_marks_every_block_it_does_not_run_and_runs_the_rest() -> None:
    assert [b for b in RUNNABLE if b.skip is None and b.path == README], "no runnable block"
    langs = {b.lang for b in blocks(README)}
    assert {"sh", "python"} <= langs


def test_examples_use_session_ids_of_their_own() -> None:
    # Given every runnable block, When the session ids each saves are collected,
    # Then no two blocks save the same session, so their results do not depend on order.
    owners: dict[str, Block] = {}
    for block in RUNNABLE:
        if block.skip is not None:
            continue
        for session_id in set(_SESSION_ID.findall(block.code)):
            first = owners.get(session_id)
            assert first is None, f"{block} reuses {session_id!r}, the session of {first}"
            owners[session_id] = block
    assert owners, "no block saves a session"


def test_up_ends_its_start_up_with_where_and_how_to_reach_it(system: Cli) -> None:
    text = (system.cwd / "up.log").read_text(errors="replace")
    block = text[text.index("checkpointq is ready") :]
    socket_url = f"unix://{system.cwd / '.checkpointq' / 'redis.sock'}"
    for expected in (
        f"data dir      {system.cwd / '.checkpointq'}",
        f"export CHECKPOINTQ_BROKER_URL={socket_url}",
        "Settings()",
        "docs/protocol.md",
        "Ctrl-C to stop",
    ):
        assert expected in block


def _import_in(cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by this venv's python in ``cwd``, as a reader's shell runs it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
        check=False,
    )


def test_the_readme_says_where_its_python_block_runs_and_why_not_in_the_clones_parent(
    tmp_path: Path,
) -> None:
    # Given the README's first Python block, and a directory laid out as a clone's parent: a
    # folder named checkpointq holding the checkout
    block = next(b for b in blocks(README) if b.lang == "python")
    (first,) = [line for line in block.code.splitlines() if line.startswith("from checkpointq")]
    (tmp_path / "checkpointq").symlink_to(ROOT)

    # When the block's import runs in the clone's directory, and in its parent
    in_clone = _import_in(ROOT, first)
    in_parent = _import_in(tmp_path, first)

    # Then it runs in the clone, fails in its parent (the clone's folder is imported as the
    # package, over the editable install), and the README says so beside the block
    assert in_clone.returncode == 0, in_clone.stderr
    assert "cannot import name" in in_parent.stderr, in_parent.stderr
    text = " ".join(README.read_text().split())
    assert "Run it in the clone's directory" in text
    assert "in its parent, Python imports the clone's folder `checkpointq/` as the package" in text


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_readme_block_runs_as_written(system: Cli, block: Block) -> None:
    if block.skip is not None:
        pytest.skip(f"marked not runnable: {block.skip}")
    if block.lang == "sh":
        command = ["bash", "-eo", "pipefail", "-c", block.code]
    else:
        command = [str(system.cwd / ".venv" / "bin" / "python"), "-c", block.code]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTQ_")}
    # The shell a reader has: this checkout's venv is activated by the block itself.
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )
    ran = subprocess.run(
        command,
        cwd=system.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
        check=False,
    )
    assert ran.returncode == 0, f"{block} failed:\n{ran.stdout}\n{ran.stderr}"
