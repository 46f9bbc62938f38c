"""A save message's zstd body, made from the stored value's frame without compressing again.

A save compresses its checkpoint once, for its pending record (the store's value: one zstd
frame of the checkpoint JSON). Its message body is that JSON inside a few bytes of protocol
2 framing (``[[<json>],{"seq":N},{embed}]``), so the body's frame is the value's compressed
blocks between two raw blocks holding the framing: one valid zstd frame (RFC 8878) that any
decoder reads, built in microseconds where a second compression of the body would cost as
much as the first. A raw block defines no tables and moves no repeat offsets, so the value's
first compressed block decodes as it did at the start of its own frame, and its match offsets
never reach before the checkpoint's first byte.

The result carries kombu's standard ``compression: application/zstd`` header
(``fast_publish``): every Celery consumer with a zstd codec registered in kombu decodes it.
"""

from __future__ import annotations

#: Every zstd frame starts with these four bytes (RFC 8878, section 3.1.1).
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: The content type kombu's ``compression`` header names zstd by.
CONTENT_TYPE = "application/zstd"

#: Frame_Content_Size field sizes by the descriptor's two top bits (1 byte when 0 and single
#: segment).
_CONTENT_SIZE_BYTES = (0, 2, 4, 8)
#: The largest block a frame may hold whatever its window (RFC 8878, Block_Maximum_Size).
_MAX_BLOCK = 128 * 1024
#: Descriptor of the frames made here: 8-byte content size, single segment (the window is
#: the content), no checksum, no dictionary.
_DESCRIPTOR = 0b1110_0000
_RAW, _RLE, _RESERVED = 0, 1, 3


def _raw_blocks(data: bytes, *, last: bool) -> list[bytes]:
    blocks: list[bytes] = []
    for at in range(0, len(data), _MAX_BLOCK):
        chunk = data[at : at + _MAX_BLOCK]
        final = last and at + _MAX_BLOCK >= len(data)
        blocks += [(len(chunk) << 3 | _RAW << 1 | final).to_bytes(3, "little"), chunk]
    return blocks


def enclose(frame: bytes, prefix: bytes, suffix: bytes) -> bytes | None:
    """One zstd frame whose content is ``prefix``, ``frame``'s content, then ``suffix``.

    None when ``frame`` is not one whole frame that declares its content size and names no
    dictionary (the caller then sends the body uncompressed). ``frame`` must not depend on
    a raw-content dictionary, which its header cannot show: the store's never do.
    ``prefix`` and ``suffix`` must not be empty.
    """
    if len(frame) < 6 or not frame.startswith(ZSTD_MAGIC) or not prefix or not suffix:
        return None
    descriptor = frame[4]
    single = descriptor >> 5 & 1
    checksum = descriptor >> 2 & 1
    if descriptor & 0b0001_1011:  # dictionary id, reserved or unused bits
        return None
    size_bytes = _CONTENT_SIZE_BYTES[descriptor >> 6] or single
    if not size_bytes:
        return None
    at = 5 + (not single)
    size = int.from_bytes(frame[at : at + size_bytes], "little") + (256 if size_bytes == 2 else 0)
    at += size_bytes
    blocks = at
    while True:  # to the last block's header
        if at + 3 > len(frame):
            return None
        header = int.from_bytes(frame[at : at + 3], "little")
        kind = header >> 1 & 3
        if kind == _RESERVED:
            return None
        last_header = at
        at += 3 + (1 if kind == _RLE else header >> 3)
        if header & 1:
            break
    if at + 4 * checksum != len(frame):
        return None
    total = len(prefix) + size + len(suffix)
    not_last = (header & ~1).to_bytes(3, "little")
    return b"".join(
        (
            ZSTD_MAGIC,
            bytes((_DESCRIPTOR,)),
            total.to_bytes(8, "little"),
            *_raw_blocks(prefix, last=False),
            frame[blocks:last_header],
            not_last,
            frame[last_header + 3 : at],
            *_raw_blocks(suffix, last=True),
        )
    )
