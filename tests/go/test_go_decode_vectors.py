"""The decode table (``tests/store/go_decode_vectors.json``) run through Go itself.

Each vector's input is stored as the Go store would find it (zstd JSON at ``<prefix>:<id>``);
the Go program's ``Load`` (encoding/json) must read exactly the table's ``go`` column, or fail
where the column is null. Beside it, checkpointq's ``load`` reads the same as Go or refuses
the value, and what checkpointq stores for an accepted document Go reads the same again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
import zstandard

from checkpointq.store import CorruptCheckpoint, RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from tests.support.gostore import GoStore, GoStoreError

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[1] / "store" / "go_decode_vectors.json").read_text(encoding="utf-8")
)


def _known_fields(document: dict[str, Any]) -> dict[str, Any]:
    """What Go keeps of a checkpoint document: its struct's fields only."""
    known = {"sessionId", "version", "conversationHistory", "metadata", "lastRunRef"}
    out = {k: v for k, v in document.items() if k in known}
    meta = {"totalMessages", "totalTokens", "totalCostUSD", "startTime", "lastMessageTime"}
    out["metadata"] = {k: v for k, v in out["metadata"].items() if k in meta}
    if "conversationHistory" in out:
        message = {"role", "content", "traceEntries"}
        out["conversationHistory"] = [
            {k: v for k, v in m.items() if k in message} for m in out["conversationHistory"]
        ]
    return out


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_go_reads_each_vector_as_the_table_says_and_we_agree_or_refuse(
    vector: dict[str, Any], go_store: GoStore, real_redis: redis.Redis
) -> None:
    # Given the vector stored where Go's RedisStore reads it
    real_redis.set(
        "agentorca-session:v", zstandard.ZstdCompressor().compress(vector["input"].encode())
    )
    store = RedisStore(real_redis)
    # Then Go's Load reads the table's column (or fails where it says null)
    if vector["go"] is None:
        with pytest.raises(GoStoreError):
            go_store.load("v")
    else:
        assert go_store.load("v") == json.loads(vector["go"])
    # And checkpointq reads the same, or refuses the value
    if vector["ours"] == "refuse":
        with pytest.raises(CorruptCheckpoint):
            store.load("v")
        return
    ours = store.load("v")
    assert ours is not None
    assert _known_fields(checkpoint_to_wire(ours)) == json.loads(vector["go"])
    # And what checkpointq stores for it, Go reads the same again
    assert store.save(ours, seq=1).applied
    assert go_store.load(ours.session_id) == json.loads(vector["go"])
