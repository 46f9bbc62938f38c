"""Keys are matched to fields as Go's encoding/json matches them, at every level.

The table is ``go_decode_vectors.json``: for each input document, ``go`` is what Go's
``json.Unmarshal`` into the ``Checkpoint`` struct followed by ``json.Marshal`` gives (``null``:
Go's ``Load`` fails), and ``ours`` says whether checkpointq accepts the document or refuses
it. ``tests/go/test_go_decode_vectors.py`` runs the table through the Go cross-check program
(encoding/json with the Go package's structs), which must read exactly the ``go`` column.

The rule proved here: for any input, checkpointq's reading and Go's reading agree, or the
document is refused with a reason; and the value checkpointq stores is read alike by both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
import zstandard

from checkpointq.store import (
    Checkpoint,
    CheckpointMetadata,
    ConversationMessage,
    CorruptCheckpoint,
    InvalidCheckpoint,
    RedisStore,
    checkpoint_from_wire,
    deserialize_checkpoint,
    serialize_checkpoint,
)
from checkpointq.store.serde import checkpoint_to_wire, dumps_go

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).with_name("go_decode_vectors.json")).read_text(encoding="utf-8")
)
_KNOWN = {
    "checkpoint": {"sessionId", "version", "conversationHistory", "metadata", "lastRunRef"},
    "message": {"role", "content", "traceEntries"},
    "metadata": {
        "totalMessages",
        "totalTokens",
        "totalCostUSD",
        "startTime",
        "lastMessageTime",
    },
}


def _as_go_reads_it(cp: Checkpoint) -> bytes:
    """The checkpoint as Go would marshal it after loading: unknown fields dropped."""
    wire = {k: v for k, v in checkpoint_to_wire(cp).items() if k in _KNOWN["checkpoint"]}
    wire["metadata"] = {k: v for k, v in wire["metadata"].items() if k in _KNOWN["metadata"]}
    if "conversationHistory" in wire:
        wire["conversationHistory"] = [
            {k: v for k, v in m.items() if k in _KNOWN["message"]}
            for m in wire["conversationHistory"]
        ]
    return dumps_go(wire)


def _keys_at_every_level(document: bytes) -> list[tuple[str, list[str]]]:
    """Every key of the stored document's checkpoint, metadata and message objects."""
    pairs: list[list[tuple[str, Any]]] = []

    def hook(items: list[tuple[str, Any]]) -> dict[str, Any]:
        pairs.append(items)
        return dict(items)

    top = json.loads(document, object_pairs_hook=hook)
    levels = [("checkpoint", list(top)), ("metadata", list(top["metadata"]))]
    levels += [("message", list(m)) for m in top.get("conversationHistory", [])]
    assert all(len(items) == len(dict(items)) for items in pairs), "a key repeated"
    return levels


def _ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


ACCEPTED = [v for v in VECTORS if v["ours"] == "accept"]
REFUSED = [v for v in VECTORS if v["ours"] == "refuse"]


def test_the_table_covers_every_level_both_ways() -> None:
    for level in ("checkpoint", "message", "metadata"):
        outcomes = {v["ours"] for v in VECTORS if v["level"] == level}
        assert outcomes == {"accept", "refuse"}, level
    # Every refusal is a document Go reads differently or cannot read at all.
    assert all(v["ours"] in ("accept", "refuse") for v in VECTORS)


@pytest.mark.parametrize("vector", ACCEPTED, ids=_ids(ACCEPTED))
def test_accepted_documents_read_as_go_reads_them(vector: dict[str, Any]) -> None:
    # Given a document Go decodes without error
    assert vector["go"] is not None
    # When checkpointq decodes it as stored bytes and as an already-parsed task argument
    from_bytes = deserialize_checkpoint(vector["input"].encode())
    from_argument = checkpoint_from_wire(json.loads(vector["input"]))
    # Then both readings are Go's, field for field
    assert _as_go_reads_it(from_bytes) == vector["go"].encode()
    assert from_argument == from_bytes


