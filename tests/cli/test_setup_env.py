"""``./scripts/up``'s set-up: progress on a first run, and only what running needs.

A copy of this checkout (its tracked files, no ``.venv``) gets the set-up ``scripts/up``
sources; pip's cache makes it a matter of seconds to a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a first set-up may take (pip may resolve every dependency from its index).
SETUP_TIMEOUT = 600


def _checkout_copy(target: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file() and not source.is_symlink():
            (target / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name.decode())
    return target


def _set_up_for_running(checkout: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """What ``scripts/up`` sources before ``checkpointq up``, in ``checkout``."""
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail; CHECKPOINTQ_SETUP=run source scripts/setup-env"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=SETUP_TIMEOUT,
        check=False,
    )


def test_up_set_up_shows_progress_and_installs_no_dev_tools(tmp_path: Path) -> None:
    # Given a fresh checkout with no .venv
    checkout = _checkout_copy(tmp_path / "checkout")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTQ_")}

    # When scripts/up's set-up runs (what it sources before `checkpointq up`)
    done = _set_up_for_running(checkout, env)

    # Then it said what it was doing, and the venv runs checkpointq without any dev tool
    assert done.returncode == 0, done.stderr
    assert "== creating .venv" in done.stderr
    assert "== installing checkpointq (run)" in done.stderr
    assert "== installed" in done.stderr
    bin_dir = checkout / ".venv" / "bin"
    version = subprocess.run(
        [bin_dir / "checkpointq", "--version"], capture_output=True, text=True, check=True
    )
    assert "checkpointq, version" in version.stdout
    for tool in ("pytest", "ruff", "mypy"):
        assert not (bin_dir / tool).exists(), f"{tool} installed by scripts/up"
    # And a second run installs nothing
    again = _set_up_for_running(checkout, env)
    assert again.returncode == 0, again.stderr
    assert "installing" not in again.stderr
