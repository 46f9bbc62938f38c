"""The stored value format shared with the Go ``RedisStore``: zstd-compressed JSON.

Go's encoder may write frames without a content-size field, and older Go deployments wrote
plain JSON; both are read here. Decompression is bounded so a hostile or corrupt value cannot
exhaust memory.
"""

from __future__ import annotations

import io
import threading
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zstandard

#: Every zstd frame starts with these four bytes (RFC 8878, section 3.1.1).
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

#: Default ceiling for a decompressed checkpoint, in bytes.
DEFAULT_MAX_DECOMPRESSED = 64 * 1024 * 1024

_JSON_START = frozenset(b" \t\r\n{")


def _zstd() -> ModuleType:
    """The zstandard module, imported on first use: a worker's main process builds stores
    but never compresses, and need not carry the extension."""
    import zstandard

    return zstandard


def zstd_bound(size: int) -> int:
    """The most bytes a zstd frame of ``size`` bytes of content can take, whatever they are
    (``ZSTD_COMPRESSBOUND`` in zstd.h): a value this size is known to fit a budget unread."""
    small = (128 << 10) - size >> 11 if size < 128 << 10 else 0
    return size + (size >> 8) + small


class CodecError(ValueError):
    """The stored bytes are neither a zstd frame of JSON nor plain JSON."""


class ValueCodec:
    """Compresses and decompresses stored values; one per store, safe across threads.

    zstd contexts are not thread-safe but are expensive to build, so each thread keeps its
    own, created on first use and reused afterwards.
    """

    def __init__(self, level: int = 1, max_decompressed: int = DEFAULT_MAX_DECOMPRESSED) -> None:
        self.level = level
        self.max_decompressed = max_decompressed
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        cctx: zstandard.ZstdCompressor | None = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = _zstd().ZstdCompressor(level=self.level, write_content_size=True)
            self._local.cctx = cctx
        return cctx

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dctx: zstandard.ZstdDecompressor | None = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = _zstd().ZstdDecompressor()
            self._local.dctx = dctx
        return dctx

    def warm_up(self) -> None:
        """Import zstd and build this thread's contexts now (about 15 ms), so that the first
        request a pool process runs does not wait for them."""
        self._compressor()
        self._decompressor()

    def encode(self, json_bytes: bytes) -> bytes:
        """Compress JSON bytes into one zstd frame (with its content size, as Go reads it)."""
        return self._compressor().compress(json_bytes)

    def decode(self, stored: bytes) -> bytes:
        """Return the JSON bytes of a stored value.

        Raises:
            CodecError: unknown format, a broken frame, or more than ``max_decompressed`` bytes.
        """
        if stored.startswith(ZSTD_MAGIC):
            return self._decode_zstd(stored)
        if stored and stored[0] in _JSON_START:
            return stored
        raise CodecError("value is neither a zstd frame nor JSON")

    def _decode_zstd(self, stored: bytes) -> bytes:
        limit = self.max_decompressed
        zstandard = _zstd()
        try:
            size = zstandard.frame_content_size(stored)
            if 0 <= size <= limit:
                return self._decompressor().decompress(stored)
            if size > limit:
                raise CodecError(f"frame declares {size} bytes, over the {limit}-byte limit")
            # No content size in the frame header (Go's streaming encoder): read with a cap.
            chunks: list[bytes] = []
            total = 0
            with self._decompressor().stream_reader(io.BytesIO(stored)) as reader:
                while total <= limit:
                    chunk = reader.read(min(1 << 20, limit + 1 - total))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    total += len(chunk)
            data = b"".join(chunks)
        except zstandard.ZstdError as exc:
            raise CodecError(f"broken zstd frame: {exc}") from None
        if len(data) > limit:
            raise CodecError(f"decompresses to more than the {limit}-byte limit")
        return data
