"""Go interop: what Go's RedisStore writes we read, and what we write Go reads.

The vectors are byte strings as Go's encoding/json marshals the Checkpoint struct (field
order, omitempty, HTML escaping); the stored forms are those the Go store may leave in
Redis: zstd frames with and without a content-size header, and plain JSON.
"""

from __future__ import annotations

import io
from typing import cast

import pytest
import redis
import zstandard

from checkpointq.store import RedisStore, deserialize_checkpoint, serialize_checkpoint
from checkpointq.store.codec import ZSTD_MAGIC

GO_VECTORS = [
    # Everything set, with Go's HTML escaping of <, > and &.
    b'{"sessionId":"sess-42","version":7,"conversationHistory":[{"role":"user","content":'
    b'"\\u003cb\\u003eHi\\u003c/b\\u003e \\u0026 bye"},{"role":"assistant","content":"Hello!",'
    b'"traceEntries":"[{\\"tool\\":\\"search\\"}]"}],"metadata":{"totalMessages":2,'
    b'"totalTokens":1234,"totalCostUSD":"0.012300","startTime":"2026-12-02T08:30:00Z",'
    b'"lastMessageTime":"2026-12-02T08:31:05Z"},"lastRunRef":"agentrun-sess-42-7"}',
    # A fresh session: empty history and metadata omitted/empty, no lastRunRef.
    b'{"sessionId":"fresh","version":0,"metadata":{}}',
    # Non-ASCII is written raw (UTF-8), as Go does.
    '{"sessionId":"ü-🤖","version":1,"conversationHistory":[{"role":"user","content":"naïve ☃"}],'
    '"metadata":{"totalMessages":1}}'.encode(),
]


@pytest.mark.parametrize("vector", GO_VECTORS)
def test_go_json_round_trips_byte_for_byte(vector: bytes) -> None:
    assert serialize_checkpoint(deserialize_checkpoint(vector)) == vector


def _go_frame_without_content_size(data: bytes) -> bytes:
    # Go's streaming zstd encoder does not know the size up front.
    out = io.BytesIO()
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=False)
    with cctx.stream_writer(out, closefd=False) as writer:
        writer.write(data)
    frame = out.getvalue()
    assert zstandard.frame_content_size(frame) == -1
    return frame


@pytest.mark.parametrize(
    "encode",
    [
        pytest.param(lambda d: zstandard.ZstdCompressor(level=3).compress(d), id="zstd"),
        pytest.param(_go_frame_without_content_size, id="zstd-no-content-size"),
        pytest.param(lambda d: d, id="plain-json"),
    ],
)
def test_store_reads_values_go_wrote(real_redis: redis.Redis, encode: object) -> None:
    assert callable(encode)
    store = RedisStore(real_redis)
    real_redis.set("agentorca-session:sess-42", encode(GO_VECTORS[0]), ex=3600)
    loaded = store.load("sess-42")
    assert loaded is not None
    assert serialize_checkpoint(loaded) == GO_VECTORS[0]


def test_go_reads_what_store_writes(real_redis: redis.Redis) -> None:
    store = RedisStore(real_redis)
    store.save(deserialize_checkpoint(GO_VECTORS[0]), seq=1)
    raw = cast(bytes, real_redis.get("agentorca-session:sess-42"))
    assert raw is not None and raw.startswith(ZSTD_MAGIC)
    # A plain single-shot decoder (what Go's zstd.Decoder.DecodeAll does) gets Go's JSON.
    assert zstandard.ZstdDecompressor().decompress(raw) == GO_VECTORS[0]
    ttl = real_redis.ttl("agentorca-session:sess-42")
    assert 30 * 86400 - 60 < ttl <= 30 * 86400


def test_go_style_scan_sees_exactly_the_live_sessions(real_redis: redis.Redis) -> None:
    store = RedisStore(real_redis)
    for session_id in ["a", "b", "c", "*", "x:y"]:
        store.save(
            deserialize_checkpoint(GO_VECTORS[1]).model_copy(update={"session_id": session_id}),
            seq=1,
        )
    store.delete("b", seq=2)
    scanned = {
        key.decode().removeprefix("agentorca-session:")
        for key in real_redis.scan_iter("agentorca-session:*")
    }
    assert scanned == {"a", "c", "*", "x:y"}
    assert sorted(store.list()) == sorted(scanned)


def test_sessions_written_by_go_alone_are_indexed_by_reindex(real_redis: redis.Redis) -> None:
    store = RedisStore(real_redis)
    real_redis.set("agentorca-session:from-go", GO_VECTORS[1], ex=3600)
    assert store.list() == []
    assert store.reindex() == 1
    assert store.list() == ["from-go"]
    assert store.reindex() == 0


def test_decompression_is_bounded(real_redis: redis.Redis) -> None:
    from checkpointq.store import CorruptCheckpoint, StoreOptions

    store = RedisStore(real_redis, options=StoreOptions(max_decompressed_bytes=1024))
    bomb = _go_frame_without_content_size(b'{"sessionId":"s","x":"' + b"a" * 100_000 + b'"}')
    real_redis.set("agentorca-session:s", bomb)
    with pytest.raises(CorruptCheckpoint, match="limit"):
        store.load("s")
