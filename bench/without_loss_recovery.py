"""A checkout of this commit without the broker's loss detection and recovery window, to
measure what they cost a save apart from everything else (issue 44, items 1-3).

    python -m bench.without_loss_recovery PATH
    python -m bench.save_versus --other PATH --label without [--drain 400 --pin]

Makes ``PATH`` a git worktree of ``HEAD`` with two changes, then its ``.venv``
(``scripts/setup-env``): publish.lua keeps the epoch as it was before (written once, read
back) but neither reads nor writes the pending mark or its ring, and replies with the
broker's time as the mark (rising, as a client expects, at no cost); and the producers'
recovery window is off by default (``DEFAULT_REPUBLISH_SECONDS = 0``). Replicated broker
durability is a mode a deployment asks for: the default ``local`` mode costs a save one
comparison, left in. What remains is every other guarantee, unchanged: the ratio
``save_versus`` reports is the cost of detection and recovery alone. The checkout is for
benchmarks only (its suffix-loss tests fail, as they should).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: publish.lua from the epoch's read to the delivery tag's: the mark, its ring and the loss
#: test, replaced by the epoch alone.
_MARK = re.compile(
    r"(local epoch = redis\.call\('GET', KEYS\[3\]\)\n).*?(\n-- The message's delivery tag)",
    re.DOTALL,
)
_WITHOUT_MARK = """\\1-- (bench.without_loss_recovery: no mark, no ring, no loss test)
local found, mark = 0, now_us
if not epoch then
  redis.call('SET', KEYS[3], ARGV[3])
  epoch = ARGV[3]
end\\2"""
_WINDOW = re.compile(r"^DEFAULT_REPUBLISH_SECONDS = [0-9.]+$", re.MULTILINE)


def _rewrite(path: Path, pattern: re.Pattern[str], replacement: str) -> None:
    text, count = pattern.subn(replacement, path.read_text())
    if count != 1:
        raise SystemExit(f"{path}: expected one match of {pattern.pattern!r}, found {count}")
    path.write_text(text)


def rewrite(tree: Path) -> None:
    """Take the mark and the window out of ``tree``'s publish.lua and window defaults."""
    _rewrite(tree / "tasks/lua/publish.lua", _MARK, _WITHOUT_MARK)
    _rewrite(tree / "tasks/producer/pending.py", _WINDOW, "DEFAULT_REPUBLISH_SECONDS = 0.0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="where the worktree goes (must not exist)")
    args = parser.parse_args()
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", args.path], check=True)
    rewrite(args.path)
    subprocess.run(["bash", "-c", "source scripts/setup-env"], cwd=args.path, check=True)
    print(f"{args.path}: this commit without loss detection and recovery", file=sys.stderr)


if __name__ == "__main__":
    main()
