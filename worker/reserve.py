"""Reserve many queued messages in one broker round trip, recorded as kombu records them.

kombu's Redis transport takes one message per BRPOP and then records it in its ``unacked``
hash and index (``QoS.append``): a second round trip that sends the whole message back to
the broker. With coalescing (``worker/coalesce.py``) the worker's main process is the
bound, and those two round trips per message would be most of its time (profile in
``docs/performance.md``). ``worker/lua/reserve.lua`` pops up to the room left in the
prefetch window and records each message with what kombu would write (same keys, tag,
``[message, exchange, routing key]``, the worker's ``time()`` as the score), so kombu's own
restore (visibility timeout, shutdown) works on them unchanged; the worker then delivers
them without a second write (``worker/hooks/kombu.py``).

The script is sent where kombu sends its BRPOP, on the channel's polled connection, and its
reply read by the same reader when the event loop sees it: the main process never waits on
the broker. Every message is taken by the script, never by BRPOP: an item BRPOP popped
exists only in its reply until the worker records it, so a worker killed (or a connection
cut) in between lost it. An idle worker waits with ``BLMOVE q q RIGHT RIGHT`` instead
(``wait_command``), which moves a message from the tail of its list to the same place: it
wakes on the first message and takes nothing, and the script then reserves what is queued.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass
from functools import cache
from importlib import resources
from time import time
from typing import Any

from kombu.transport import redis as kombu_redis

from checkpointq.worker import oversize
from checkpointq.worker.hooks import kombu as kombu_hooks

logger = logging.getLogger(__name__)

#: Bytes one reserve takes at most, past its first message: bounds the worker's memory and
#: the script's time on the broker when messages are large (a 50-save ``apply_batch`` is
#: ~1.3 MB), whatever the prefetch window allows.
BYTE_BUDGET = 4 * 1024 * 1024
#: The broker transport option holding ``Settings.prefetch_max_bytes``: the bytes of message
#: bodies a channel holds reserved (delivered, not yet acknowledged) at most, 0 for none.
MAX_HELD_BYTES_OPTION = "checkpointq_prefetch_max_bytes"
#: The broker transport option holding ``Settings.wake_linger_ms``: how long a channel woken
#: from its wait lets requests gather before it reserves them (0: it reserves at once).
WAKE_LINGER_OPTION = "checkpointq_wake_linger_ms"
#: A channel lingers only when woken again within this many seconds of its last wake-up:
#: requests keep coming, and sharing a reserve, a group and a commit is worth a few ms each;
#: the first request after a quiet spell is reserved at once.
LINGER_HORIZON = 0.1
#: Messages one reserve takes at most when the prefetch window is unlimited (prefetch 0).
BATCH_LIMIT = 100
#: A wait's reply carries the item it saw, which the reader does not need: past this size
#: it is read from the socket a chunk at a time and dropped, never held whole.
WAKE_READ_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Reserved:
    """One popped message, and the tag it was recorded under (None: not recorded).

    An oversize item (``size`` set) was not popped into the reply: ``item`` holds only its
    head and tail, and the item itself waits on the broker under the call's ``aside`` key.
    """

    key: bytes
    queue: str
    item: bytes
    tag: str | None
    size: int | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One script call sent: the lists it reads (key, queue name), how many it may take,
    and the key an oversize item goes to (``oversize.py``)."""

    keys: list[bytes]
    queues: list[str]
    limit: int
    aside: str = ""
    #: The score its entries get in the ``unacked`` index (the worker's ``time()``, as
    #: sent): what finds them again should the reply be lost (``worker/lost_settles.py``).
    score: str = ""
    #: The bytes it may take past the first message (the script stops once it holds them).
    budget: int = BYTE_BUDGET

    def took_all_it_could(self, batch: list[Reserved]) -> bool:
        """Whether the script stopped at this call's message or byte limit, not at an empty
        queue: more may be queued, and the next read takes it without a wait first."""
        return len(batch) >= self.limit or sum(len(r.item) for r in batch) >= self.budget

    def parse(self, reply: list[Any]) -> list[Reserved]:
        """The script's reply (triples: list index, item, tag, "" or "#size") as messages."""
        return [
            self._reserved(int(index) - 1, item, tag.decode())
            for index, item, tag in zip(reply[::3], reply[1::3], reply[2::3], strict=True)
        ]

    def _reserved(self, at: int, item: bytes, tag: str) -> Reserved:
        if tag.startswith("#"):
            return Reserved(self.keys[at], self.queues[at], item, None, int(tag[1:]))
        return Reserved(self.keys[at], self.queues[at], item, tag or None)


