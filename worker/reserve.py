"""Reserve many queued messages in one broker round trip, recorded as kombu records them.

kombu's Redis transport takes one message per BRPOP and then records it in its ``unacked``
hash and index (``QoS.append``): a second round trip that sends the whole message back to
the broker. With coalescing (``worker/coalesce.py``) the worker's main process is the
bound, and those two round trips per message were most of its time (profile in
``docs/performance.md``). ``worker/lua/reserve.lua`` pops up to the room left in the
prefetch window and records each message with what kombu would write (same keys, tag,
``[message, exchange, routing key]``, the worker's ``time()`` as the score), so kombu's own
restore (visibility timeout, shutdown) works on them unchanged; the worker then delivers
them without a second write (``worker/transport.py``).

BRPOP stays the way an idle worker waits: it wakes on the first message, and the reserve
follows it while the prefetch window has room.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from importlib import resources
from time import time
from typing import Any

from kombu.transport import redis as kombu_redis
from redis.commands.core import Script
from redis.exceptions import ResponseError

logger = logging.getLogger(__name__)

#: Bytes one reserve takes at most, past its first message: bounds the worker's memory and
#: the script's time on the broker when messages are large (a 50-save ``apply_batch`` is
#: ~1.3 MB), whatever the prefetch window allows.
BYTE_BUDGET = 4 * 1024 * 1024
#: Messages one reserve takes at most when the prefetch window is unlimited (prefetch 0).
BATCH_LIMIT = 100


@dataclass(frozen=True, slots=True)
class Reserved:
    """One popped message, and the tag it was recorded under (None: not recorded)."""

    key: bytes
    queue: str
    item: bytes
    tag: str | None


@cache
def _source() -> str:
    return (
        resources.files("checkpointq.worker")
        .joinpath("lua", "reserve.lua")
        .read_text(encoding="utf-8")
    )


_script: Script | None = None


def _reserve_script(client: Any) -> Script:
    """The script, registered once per process (redis-py reloads it on NOSCRIPT)."""
    global _script
    if _script is None:
        _script = client.register_script(_source())
    return _script


def usable(channel: Any) -> bool:
    """Whether this channel keeps kombu's Redis ``unacked`` bookkeeping, unprefixed.

    With ack emulation off there is no ``unacked`` hash to keep; with a global key prefix
    kombu's client rewrites key names itself: both keep to kombu's one-message reads.
    """
    return bool(
        channel.ack_emulation
        and not channel.global_keyprefix
        and isinstance(channel.qos, kombu_redis.QoS)
    )


def pop(channel: Any, limit: int) -> list[Reserved]:
    """Pop up to ``limit`` messages from the channel's queues, in BRPOP's order.

    Returns [] (after a warning) when the broker refuses the script (scripts disabled, a
    replica, out of memory): the worker then reads one message per BRPOP, as kombu does.

    Raises:
        the channel's connection errors: nothing was popped, or what was is recorded in
            ``unacked`` and the visibility timeout restores it.
    """
    queues = channel._queue_cycle.consume(len(channel.active_queues))
    if not queues or limit < 1:
        return []
    names = [queue for _ in channel.priority_steps for queue in queues]
    keys = [channel._q_for_pri(queue, pri) for pri in channel.priority_steps for queue in queues]
    with channel.conn_or_acquire() as client:
        try:
            reply = _reserve_script(client)(
                keys=[channel.unacked_key, channel.unacked_index_key, *keys],
                args=[limit, BYTE_BUDGET, time()],
                client=client,
            )
        except ResponseError as exc:
            logger.warning("broker refused the reserve script (%s): one message per read", exc)
            return []
    reserved = []
    for at in range(0, len(reply), 3):
        index, item, tag = reply[at : at + 3]
        key = keys[int(index) - 1]
        reserved.append(
            Reserved(
                key.encode() if isinstance(key, str) else key,
                names[int(index) - 1],
                item,
                tag.decode() if tag else None,
            )
        )
    return reserved


def forget(channel: Any, tag: str, requeue: tuple[bytes, bytes] | None = None) -> None:
    """Remove a recorded message from ``unacked`` (as kombu's ack), optionally pushing
    ``(key, item)`` back to the far end of its list in the same transaction."""
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline()
        if requeue is not None:
            pipe.lpush(*requeue)
        pipe.zrem(channel.unacked_index_key, tag).hdel(channel.unacked_key, tag).execute()


def put_back(channel: Any, batch: list[Reserved]) -> None:
    """Return reserved messages not delivered to the front of their lists, in their order,
    and out of ``unacked``, in one transaction."""
    if not batch:
        return
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline()
        for reserved in reversed(batch):
            pipe.rpush(reserved.key, reserved.item)
            if reserved.tag is not None:
                pipe.zrem(channel.unacked_index_key, reserved.tag)
                pipe.hdel(channel.unacked_key, reserved.tag)
        pipe.execute()
