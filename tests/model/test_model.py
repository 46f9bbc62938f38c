"""The write-behind protocol's model (tests/model/protocol.pml), checked by Spin.

scripts/check-model searches every reachable state of the v2 protocol in its scope
(tests/model/README.md): the correct model must violate no invariant, and each deliberately
broken variant (the holes of issue 31, and the load's order) must violate the invariant
named for it. This test runs that script once and holds each run to its expectation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-model"
CORRECT = [
    "correct-ties",
    "correct-window",
    "correct-ids",
    "correct-clocks",
    "correct-record-loss",
    "correct-purge",
    "correct-unaware",
]
VARIANTS = [
    "settle-by-seq",
    "no-publish-clock-check",
    "short-tombstone",
    "no-lifetime",
    "global-ids",
    "store-first-load",
    "deadline-at-broker-read",
    "no-mark",
    "no-record-counts",
    "sweep-queue-only",
    "settle-counts-any-missing",
    "settle-any-delivery",
    "mark-without-token",
]


@pytest.fixture(scope="module")
def report() -> str:
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install spin gcc)")
    done = subprocess.run(
        [str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode in (0, 1), done.stderr
    return done.stdout


def outcome(report: str, name: str) -> str:
    """The script's line for the run ``name``."""
    pattern = re.compile(rf"(ok|FAIL) +{re.escape(name)} ")
    lines = [line for line in report.splitlines() if pattern.match(line)]
    assert len(lines) == 1, report
    return lines[0]


@pytest.mark.parametrize("name", CORRECT)
def test_the_correct_model_has_no_violation_in_its_whole_scope(report: str, name: str) -> None:
    # Given the v2 protocol and a cast of replicas, When Spin searches every state of it
    line = outcome(report, name)
    # Then it finds no violation, and the search was complete
    assert line.startswith("ok ") and "no violation (exhaustive)" in line, report


@pytest.mark.parametrize("name", VARIANTS)
def test_each_broken_variant_violates_its_invariant(report: str, name: str) -> None:
    # Given a variant with one rule of the protocol broken, When Spin searches it
    line = outcome(report, name)
    # Then it finds a violation of the invariant that rule protects
    assert line.startswith("ok ") and "as expected" in line, report
