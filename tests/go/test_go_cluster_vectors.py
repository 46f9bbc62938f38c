"""The Go client's cluster key layout checked against ours: ``clients/go/testdata/
cluster_keys.json`` holds slots (``redis.crc.key_slot``), slot tags and session keys
(``ClusterKeySpace``) that the Go unit test ``TestClusterKeysMatchPython`` compares with its
own CRC16, tag table and keys. This test keeps the file equal to what store/keys.py computes
today; ``python -m tests.go.test_go_cluster_vectors`` rewrites it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from checkpointq.store.keys import ClusterKeySpace, slot_tags

VECTORS = Path(__file__).parents[2] / "clients" / "go" / "testdata" / "cluster_keys.json"

#: Hash-tag rules at their edges (empty tags, unclosed and nested braces), non-ASCII ids.
_KEYS = [
    "",
    "a",
    "123456789",
    "{user1000}.following",
    "{user1000}.followers",
    "foo{}{bar}",
    "foo{{bar}}zap",
    "foo{bar}{zap}",
    "{}",
    "}{",
    "{a",
    "a}",
    "{a}{b}",
    "agentorca-session:s1",
    "agentorca-session:{s1}",
    "agentorca-session:x{y}z",
    "agentorca-session:ünïcødé",
    "agentorca-session:日本語",
    "agentorca-session:🙂",
]
_SLOTS = [0, 1, 2, 3, 100, 1000, 4095, 8191, 8192, 12739, 16382, 16383]
_PREFIXES = ["agentorca-session", "tenant-b"]
_SESSIONS = ["s1", "with space", "{tagged}", "a{b}c", "{}", "ünïcødé", "x:y:*"]


def vectors() -> dict[str, Any]:
    tags = slot_tags()
    sessions = []
    for prefix in _PREFIXES:
        keys = ClusterKeySpace(prefix)
        for session_id in _SESSIONS:
            session = keys.session(session_id)
            sessions.append(
                {
                    "prefix": prefix,
                    "session": session_id,
                    "data": session.data,
                    "fence": session.fence,
                    "index": session.index,
                    "refusals": keys.refusals(session_id),
                }
            )
    return {
        "_comment": "written by `python -m tests.go.test_go_cluster_vectors`: do not edit",
        "slots": [{"key": key, "slot": key_slot(key.encode("utf-8"))} for key in _KEYS],
        "tags": {str(slot): tags[slot] for slot in _SLOTS},
        "tags_sha256": hashlib.sha256("\n".join(tags).encode()).hexdigest(),
        "sessions": sessions,
    }


def _render() -> str:
    return json.dumps(vectors(), indent=1, ensure_ascii=False) + "\n"


def test_go_cluster_vectors_match_the_python_layout() -> None:
    assert VECTORS.read_text(encoding="utf-8") == _render()


if __name__ == "__main__":
    VECTORS.write_text(_render(), encoding="utf-8")
