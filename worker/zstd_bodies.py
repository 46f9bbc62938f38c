"""Every worker decodes zstd-compressed message bodies, as our producers send saves.

kombu decodes a body whose ``compression`` header it knows, in its ``Message``, before Celery
or our consumer see it; it knows ``application/zstd`` when its zstd module imports
(zstandard before kombu 5.7; ``compression.zstd`` from 5.7, which Python has from 3.14 and
``backports.zstd`` before: the worker extra brings it). Where neither imports, ``install``
registers a codec on zstandard through kombu's public ``kombu.compression.register``, so that
a compressed save is applied rather than dead-lettered as undecodable. Its decoder is bounded
by the largest message the worker accepts.
"""

from __future__ import annotations

import logging

from kombu import compression

from checkpointq.tasks import messages

logger = logging.getLogger(__name__)


def install(max_message_bytes: int) -> None:
    """Register a zstd codec with kombu unless it has one."""
    try:
        compression.get_decoder(messages.ZSTD)  # type: ignore[no-untyped-call]
        return
    except KeyError:
        pass

    def decompress(body: bytes) -> bytes:
        return messages.decompress_zstd(body, max_message_bytes)

    def compress(body: bytes) -> bytes:
        import zstandard

        return zstandard.ZstdCompressor(write_content_size=True).compress(body)

    compression.register(  # type: ignore[no-untyped-call]
        compress, decompress, messages.ZSTD, aliases=["zstd", "zstandard"]
    )
    logger.info("kombu has no zstd codec: compressed bodies decode with zstandard")
