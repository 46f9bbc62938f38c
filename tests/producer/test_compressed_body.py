"""A save's zstd body, made from its record's frame, is one frame every zstd decoder reads."""

from __future__ import annotations

import base64
import os

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu import compression

from checkpointq.store.codec import ValueCodec
from checkpointq.store.serde import serialize_checkpoint
from checkpointq.tasks import messages
from checkpointq.tasks.producer.compressed_body import CONTENT_TYPE, enclose
from tests.support.checkpoints import make_checkpoint

PREFIX, SUFFIX = messages.save_body_framing(1_733_000_000_000_000)


def _decoders() -> list[object]:
    """python-zstandard, and the decoder kombu registered for the header we send (a stock
    consumer's: zstandard on kombu 5.5/5.6, compression.zstd from 5.7)."""
    return [zstandard.ZstdDecompressor().decompress, compression.get_decoder(CONTENT_TYPE)]  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(
    "document",
    [
        serialize_checkpoint(make_checkpoint("small", messages=1)),
        serialize_checkpoint(make_checkpoint("usual", messages=40)),
        b'{"big":"' + b"abcdefghij" * 40_000 + b'"}',  # several 128 KB blocks
        os.urandom(300_000),  # incompressible: raw blocks
        b"[" + b" " * 200_000 + b"]",  # one byte repeated: RLE blocks
    ],
    ids=["small", "usual", "multi-block", "incompressible", "rle"],
)
@pytest.mark.parametrize("level", [1, 3, -5])
def test_the_enclosed_frame_decodes_to_the_whole_body(document: bytes, level: int) -> None:
    # Given the store's value for a document (zstd with its content size)
    frame = ValueCodec(level=level).encode(document)
    # When the body's frame is made from it
    body = enclose(frame, PREFIX, SUFFIX)
    # Then every decoder reads the protocol 2 body around the document
    assert body is not None
    for decode in _decoders():
        assert decode(body) == PREFIX + document + SUFFIX  # type: ignore[operator]
    assert zstandard.frame_content_size(body) == len(PREFIX + document + SUFFIX)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=5000), st.binary(min_size=1), st.binary(min_size=1))
def test_any_content_between_any_framing_round_trips(
    content: bytes, prefix: bytes, suffix: bytes
) -> None:
    body = enclose(ValueCodec().encode(content), prefix, suffix)
    assert body is not None
    assert zstandard.ZstdDecompressor().decompress(body) == prefix + content + suffix


def test_the_value_itself_is_not_changed() -> None:
    frame = ValueCodec().encode(b'{"a":1}')
    copy = bytes(frame)
    enclose(frame, PREFIX, SUFFIX)
    assert frame == copy


@pytest.mark.parametrize(
    "frame",
    [
        zstandard.ZstdCompressor(write_content_size=False).compress(b'{"a":1}' * 100),
        ValueCodec().encode(b'{"a":1}' * 100) + b"\x00",
        ValueCodec().encode(b'{"a":1}' * 100)[:-3],
        ValueCodec().encode(b'{"a":1}') * 2,
        zstandard.ZstdCompressor(
            dict_data=zstandard.train_dictionary(
                4096, [b'{"session":%d,"turn":"hello %d"}' % (i, i * 7) for i in range(400)]
            ),
            write_content_size=True,
        ).compress(b'{"a":1}' * 100),
        b'{"a":1}',
        b"",
    ],
    ids=["no-size", "trailing", "truncated", "two-frames", "dictionary", "json", "empty"],
)
def test_a_frame_it_cannot_enclose_whole_gives_none(frame: bytes) -> None:
    # The caller then sends the JSON body uncompressed
    assert enclose(frame, PREFIX, SUFFIX) is None


def _envelope(body: bytes, compression: str | None) -> dict[str, object]:
    headers = {"task": messages.SAVE, **({"compression": compression} if compression else {})}
    return {"body": base64.b64encode(body).decode(), "headers": headers}


def test_envelope_body_reads_compressed_and_plain_bodies_alike() -> None:
    plain = messages.save_body(b'{"sessionId":"s"}', 9)
    zstd_body = enclose(ValueCodec().encode(b'{"sessionId":"s"}'), PREFIX, SUFFIX)
    assert zstd_body is not None
    assert messages.envelope_body(_envelope(plain, None)) == plain
    expected = PREFIX + b'{"sessionId":"s"}' + SUFFIX
    assert messages.envelope_body(_envelope(zstd_body, CONTENT_TYPE)) == expected


@pytest.mark.parametrize(
    ("body", "compression"),
    [
        (ValueCodec().encode(b"[" * 100_000), CONTENT_TYPE),  # declares 100 KB
        (
            zstandard.ZstdCompressor(write_content_size=False).compress(b"[" * 100_000),
            "application/zstd",
        ),
        (b"not a frame", CONTENT_TYPE),
        (b"[]", "application/x-bz2"),
    ],
    ids=["declared-over", "undeclared-over", "broken", "other-codec"],
)
def test_envelope_body_refuses_what_it_cannot_bound_or_read(body: bytes, compression: str) -> None:
    with pytest.raises(ValueError, match=r"zstd|compression"):
        messages.envelope_body(_envelope(body, compression), max_bytes=10_000)
