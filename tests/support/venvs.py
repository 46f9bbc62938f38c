"""Fresh virtualenvs and pip, for the tests that install the built wheel as a user does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: Seconds for one pip command (a resolve from the index on a loaded machine).
PIP_TIMEOUT = 300


def new_venv(where: Path) -> Path:
    """A fresh venv with the pip ``venv`` bundles (not upgraded: a new user's); its python."""
    subprocess.run([sys.executable, "-m", "venv", where], check=True, timeout=120)
    return where / "bin" / "python"


def pip(python: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m pip ARGS``, its output captured; pip's user cache serves every venv."""
    return subprocess.run(
        [python, "-m", "pip", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT,
        check=False,
    )


def installed(python: Path) -> dict[str, str]:
    """Every distribution in the venv, by normalised name, with its version."""
    done = pip(python, "list", "--format=freeze")
    assert done.returncode == 0, done.stderr
    pairs = (line.split("==", 1) for line in done.stdout.splitlines() if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}
