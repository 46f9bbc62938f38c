"""Every ``sh`` and ``python`` block of the README runs as written against `checkpointq up`.

One real `checkpointq up` (embedded Redis, Celery worker and beat) runs in a fresh directory
whose ``.venv`` is this test's own environment, as in a checkout after ``./scripts/up``; each
block then runs there in a process of its own, in README order (later blocks may read what
earlier ones wrote). A block is skipped only when the line before its fence says why:
``<!-- readme-test: not runnable (reason) -->``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli.conftest import Cli
from tests.cli.test_up import DEADLINE, running_up
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_SKIP = re.compile(r"^<!-- readme-test: not runnable \((.+)\) -->$")
#: Seconds one block may run (a save --wait included).
BLOCK_TIMEOUT = 60


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    skip: str | None

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def readme_blocks() -> list[Block]:
    """The fenced blocks of the README in order, with their language and skip reason."""
    lines = README.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        skip = _SKIP.match(lines[start - 1]) if start > 0 else None
        blocks.append(
            Block(start + 1, match.group(1), "\n".join(body), skip.group(1) if skip else None)
        )
        i += 1
    return blocks


RUNNABLE = [b for b in readme_blocks() if b.lang in ("sh", "python")]


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
    assert [b for b in RUNNABLE if b.skip is None], "no runnable block found"
    langs = {b.lang for b in readme_blocks()}
    assert {"sh", "python"} <= langs


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
