"""Queue items over the size limit: refused before they are read whole, kept on the broker.

Decoding an item costs the main process several times its size (its text, the JSON, the
base64 body), and a ``MemoryError`` there loses it, popped and never recorded. So the reader
measures an item before it holds it: the
reserve script (``worker/lua/reserve.lua``) moves an item over ``Guard.max_item_bytes`` to
a broker key of its own and returns only its head and tail; after a BRPOP the reader peeks
at the reply's length on the socket and, for an oversize item, streams it to such a key in
``CHUNK_BYTES`` pieces. Either way the worker then records a dead letter from the sample
(task name and id read from it as text, the true size, the raw key) and the item waits on
the broker, as it arrived, until ``checkpointq dlq replay`` puts it back in its queue (for a
worker with a larger limit) or it is among the oldest past ``Guard.kept``.

The main process thus holds at most one chunk of an oversize item, and an item within the
limit is at most ``max_item_bytes``: what a valid body of ``max_message_bytes`` takes in an
envelope (base64 is 4/3 of it) plus ``HEADER_ALLOWANCE`` for its headers.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from functools import cache
from time import time
from typing import Any

from checkpointq.store import redis_hooks
from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.keys import KeySpace
from checkpointq.store.scripts import script_source
from checkpointq.tasks.dead_letters import OVERSIZE_SAMPLE_BYTES, Reason
from checkpointq.tasks.refusals import refuse
from checkpointq.worker import backpressure

logger = logging.getLogger(__name__)

#: Bytes of an oversize item kept in its dead letter: half its head, half its tail (kombu's
#: envelope puts the body first and the headers naming the task last).
SAMPLE_BYTES = OVERSIZE_SAMPLE_BYTES
#: What an envelope may add to its base64 body: headers, properties, JSON punctuation.
HEADER_ALLOWANCE = 64 * 1024
#: Bytes of an oversize item read from the socket and written to the broker at a time.
CHUNK_BYTES = 1024 * 1024
#: How an item was set aside, as its dead letter's reason says.
STREAMED, BY_SCRIPT = "streamed to the broker", "set aside by the reserve script"
#: The broker transport options carrying the guard (``worker/app.py``).
MAX_ITEM_OPTION = "checkpointq_max_item_bytes"
KEPT_OPTION = "checkpointq_oversize_kept"
PREFIX_OPTION = "checkpointq_key_prefix"


def max_item_bytes(max_message_bytes: int) -> int:
    """The largest queue item holding a body of ``max_message_bytes`` in base64."""
    return 4 * -(-max_message_bytes // 3) + HEADER_ALLOWANCE


@dataclass(frozen=True, slots=True)
class Guard:
    """The limit a channel's reader applies, and where oversize items go (the broker)."""

    keys: KeySpace
    max_item_bytes: int
    #: Raw oversize items kept at most; past it the oldest go (their dead letters stay).
    kept: int

    def fresh_key(self) -> str:
        return self.keys.oversize_body(uuid.uuid4().hex)


def transport_options(key_prefix: str, max_message_bytes: int, kept: int) -> dict[str, Any]:
    return {
        PREFIX_OPTION: key_prefix,
        MAX_ITEM_OPTION: max_item_bytes(max_message_bytes),
        KEPT_OPTION: kept,
    }


def guard_of(channel: Any) -> Guard | None:
    """The channel's guard, from its transport options; None: the worker set none."""
    options = channel.connection.client.transport_options
    limit = options.get(MAX_ITEM_OPTION)
    if not limit:
        return None
    kept = int(options.get(KEPT_OPTION, 0))
    return _guard(str(options.get(PREFIX_OPTION) or ""), int(limit), kept)


@cache
def _guard(prefix: str, limit: int, kept: int) -> Guard:
    return Guard(KeySpace(prefix) if prefix else KeySpace(), limit, kept)


_TASK = re.compile(rb'"task"\s*:\s*"([^"\\]{1,256})"')
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')


def named(sample: bytes) -> tuple[str | None, str | None]:
    """The task name and id an envelope's sample spells out, read as text (not decoded)."""
    found = [pattern.search(sample) for pattern in (_TASK, _ID)]
    task, task_id = (m.group(1).decode(errors="replace") if m else None for m in found)
    return task, task_id


def record(
    channel: Any,
    guard: Guard,
    queue: str,
    list_key: bytes,
    aside: str,
    sample: bytes,
    size: int,
    how: str,
) -> None:
    """Dead-letter an item set aside under ``aside`` (``how``: by which path, for people);
    if the store is down, put it back.

    Back at the far end of its list it goes (a server-side move, ``requeue``), and the
    worker stops consuming until the store takes writes, as for any refusal it cannot
    record.
    """
    task, task_id = named(sample)
    limit = guard.max_item_bytes
    try:
        refuse(
            Reason.OVERSIZE,
            f"queue item is {size} bytes; the limit is {limit} (refused unread, {how})",
            task=task,
            task_id=task_id,
            raw=sample,
            raw_bytes=size,
            headers={"queue": queue, "raw_key": aside, "raw_list": list_key.decode()},
        )
    except StoreUnavailable as down:
        logger.error("could not dead-letter an oversize item from %s; put it back", queue)
        with channel.conn_or_acquire() as client:
            requeue(client, guard.keys, aside, list_key)
        backpressure.trip(str(down))
        return
    with channel.conn_or_acquire() as client:
        forget_oldest(client, guard)


def forget_oldest(client: Any, guard: Guard) -> None:
    """Delete the oldest raw items past ``guard.kept``."""
    index = guard.keys.oversize_index()
    excess = int(client.zcard(index)) - guard.kept
    if excess <= 0:
        return
    oldest = [key for key, _ in client.zpopmin(index, excess)]
    client.delete(*oldest)
    logger.warning("deleted %d raw oversize item(s) past the %d kept", len(oldest), guard.kept)


def requeue(client: Any, keys: KeySpace, aside: str, list_key: bytes | str) -> bool:
    """Move a kept raw item back to the far end of its queue list, on the broker (the item
    never crosses the network); False: it is no longer kept."""
    script = client.register_script(script_source("requeue_oversize", "checkpointq.worker"))
    return bool(script(keys=[aside, keys.oversize_index(), list_key]))


def take_reply(channel: Any, connection: Any, guard: Guard) -> bool:
    """If the BRPOP reply waiting on ``connection`` carries an oversize item, stream it to
    the broker and dead-letter it, and return True; else read nothing and return False."""
    head = redis_hooks.peek_pop_reply(connection)
    if head is None:
        return False
    header, list_key, size = head
    if size <= guard.max_item_bytes:
        return False
    aside = guard.fresh_key()
    half = SAMPLE_BYTES // 2
    sample_head, tail = bytearray(), bytearray()
    redis_hooks.discard(connection, header)
    with channel.conn_or_acquire() as client:
        for chunk in redis_hooks.stream(connection, size, CHUNK_BYTES):
            client.append(aside, chunk)
            if len(sample_head) < half:
                sample_head += chunk[: half - len(sample_head)]
            tail = (tail + chunk[-half:])[-half:]
        redis_hooks.discard(connection, 2)  # the reply's closing CRLF
        client.zadd(guard.keys.oversize_index(), {aside: time()})
    sample = bytes(sample_head + tail)
    queue = list_key.decode(errors="replace").rsplit(channel.sep, 1)[0]
    record(channel, guard, queue, list_key, aside, sample, size, STREAMED)
    return True
