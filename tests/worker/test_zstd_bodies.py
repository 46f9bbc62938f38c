"""A worker decodes zstd bodies whichever kombu line and zstd module it runs with."""

from __future__ import annotations

import pytest
import zstandard
from kombu import compression

from checkpointq.store.codec import ValueCodec
from checkpointq.tasks import messages
from checkpointq.tasks.producer.compressed_body import enclose
from checkpointq.worker import zstd_bodies


@pytest.fixture
def kombu_without_zstd(monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu as on 5.7 without compression.zstd: no codec for application/zstd."""
    for table in ("_encoders", "_decoders"):
        codecs = dict(getattr(compression, table))
        codecs.pop(messages.ZSTD, None)
        monkeypatch.setattr(compression, table, codecs)
    aliases = {k: v for k, v in compression._aliases.items() if v != messages.ZSTD}
    monkeypatch.setattr(compression, "_aliases", aliases)


def test_kombus_own_zstd_codec_is_kept() -> None:
    before = compression.get_decoder(messages.ZSTD)  # type: ignore[no-untyped-call]
    zstd_bodies.install(max_message_bytes=1 << 20)
    assert compression.get_decoder(messages.ZSTD) is before  # type: ignore[no-untyped-call]


@pytest.mark.usefixtures("kombu_without_zstd")
def test_without_kombus_codec_a_compressed_save_body_still_decodes() -> None:
    # Given kombu without a zstd codec
    with pytest.raises(KeyError):
        compression.get_decoder(messages.ZSTD)  # type: ignore[no-untyped-call]
    # When the worker installs its own
    zstd_bodies.install(max_message_bytes=1 << 20)
    # Then a save body as our producers compress it decodes, by kombu's name for it
    prefix, suffix = messages.save_body_framing(7)
    document = b'{"sessionId":"s","version":1}'
    body = enclose(ValueCodec().encode(document), prefix, suffix)
    assert body is not None
    decode = compression.get_decoder("zstd")  # type: ignore[no-untyped-call]
    assert decode(body) == prefix + document + suffix


@pytest.mark.usefixtures("kombu_without_zstd")
def test_its_codec_refuses_a_body_over_the_message_limit_before_inflating_it() -> None:
    zstd_bodies.install(max_message_bytes=1024)
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"[" * 10_000_000)
    decode = compression.get_decoder(messages.ZSTD)  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match="zstd"):
        decode(bomb)
