"""bench/save_versus.py's lockstep mode runs end to end (this checkout against itself; no
timing is asserted, ever: only that both sides were timed, chunk by chunk)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.parametrize("drain", [[], ["--drain", "200"]], ids=["queued", "drained"])
def test_lockstep_times_both_checkouts_in_alternating_chunks(drain: list[str]) -> None:
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("save_versus runs each checkout's own .venv; this tree has none")
    # When this checkout is compared with itself in 2 rounds of 3 chunks of 10 saves
    # (drained: each side's own worker applying them, the saves paced)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.save_versus", "--other", str(REPO)),
            *("--label", "same", "--lockstep", "10", "--calls", "30"),
            *("--warmup", "20", "--rounds", "2", *drain),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # Then it reports every chunk pair and each figure with a ratio
    assert done.returncode == 0, done.stderr
    assert "lockstep: 2 rounds of 3 chunks of 10 saves each way after 20" in done.stdout
    assert "median (min-max) of 6 pairs" in done.stdout
    for figure in ("save p50 (us), all saves", "save p99", "producer CPU per save"):
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {figure}"))
        assert float(re.findall(r"[\d.]+", row.split("|")[-2])[0]) > 0
