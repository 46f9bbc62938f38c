"""bench/without_loss_recovery.py still finds what it takes out (a change to publish.lua or
to the window's default would otherwise leave a benchmark comparing a tree with itself)."""

from __future__ import annotations

import shutil
from pathlib import Path

import redis

from bench import without_loss_recovery

REPO = Path(__file__).resolve().parents[2]


def test_the_rewrite_takes_out_the_mark_and_the_window_and_leaves_a_script_redis_loads(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Given copies of the tree's publish.lua and the producer's window defaults
    script = tmp_path / "tasks/lua/publish.lua"
    defaults = tmp_path / "tasks/producer/pending.py"
    for copy in (script, defaults):
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / copy.relative_to(tmp_path), copy)

    # When the bench's checkout rewrites them
    without_loss_recovery.rewrite(tmp_path)

    # Then the script neither reads nor writes the pending mark (KEYS[4]) and still loads,
    # and the window is off by default
    code = [line for line in script.read_text().splitlines() if not line.startswith("--")]
    assert not any("KEYS[4]" in line for line in code)
    assert any("local found, mark = 0, now_us" in line for line in code)
    assert redis_client.script_load(script.read_text())
    assert "DEFAULT_REPUBLISH_SECONDS = 0.0" in defaults.read_text()
