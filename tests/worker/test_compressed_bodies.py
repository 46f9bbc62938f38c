"""Compressed bodies inflate within the message limit, by every codec kombu has."""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Callable

import pytest
import zstandard
from kombu import compression

from checkpointq.store.codec import ValueCodec
from checkpointq.tasks import messages
from checkpointq.tasks.producer.compressed_body import enclose
from checkpointq.worker import compressed_bodies
from checkpointq.worker.compressed_bodies import BZ2, GZIP, LZMA, BodyTooLarge

LIMIT = 1 << 20

#: kombu's compressor of each codec, for bodies as another producer would send them.
COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    GZIP: zlib.compress,
    BZ2: bz2.compress,
    LZMA: lzma.compress,
    messages.ZSTD: zstandard.ZstdCompressor(write_content_size=False).compress,
}


_ZSTD_DECLARED = zstandard.ZstdCompressor(write_content_size=True).compress


@pytest.fixture(autouse=True)
def kombu_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu's codec tables as they were, after the test."""
    for table in ("_encoders", "_decoders", "_aliases"):
        monkeypatch.setattr(compression, table, dict(getattr(compression, table)))


@pytest.fixture
def kombu_without_zstd(monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu as on 5.7 without compression.zstd: no codec for application/zstd."""
    for table in ("_encoders", "_decoders"):
        getattr(compression, table).pop(messages.ZSTD, None)
    aliases = {k: v for k, v in compression._aliases.items() if v != messages.ZSTD}
    monkeypatch.setattr(compression, "_aliases", aliases)


def _decode(content_type: str) -> Callable[[bytes], bytes]:
    return compression.get_decoder(content_type)  # type: ignore[no-any-return,no-untyped-call]


@pytest.mark.parametrize("content_type", sorted(COMPRESS))
def test_a_body_within_the_limit_inflates_as_kombu_inflates_it(content_type: str) -> None:
    body = b'[["a checkpoint"],{"seq":1},{}]' * 1000
    # (zstd as our producers write it, its size declared: kombu 5.5's zstandard decoder
    # reads no other frame, so "as kombu inflates it" holds on every kombu line)
    compressed = (
        _ZSTD_DECLARED(body) if content_type == messages.ZSTD else COMPRESS[content_type](body)
    )
    kombus = _decode(content_type)(compressed)
    compressed_bodies.install(max_message_bytes=LIMIT)
    assert _decode(content_type)(compressed) == kombus == body


@pytest.mark.parametrize("content_type", sorted(COMPRESS))
def test_kombu_still_compresses_with_its_own_encoder(content_type: str) -> None:
    # (a worker publishes compressed too: a retry of a compressed save keeps its codec)
    compressed_bodies.install(max_message_bytes=LIMIT)
    body = b'[["a checkpoint"],{"seq":1},{}]'
    compressed, named = compression.compress(body, content_type)  # type: ignore[no-untyped-call]
    assert named == content_type
    assert compression.decompress(compressed, content_type) == body  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("content_type", sorted(COMPRESS))
def test_a_bomb_is_refused_having_inflated_no_more_than_the_limit(content_type: str) -> None:
    # Given a body of a few KB that inflates to 64 MiB
    bomb = COMPRESS[content_type](b"[" * (64 << 20))
    assert len(bomb) < 1 << 20
    compressed_bodies.install(max_message_bytes=LIMIT)
    # When kombu's decoder for its content type (ours now) reads it, it refuses it
    with pytest.raises(BodyTooLarge, match=f"{content_type} body inflates past {LIMIT} bytes"):
        _decode(content_type)(bomb)


def test_a_zstd_frame_declaring_more_than_the_limit_is_refused_unread() -> None:
    declared = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * (LIMIT + 1))
    compressed_bodies.install(max_message_bytes=LIMIT)
    with pytest.raises(BodyTooLarge):
        _decode(messages.ZSTD)(declared)


@pytest.mark.parametrize("content_type", [BZ2, LZMA, messages.ZSTD])
def test_concatenated_streams_inflate_whole_and_count_against_one_limit(content_type: str) -> None:
    half = b"y" * (LIMIT // 2 + 1)
    compressed_bodies.install(max_message_bytes=LIMIT)
    once = COMPRESS[content_type](half[:100])
    assert _decode(content_type)(once + once) == half[:100] * 2
    with pytest.raises(BodyTooLarge):
        _decode(content_type)(COMPRESS[content_type](half) * 2)


@pytest.mark.parametrize("content_type", sorted(COMPRESS))
def test_a_truncated_body_is_refused(content_type: str) -> None:
    compressed = COMPRESS[content_type](b"z" * 10_000)
    compressed_bodies.install(max_message_bytes=LIMIT)
    with pytest.raises(ValueError, match=r"truncated|broken"):
        _decode(content_type)(compressed[: len(compressed) // 2])


def test_a_codec_that_cannot_be_bounded_is_refused() -> None:
    compression.register(lambda b: b, lambda b: b, "application/x-unbounded")  # type: ignore[no-untyped-call]
    compressed_bodies.install(max_message_bytes=LIMIT)
    with pytest.raises(ValueError, match="cannot bound"):
        _decode("application/x-unbounded")(b"anything")


@pytest.mark.usefixtures("kombu_without_zstd")
def test_without_kombus_codec_a_compressed_save_body_still_decodes() -> None:
    # Given kombu without a zstd codec
    with pytest.raises(KeyError):
        _decode(messages.ZSTD)
    # When the worker installs its own
    compressed_bodies.install(max_message_bytes=LIMIT)
    # Then a save body as our producers compress it decodes, by kombu's name for it
    prefix, suffix = messages.save_body_framing(7)
    document = b'{"sessionId":"s","version":1}'
    body = enclose(ValueCodec().encode(document), prefix, suffix)
    assert body is not None
    assert _decode("zstd")(body) == prefix + document + suffix
