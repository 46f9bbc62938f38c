"""Product modules open with a docstring a reader takes in at a glance (STYLE.md, issue 25).

A module docstring says what the module owns, the decision that shapes it, and where the rest
is documented, in the present tense. Its history, measurements and long rationale live in
docs/ (design.md, performance.md) and in commit messages, where they stay true.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.markdown import ROOT

#: The layers that ship (``checkpointq/`` holds the package root and symlinks to the rest).
PRODUCT = ("store", "tasks", "worker", "checkpointq")
#: Lines a module docstring may take, its summary line included.
MAX_LINES = 20


def _modules() -> list[Path]:
    found = []
    for layer in PRODUCT:
        for path in sorted((ROOT / layer).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if not any((ROOT / part).is_symlink() for part in _prefixes(relative)):
                found.append(path)
    return found


def _prefixes(relative: Path) -> list[Path]:
    return [Path(*relative.parts[: i + 1]) for i in range(len(relative.parts))]


def _docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False)


MODULES = _modules()


def test_the_product_modules_are_found() -> None:
    names = {str(path.relative_to(ROOT)) for path in MODULES}
    assert {"checkpointq/__init__.py", "store/redis.py", "worker/coalesce.py"} <= names
    assert not any(name.startswith("checkpointq/store/") for name in names)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_docstring_fits_a_glance_and_tells_no_history(path: Path) -> None:
    doc = _docstring(path)
    if doc is None:
        return
    lines = doc.strip("\n").splitlines()
    assert len(lines) <= MAX_LINES, (
        f"{path.relative_to(ROOT)} opens with {len(lines)} lines of docstring (at most "
        f"{MAX_LINES}): keep what it owns and why; move the rest to docs/"
    )
    history = re.search(r"\bused to\b", doc)
    assert history is None, f"{path.relative_to(ROOT)}: history belongs in docs/"
