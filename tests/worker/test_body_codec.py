"""The worker's base64 codec for message bodies (worker/hooks/kombu.py) decodes as kombu's.

It decodes strict base64 with pybase64 and leaves everything else to kombu's codec; the
bytes it returns, and the texts it refuses, must be exactly kombu's.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from checkpointq.worker.hooks import kombu as kombu_hooks

KOMBU: Any = virtual.base.Base64()
OURS: Any = kombu_hooks._Base64()

#: Base64's alphabet and padding, with what a hostile producer might mix in.
TEXT = st.text(
    alphabet=st.sampled_from(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n\t.\x00é"
    ),
    max_size=40,
)


def _decoded(codec: Any, text: str | bytes) -> bytes | type[BaseException]:
    try:
        return bytes(codec.decode(text))
    except (binascii.Error, ValueError, TypeError) as exc:
        return type(exc)


@given(st.binary(max_size=300))
def test_bodies_kombu_encoded_decode_to_the_same_bytes(body: bytes) -> None:
    text = base64.b64encode(body).decode()
    assert OURS.decode(text) == KOMBU.decode(text) == body


@given(TEXT, st.booleans())
def test_any_text_decodes_or_fails_exactly_as_with_kombus_codec(text: str, raw: bool) -> None:
    value: str | bytes = text.encode() if raw else text
    assert _decoded(OURS, value) == _decoded(KOMBU, value)


@pytest.mark.parametrize("text", ["QQ==QQ==", "QU JD", "QUJD\n", "QR==", "QQ", "Q===", "é"])
def test_texts_kombu_repairs_or_refuses_are_left_to_kombu(text: str) -> None:
    assert _decoded(OURS, text) == _decoded(KOMBU, text)


def test_the_worker_reader_installs_the_codec() -> None:
    channel: Any = kombu_redis.Channel
    saved = channel._brpop_read, channel._brpop_start, channel.basic_consume, channel.codecs
    try:
        kombu_hooks.install()
        assert isinstance(channel.codecs["base64"], kombu_hooks._Base64)
    finally:
        channel._brpop_read, channel._brpop_start, channel.basic_consume, channel.codecs = saved
