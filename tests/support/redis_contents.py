"""What a Redis holds, as bytes a test can search: the encryption tests look for any clear
byte of a conversation in it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import orjson
import redis

from checkpointq.store.codec import ZSTD_MAGIC, ValueCodec


def _expand(item: Any) -> Iterator[bytes]:
    """An item, what it holds if it is a zstd frame (a clear value compresses its text out
    of sight), and a kombu message's base64 body inside it."""
    yield item
    if item.startswith(ZSTD_MAGIC):
        yield ValueCodec().decode(item)
    try:
        message = orjson.loads(item)
        yield base64.b64decode(message["body"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return


def everything_in(client: redis.Redis) -> bytes:
    """Every key and value of a Redis, whatever their type, joined."""
    parts: list[Any] = []
    db: Any = client
    for key in db.scan_iter(count=1000):
        parts.append(key)
        kind = db.type(key)
        if kind == b"string":
            parts.extend(_expand(db.get(key) or b""))
        elif kind == b"list":
            for item in db.lrange(key, 0, -1):
                parts.extend(_expand(item))
        elif kind == b"hash":
            for field, value in db.hgetall(key).items():
                parts += [field, *_expand(value)]
        elif kind == b"zset":
            parts += [m for m, _ in db.zrange(key, 0, -1, withscores=True)]
        elif kind == b"set":
            parts += list(db.smembers(key))
        elif kind == b"stream":
            for _, fields in db.xrange(key):
                for field, value in fields.items():
                    parts += [field, *_expand(value)]
    return b"\n".join(parts)