@dataclass(slots=True)
class Reading:
    """How a channel reads next: a wait (idle) or the script (messages may be queued)."""

    #: Send the script rather than a wait: the last read took all it could, or woke.
    busy: bool = False
    #: The script call whose reply the polled connection is waiting for.
    pending: Request | None = None
    #: A wait (``wait_command`` or ``sleep_command``) was sent: its reply is only a wake-up.
    waiting: bool = False
    #: The broker refused the last wait for want of memory (BLMOVE may grow a list, so a
    #: full broker refuses it): sleep instead of waiting, once (``sleep_command``).
    full: bool = False
    #: Take the next message with kombu's BRPOP: the broker refused the script.
    brpop_next: bool = False
    #: Why this broker takes no waits (a Redis before 6.2 has no BLMOVE): BRPOP it is.
    no_wait: str | None = None
    #: Whether the broker's refusal of the script was logged (once per channel).
    warned: bool = False
    #: The wait sent is ``wait_command``'s, whose reply says a message is queued.
    waking: bool = False
    #: Woken: let requests gather for the linger (``linger_command``) before reserving.
    linger: bool = False
    #: The pending script call was sent right behind a linger, whose reply comes first.
    lingered: bool = False
    #: When the last wait woke (``time.monotonic``): see ``LINGER_HORIZON``.
    woke_at: float = float("-inf")


def wait_command(key: str | bytes, timeout: float) -> list[Any]:
    """The command an idle channel waits with: it returns when ``key`` holds a message (or
    after ``timeout`` seconds), moving that message from the list's tail to its tail, i.e.
    nowhere. Nothing leaves the list, so nothing is lost whatever happens to the reply."""
    return ["BLMOVE", key, key, "RIGHT", "RIGHT", timeout]


#: A stream key nobody writes: what ``sleep_command`` blocks on.
_NOWHERE = f"_checkpointq.sleep.{uuid.uuid4().hex}"


def sleep_command(timeout: float) -> list[Any]:
    """A command that returns nothing after ``timeout`` seconds, accepted by a full broker:
    how an idle channel waits while the broker refuses ``wait_command``. (BRPOP would be
    accepted too, but what it pops is lost if recording it is refused, as a full broker
    refuses it.) ``timeout`` 0 sleeps 1 s, not forever."""
    return ["XREAD", "BLOCK", int((timeout or 1) * 1000), "STREAMS", _NOWHERE, "$"]


def wake_linger_ms(channel: Any) -> float:
    """How long ``channel``, woken from its wait, lets requests gather before it reserves
    them (``Settings.wake_linger_ms``; 0: it reserves at once)."""
    return float(channel.connection.client.transport_options.get(WAKE_LINGER_OPTION) or 0)


def linger_command(ms: float) -> list[Any]:
    """A command that returns nothing after ``ms`` milliseconds (at least 1: a 0 would
    block for ever), sent on the polled connection, so that the event loop runs on while
    requests gather on the broker: nothing is taken off a list meanwhile."""
    return ["XREAD", "BLOCK", max(1, round(ms)), "STREAMS", _NOWHERE, "$"]


@cache
def source() -> str:
    """The text of ``worker/lua/reserve.lua``, read from package data once per process."""
    return (
        resources.files("checkpointq.worker")
        .joinpath("lua", "reserve.lua")
        .read_text(encoding="utf-8")
    )


@cache
def sha() -> str:
    return hashlib.sha1(source().encode(), usedforsecurity=False).hexdigest()


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


def byte_room(channel: Any) -> int | None:
    """Bytes of message bodies ``channel`` may still reserve, or None: no byte budget.

    The prefetch window counts messages, so with large ones it held tens of MB in the main
    process (and a group's worth in each pool process). This is the rest of the budget
    after what the channel's QoS holds: delivered and not yet acknowledged, whether waiting
    in a group, in the pool, or for an ETA. At 0 or below the reader reads nothing until an
    acknowledgement frees some; what is held is always on its way to one, so reading
    resumes. Summing at most the prefetch window's bodies costs a few us per read.
    """
    budget = channel.connection.client.transport_options.get(MAX_HELD_BYTES_OPTION)
    if not budget:
        return None
    return int(budget) - kombu_hooks.held_body_bytes(channel.qos)


def request(
    channel: Any,
    queues: list[str],
    limit: int,
    budget: int = BYTE_BUDGET,
    guard: oversize.Guard | None = None,
) -> tuple[Request, list[Any]]:
    """The call reading ``queues`` in BRPOP's order (each priority, then each queue), and
    the EVALSHA command that makes it (at most ``limit`` messages, ``budget`` bytes past
    the first; an item over ``guard``'s limit set aside unread)."""
    names = [queue for _ in channel.priority_steps for queue in queues]
    keys = [
        kombu_hooks.queue_key(channel, queue, pri)
        for pri in channel.priority_steps
        for queue in queues
    ]
    encoded = [key.encode() if isinstance(key, str) else key for key in keys]
    aside = guard.fresh_key() if guard is not None else ""
    score = repr(time())
    command = [
        "EVALSHA",
        sha(),
        4 + len(keys),
        channel.unacked_key,
        channel.unacked_index_key,
        aside or "-",
        guard.keys.oversize_index() if guard is not None else "-",
        *keys,
        limit,
        budget,
        score,
        guard.max_item_bytes if guard is not None else 0,
        oversize.SAMPLE_BYTES // 2,
    ]
    return Request(encoded, names, limit, aside, score, budget), command


def load(channel: Any) -> None:
    """Load the script into the broker (once per broker start)."""
    with channel.conn_or_acquire() as client:
        client.script_load(source())


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
