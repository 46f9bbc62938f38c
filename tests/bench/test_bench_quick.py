"""The benchmark suite runs end to end in quick mode (no timing is asserted, ever)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.postgres import postgres_bin

REPO = Path(__file__).resolve().parents[2]


#: A hang guard, not a speed goal: the quick run takes about 3 min on this machine when quiet,
#: and timed out at 240 s beside other work (load 12); pytest-timeout's 300 s is raised to match.
QUICK_RUN_TIMEOUT = 600


@pytest.mark.integration
@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 60)
def test_quick_run_writes_a_report_with_every_section_and_its_plots(tmp_path: Path) -> None:
    # Given an empty output directory
    out = tmp_path / "results"

    # When the suite runs in quick mode, as CI runs it
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_TIMEOUT,
        check=False,
    )

    # Then it succeeds and writes the report with each section, its targets and its plots
    assert done.returncode == 0, done.stderr
    report = (out / "REPORT.md").read_text(encoding="utf-8")
    assert "Quick mode" in report
    for heading in (
        "## Targets",
        "## Store: RedisStore vs plain SET/GET",
        "## Sweep:",
        "## Asyncio client: latency and event-loop stalls",
    ):
        assert heading in report
    for row in ("save >= 0.5x SET (20 KB)", "expirations/s", "longest single Redis call"):
        assert row in report
    for plot in ("store_ops.png", "store_split.png", "sweep_time.png"):
        assert f"]({plot})" in report
        assert (out / plot).stat().st_size > 0
    # and the PostgreSQL section with its targets, where the server programs are installed
    assert "## PostgreSQL: queued saves against synchronous upserts" in report
    if postgres_bin() is not None:
        for row in (
            "postgres: producer save p50 vs PostgresStore.save, loopback",
            "postgres: producer save p50 vs PostgresStore.save, 1 ms RTT",
            "postgres: worker drain saves/s vs one loop of PostgresStore.save, 1 ms RTT",
            "postgres: worker drain saves/s vs 8 parallel loops, loopback",
            "postgres: sweep with nothing stale among",
            "postgres: expirations/s",
        ):
            assert row in report
    # and the peers section (issue 42): ours always, each peer measured or skipped, named
    assert "## Cost per turn: checkpointq against the Python peers" in report
    if postgres_bin() is not None:
        assert "| loopback | checkpointq |" in report
        for peer in ("LangGraph PostgresSaver", "Agents SQLAlchemySession"):
            assert f"| loopback | {peer} |" in report or f"**{peer}: skipped**" in report


def test_unknown_section_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # When a section that does not exist is asked for
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--sections", "nope", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Then the command fails with a usage error and writes no report
    assert done.returncode == 2
    assert "unknown section" in done.stderr
    assert not (tmp_path / "REPORT.md").exists()
