"""The fenced code blocks of README.md and docs/*.md, as the documentation tests read them.

A block may be indented (inside a list item); its fence, its body and the marker before it
are read without that indentation. A block is marked as not meant to run by the line before
its fence: ``<!-- readme-test: not runnable (reason) -->``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Every page whose blocks are tested: the README first, then docs/ in name order.
DOCUMENTS = (README, *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_SKIP = re.compile(r"^\s*<!-- readme-test: not runnable \((.+)\) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    skip: str | None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page in order, with their language and skip reason."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, indent = i, match.group(1)
        i += 1
        body: list[str] = []
        while lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        skip = _SKIP.match(lines[start - 1]) if start > 0 else None
        code = textwrap.dedent("\n".join(body)) if indent else "\n".join(body)
        found.append(Block(path, start + 1, match.group(2), code, skip.group(1) if skip else None))
        i += 1
    return found


def all_blocks() -> list[Block]:
    """The blocks of every tested page, the README's first."""
    return [block for path in DOCUMENTS for block in blocks(path)]
