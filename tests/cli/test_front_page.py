"""README.md is a front page over docs/, and the links between the pages hold (issue 25).

The README says what checkpointq is, how to start it and where to read on: at most a few
screens, with every page of docs/ one link away. Depth moves between pages over time, so
every relative link and ``#anchor`` of README.md, docs/ and clients/go/README.md is checked
against the headings of the page it names (GitHub's anchor rule).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.markdown import DOCUMENTS, README, ROOT

#: Lines the front page may take (redis-py's README is ~200; arq's and dramatiq's less).
MAX_README_LINES = 250
PAGES = [*DOCUMENTS, ROOT / "clients" / "go" / "README.md"]
_FENCED = re.compile(r"^\s*```.*?^\s*```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in _HEADING.findall(_FENCED.sub("", page.read_text()))}


def test_the_readme_fits_a_front_page_and_links_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    linked = {m.split("#")[0] for m in _LINK.findall(text)}
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"README links none of {sorted(pages - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for link in _LINK.findall(_FENCED.sub("", page.read_text())):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
