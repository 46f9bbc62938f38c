"""A writer that does to Redis exactly what the Go package's ``RedisStore`` does.

Go's ``Save`` is ``SET <prefix>:<id> <zstd(json.Marshal(cp))> EX 30d`` and its ``Delete`` a plain
``DEL <prefix>:<id>``: neither touches checkpointq's fence or deadline index. The JSON is our
``serialize_checkpoint``, which is byte-identical to Go's ``encoding/json`` output
(tests/store/test_go_interop.py); the frame is one zstd frame with its content size and a
checksum, as klauspost's ``EncodeAll`` writes by default (the compressed bytes themselves
differ from klauspost's: another compressor, the same format). The key is spelled out here
rather than built by our ``KeySpace``: it is Go's format, and must not follow ours if that
drifts.
"""

from __future__ import annotations

import redis
import zstandard

from checkpointq.store import Checkpoint, serialize_checkpoint

#: The Go RedisStore's key prefix and TTL.
GO_PREFIX = "agentorca-session"
GO_TTL_SECONDS = 30 * 24 * 60 * 60


class GoRedisStore:
    """The write side of Go's ``RedisStore``, over a redis-py client."""

    def __init__(self, client: redis.Redis, prefix: str = GO_PREFIX) -> None:
        self.client = client
        self.prefix = prefix
        self._zstd = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True)

    def key(self, session_id: str) -> str:
        return f"{self.prefix}:{session_id}"

    def save(self, checkpoint: Checkpoint) -> None:
        """``RedisStore.Save``: overwrite the value, 30-day TTL, no index update."""
        value = self._zstd.compress(serialize_checkpoint(checkpoint))
        self.client.set(self.key(checkpoint.session_id), value, ex=GO_TTL_SECONDS)

    def delete(self, session_id: str) -> None:
        """``RedisStore.Delete``: a plain DEL; no tombstone, no index update."""
        self.client.delete(self.key(session_id))

    def list(self) -> list[str]:
        """The ids of the values that exist, as a ``SCAN <prefix>:*`` finds them."""
        skip = len(self.key(""))
        keys = self.client.scan_iter(match=self.key("*"), count=1000, _type="string")
        return [key.decode()[skip:] for key in keys]