@pytest.mark.parametrize("vector", ACCEPTED, ids=_ids(ACCEPTED))
def test_stored_value_names_each_field_once_and_exactly(vector: dict[str, Any]) -> None:
    # Given what checkpointq stores for an accepted document
    stored = serialize_checkpoint(deserialize_checkpoint(vector["input"].encode()))
    # Then no key at any level is a case variant of a known field (Go would read it) ...
    for level, keys in _keys_at_every_level(stored):
        folded = {k.lower(): k for k in _KNOWN[level]}
        for key in keys:
            assert key in _KNOWN[level] or folded.get(key.lower()) is None, (level, key)
    # ... and reading it back, by us or by Go, gives the same checkpoint Go read at first
    assert _as_go_reads_it(deserialize_checkpoint(stored)) == vector["go"].encode()
    assert serialize_checkpoint(deserialize_checkpoint(stored)) == stored


@pytest.mark.parametrize("vector", REFUSED, ids=_ids(REFUSED))
def test_ambiguous_or_mistyped_documents_are_refused_with_a_reason(
    vector: dict[str, Any],
) -> None:
    with pytest.raises(InvalidCheckpoint) as caught:
        deserialize_checkpoint(vector["input"].encode())
    reason = str(caught.value)
    if vector["go"] is None:
        return  # Go's Load fails too; the reason names the field (tested in test_serde)
    # Go reads these, but differently from any single reading of the keys: the reason says
    # which keys collide on which field.
    assert "name the field" in reason and "ambiguous" in reason, reason


def test_reason_names_both_keys_the_field_and_the_message() -> None:
    document = (
        b'{"sessionId":"a","conversationHistory":[{"role":"u","content":"1"},'
        b'{"role":"u","content":"2","traceEntries":"a","TraceEntries":"b"}]}'
    )
    with pytest.raises(InvalidCheckpoint, match=r"conversationHistory\[1\]: keys 'traceEntries'"):
        deserialize_checkpoint(document)
    with pytest.raises(InvalidCheckpoint, match="key 'version' twice name the field 'version'"):
        deserialize_checkpoint(b'{"sessionId":"a","version":1,"version":2}')


def test_python_built_checkpoint_cannot_smuggle_a_case_variant_into_unknown_fields() -> None:
    # Given checkpoints built in Python with an unknown field Go would read as a known one
    smuggled = [
        Checkpoint(session_id="a", VERSION=7),
        Checkpoint(
            session_id="a",
            conversation_history=[ConversationMessage(role="u", Content="x")],
        ),
        Checkpoint(session_id="a", metadata=CheckpointMetadata(TotalTokens=2)),
    ]
    # Then serializing refuses rather than store a value Go reads differently
    for cp in smuggled:
        with pytest.raises(InvalidCheckpoint, match="would be read by Go as the field"):
            serialize_checkpoint(cp)


def test_repeated_unknown_keys_and_whitespace_still_load() -> None:
    # Non-canonical documents take the exact parser; repeats of unknown keys are harmless.
    cp = deserialize_checkpoint(b'{ "sessionId" : "a", "x": 1, "x": 2, "metadata": {} }')
    assert cp.session_id == "a" and cp.extra_fields == {"x": 2}


def test_store_loads_foreign_values_as_go_does_or_reports_them_corrupt(
    real_redis: redis.Redis,
) -> None:
    # Given every vector written into Redis by a foreign writer, as Go's store would
    store = RedisStore(real_redis)
    for i, vector in enumerate(VECTORS):
        value = zstandard.ZstdCompressor().compress(vector["input"].encode())
        real_redis.set(f"agentorca-session:v{i}", value, ex=3600)
    # When checkpointq loads each one
    for i, vector in enumerate(VECTORS):
        if vector["ours"] == "accept":
            # Then it reads what Go reads ...
            loaded = store.load(f"v{i}")
            assert loaded is not None and _as_go_reads_it(loaded) == vector["go"].encode()
        else:
            # ... or refuses the value with the reason, instead of reading something else
            with pytest.raises(CorruptCheckpoint):
                store.load(f"v{i}")
