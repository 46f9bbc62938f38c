"""Pending records: every accepted request of a session, kept on the broker until a worker
settles it, so that every replica's load sees a write the queue still holds.

docs/protocol.md ("Pending records") is the contract; this module is its Python side:

* ``PendingRecords.push`` runs ``tasks/lua/publish.lua``: the LPUSH and one entry per
  request the message carries (with a save's value), in one script call (the Go client
  embeds the same file). The broker checks each ``seq`` and this producer's clock first.
* ``PendingRecords.load`` and ``list`` merge the newest entry with the store, by the order of
  requests (``store.ordering``), reading the entries **before** the store (an entry goes
  once its request was settled; one counted but gone makes the load refuse).
* ``settle`` (the worker's side) runs ``tasks/lua/settle.lua``: each settled request removes
  its own entry and value, and nothing else.

A broker that lost its data shows a new epoch token; one that lost a suffix of what it
accepted (a crash inside its fsync window, a failover to a lagging replica) a pending mark
below one a client saw, or, once unaware publishes brought the counter back up, that mark
held by another publish's token (publish.lua's ring). ``EpochWatch`` counts and logs them;
producers then publish again what they published lately (``RecentPublishes``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from redis import exceptions as redis_errors

from checkpointq.store import redis_hooks
from checkpointq.store.base import CheckpointStore, Fence, Refusal
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import Checkpoint
from checkpointq.store.ordering import OrderKey, lapsed, order_key
from checkpointq.store.redis import RedisStore
from checkpointq.store.scripts import script_source
from checkpointq.tasks.errors import (
    BrokerUnavailable,
    PendingRecordMissing,
    SeqRefused,
    redis_unavailable,
)
from checkpointq.tasks.producer.broker_durability import LOCAL_DURABILITY, BrokerDurability
from checkpointq.tasks.producer.clock import SeqClock, seq_clock
from checkpointq.tasks.producer.fast_publish import new_id

logger = logging.getLogger(__name__)

_SCRIPTS = "checkpointq.tasks"

#: Entry ops, as publish.lua stores them.
SAVE_OP, DELETE_OP = "save", "delete"
#: What publish.lua is told for a staged save (it stores the entry as a save).
STAGED_OP = "staged"
#: What read_pending.lua answers for a save past its deadline (store.ordering).
LAPSED_OP = "lapsed"
#: What read_pending.lua answers for a session whose entries are gone while the index
#: still holds it (``PendingRecordMissing``).
MISSING_OP = "missing"

#: The worker's default limit on how far ahead a seq may be (CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS).
DEFAULT_MAX_SEQ_AHEAD_SECONDS = 300.0

#: How publish.lua's refusals start (the rest says why).
_REFUSED = "CQREFUSED"

_T = TypeVar("_T")
#: One write's commands, sent in order in one round trip.
Commands = list[tuple[Any, ...]]
#: What a write's sender answers: the replies (error replies in their places), or the
#: exception the write raised (a connection error).
Answer = list[Any] | Exception
#: A sans-I/O exchange (``RecordCalls.publish_steps``, ``recover_steps``): it yields the
#: commands of each write, is sent the ``Answer``, and returns its result. The sync client
#: drives it with blocking round trips (``drive``), the asyncio client with awaited ones.
Steps = Generator[Commands, Answer | None, _T]

#: Sessions whose newest entry one read_pending.lua call reads for a list.
_HEADS_PER_CALL = 500

#: How long a staged value waits for the script that pushes its message (they go in one
#: write, so only a client that dies between them leaves one behind, for this long); the
#: script then gives it the record's lifetime.
STAGED_VALUE_WAIT_MS = 30_000


@dataclass(frozen=True, slots=True)
class RecordWrite:
    """One request's record as a publish writes it: ``value`` is a save's stored value (the
    store's ``encode``), empty for a delete. ``staged``: a ``checkpoint.save_staged``
    request, whose value goes to its own key on the broker and not into the message."""

    session_id: str
    seq: int
    op: str
    request_id: str
    value: bytes = b""
    staged: bool = False


@dataclass(frozen=True, slots=True)
class PendingRecord:
    """A session's newest pending request as read back from the broker (its entry ordered
    last: ``store.ordering``). ``lapsed``: a save past its deadline, which will never be
    stored (its session reads as expired)."""

    seq: int
    deleted: bool
    request_id: str
    value: bytes = b""
    lapsed: bool = False

    @property
    def key(self) -> OrderKey:
        return order_key(self.seq, self.deleted, self.request_id)

    def wins(self, fence: Fence | None) -> bool:
        """Whether the record, not the store, answers: its request is ordered after the last
        one the store applied (or the store applied none)."""
        return fence is None or self.key > fence.key

    def as_fence(self) -> Fence:
        """The fence a load returns for it, so that the next request sorts after it."""
        live = not (self.deleted or self.lapsed)
        return Fence(self.seq, self.deleted, self.request_id, live, self.lapsed)


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")


#: An entry's fields as read_pending.lua returns them: seq, op, request id, value.
_Fields = tuple[bytes | None, bytes | None, bytes | None, bytes | None]


def _answering(
    fields: _Fields, fence: Fence | None, ttl_ms: int = 0, now_ms: int | None = None
) -> PendingRecord | None:
    """The newest pending request if it answers a load, ordered after ``fence``; read whole
    only then (a save whose value is gone fails the load only when it would answer it). A
    save past its deadline at ``now_ms`` (the store read's time) answers as lapsed.

    Raises:
        BrokerUnavailable: as ``parse_record``.
    """
    seq, op, req, value = fields
    if seq is None:
        _check_missing(op)
        return None
    head = PendingRecord(int(seq), op == DELETE_OP.encode(), _text(req))
    if not head.wins(fence):
        return None
    if op == SAVE_OP.encode() and now_ms is not None and lapsed(head.seq, ttl_ms, now_ms):
        return PendingRecord(head.seq, False, head.request_id, lapsed=True)
    return parse_record(seq, op, req, value)


def _check_missing(op: bytes | None) -> None:
    """Raise ``PendingRecordMissing`` for read_pending.lua's op ``missing``: the index still
    holds the session, so a request of it is queued, but its entries are gone."""
    if op == MISSING_OP.encode():
        raise PendingRecordMissing(
            "the pending record of a request still queued for this session is missing on the "
            "broker (deleted by hand, or evicted: see the eviction warning), so the store "
            "alone could serve an older turn; loads refuse until a worker applies the queued "
            "request, or its deadline passes"
        )


def parse_record(
    seq: bytes | None, op: bytes | None, req: bytes | None = None, value: bytes | None = None
) -> PendingRecord | None:
    """A record from its fields as read_pending.lua returns them (seq, op, req, value); None
    when there is none.

    Raises:
        BrokerUnavailable: the fields are not an entry publish.lua writes, or a pending
            save's value is gone before its deadline (evicted: see the eviction warning).
    """
    if seq is None:
        _check_missing(op)
        return None
    if op == DELETE_OP.encode():
        return PendingRecord(int(seq), True, _text(req))
    if op == LAPSED_OP.encode():
        return PendingRecord(int(seq), False, _text(req), lapsed=True)
    if op != SAVE_OP.encode() or not value:
        raise BrokerUnavailable(f"unreadable pending record (op {_text(op)!r}, seq {_text(seq)})")
    return PendingRecord(int(seq), False, _text(req), bytes(value))


class Seen(NamedTuple):
    """A mark a client saw and its token (publish.lua's ring; '' unknown): what a call
    sends, for the broker (or the reply) to judge whether that mark was lost."""

    mark: int = 0
    token: str = ""


class EpochWatch:
    """Follows the broker's pending epoch and mark, and counts the losses it finds: an epoch
    that changed or vanished (a broker that lost its records, or one a producer found had
    gone back in time), a mark below the highest seen in the epoch, or that mark with another
    token (a broker that lost a suffix of what it accepted: a crash inside the fsync window,
    a failover to a lagging replica; with the token, even when unaware publishes brought the
    counter back up). Each is logged once. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: object = None  # None before the first token; _LOST after a loss
        #: The highest mark seen in the current epoch, with its token ('' unknown).
        self._mark = Seen()
        #: A mark and token this watch saw before the broker lost them, not yet reported
        #: with a publish (which turns the epoch, for every client to see).
        self._unreported = Seen()
        #: How many losses this watch saw (``checkpointq_pending_epoch_changes_total``).
        self.changes = 0

    def seen(self) -> tuple[str, int, str]:
        """The epoch, the highest mark and its token to send with a publish (publish.lua's
        ARGV[6..8]): with a loss this watch found and did not report yet, the mark and token
        it saw before it, for the script to find the loss again and turn the epoch."""
        with self._lock:
            epoch = self._last if isinstance(self._last, bytes) else b""
            mark = self._unreported if self._unreported.mark else self._mark
            return epoch.decode("utf-8", "replace"), mark.mark, mark.token

    def floor(self) -> Seen:
        """The highest mark seen in the epoch since the last loss, and its token: a reply to
        a request sent now that shows a lower mark, or that mark with another token, is a
        new loss."""
        with self._lock:
            return self._mark

    def observe(
        self,
        epoch: bytes | None,
        mark: int | None = None,
        *,
        below: int = 0,
        found: bool = False,
        token: str = "",
        forked: Seen | None = None,
    ) -> bool:
        """Take one reply's epoch and mark. ``below``: a mark under it shows the broker went
        back in time (the mark this watch had seen when the request went out, plus one for
        a publish, which advances it; replies of concurrent requests may come back in any
        order, so only what was seen before the request counts). ``found``: that publish
        found the loss itself and turned the epoch. ``token``: the reply's mark's token
        ('' unknown). ``forked``: the mark and token the request sent, when the reply says
        the broker holds that mark with another token (read_pending.lua): a loss, as a
        lower mark is. Returns whether the reply shows a loss not counted before."""
        with self._lock:
            if epoch != self._last:
                if self._last is None or self._last is _LOST:
                    if epoch is not None:  # the first token, or the first after a loss
                        self._last, self._mark = epoch, Seen(mark or 0, token)
                    return False
                # Turned by the report of the loss this watch found (its own, or another
                # client's first): that loss is counted already.
                counted = self._unreported.mark > 0
                self._last = _LOST if epoch is None else epoch
                self._mark, self._unreported = Seen(mark or 0, token), Seen()
                if counted:
                    return False
                self.changes += 1
                logger.error(
                    "the broker lost accepted requests (pending epoch %s): requests published "
                    "before it may never be applied; see docs/reliability.md",
                    "gone" if epoch is None else "changed",
                )
                return True
            if mark is None:
                return False
            if forked is None and mark >= below:
                if mark > self._mark.mark or (mark == self._mark.mark and not self._mark.token):
                    self._mark = Seen(mark, token)
                return False
            if forked is not None and self._unreported.mark:
                return False  # found already, not reported yet
            # Below a mark this watch saw in this epoch, or that mark with another token:
            # the broker went back in time.
            lost = forked or self._mark
            if lost.mark > self._unreported.mark:
                self._unreported = lost
            self._mark = Seen(mark, token)
            self.changes += 1
            logger.error(
                "the broker went back in time: pending mark %d, %s (a crash or failover lost "
                "a suffix of accepted requests); see docs/reliability.md",
                mark,
                f"below {below} seen before"
                if forked is None
                else f"and mark {forked.mark} seen before holds another publish",
            )
            return True


_LOST = object()

#: How much of a publish's ARGV[3] the broker keeps as its mark's token (publish.lua).
MARK_TOKEN_CHARS = 16


#: How many recent marks' tokens the broker keeps (publish.lua's ring, in the pending mark).
MARK_TOKEN_SLOTS = 65536


def ring_field(mark: int) -> str:
    """The pending mark's field that holds ``mark``'s token (publish.lua's ring)."""
    return f"t{mark % MARK_TOKEN_SLOTS}"


def ring_token(held: bytes | None, mark: int) -> str:
    """``mark``'s token from its ring field's value ('' when it holds another mark)."""
    at, _, token = (held or b"").decode("ascii", "replace").partition(":")
    return token if at == str(mark) else ""


def new_token() -> str:
    """A fresh random token for one publish (publish.lua's ARGV[3]), cheaply: the epoch only
    when the broker has none (or the publish finds it went back in time), and its first 16
    characters its mark's token."""
    return os.urandom(16).hex()


#: The recovery window's defaults (``RecentPublishes``, CHECKPOINTQ_REPUBLISH_*): the
#: publishes of the last 10 s, at most 10,000 of them and 64 MiB of messages and values.
#: 10 s covers Redis's everysec fsync (1 s, up to 2 s more when an fsync is slow) and a
#: replica's usual lag; a loss further back is detected and counted all the same.
DEFAULT_REPUBLISH_SECONDS = 10.0
DEFAULT_REPUBLISH_REQUESTS = 10_000
DEFAULT_REPUBLISH_BYTES = 64 * 1024 * 1024


class _Published(NamedTuple):
    at: float
    queue: str
    message: bytes
    records: Sequence[RecordWrite]
    size: int


class RecentPublishes:
    """The requests this producer published lately, to publish again when it finds the
    broker lost accepted requests (issue 44): harmless for those that were not lost, since
    every request is fenced and its pending entry keyed by its own id and stamp. Bounded by
    age, count and bytes (the oldest go first); keeping one costs a deque append of what the
    publish built anyway. Thread-safe."""

    def __init__(
        self,
        seconds: float = DEFAULT_REPUBLISH_SECONDS,
        requests: int = DEFAULT_REPUBLISH_REQUESTS,
        max_bytes: int = DEFAULT_REPUBLISH_BYTES,
        clock: Any = time.monotonic,
    ) -> None:
        self.seconds, self.requests, self.max_bytes = seconds, requests, max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: deque[_Published] = deque()
        #: Bytes of messages and values kept now.
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def add(self, queue: str, message: bytes, records: Sequence[RecordWrite]) -> None:
        if self.requests <= 0 or self.seconds <= 0:
            return
        size = len(message) + sum(len(r.value) for r in records)
        now = self._clock()
        with self._lock:
            self._kept.append(_Published(now, queue, message, records, size))
            self.bytes += size
            self._trim(now)

    def _trim(self, now: float) -> None:
        kept, oldest = self._kept, now - self.seconds
        while kept and (
            len(kept) > self.requests or self.bytes > self.max_bytes or kept[0].at < oldest
        ):
            self.bytes -= kept.popleft().size

    def take(self) -> list[_Published]:
        """The publishes still in the window, oldest first (they stay kept)."""
        with self._lock:
            self._trim(self._clock())
            return list(self._kept)


#: How a message of ours ends: its delivery tag (kombu's envelope, ``fast_publish``).
_TAG = b'"delivery_tag":"'


def with_fresh_tag(message: bytes) -> bytes:
    """``message`` with a fresh delivery tag, to publish it again: settle.lua tells the
    republished message from a delivery of the one before by its tag (a worker that held
    that one when the broker lost it settles nothing of the newer; finding 5 of
    tests/model/README.md), and kombu's unacked entries are keyed by it. A message that
    does not end with a tag goes as it is."""
    at = message.rfind(_TAG, -96)
    if at < 0 or not message.endswith(b'"}}'):
        return message
    return message[: at + len(_TAG)] + new_id().encode() + b'"}}'


def same_redis(a: Any, b: Any) -> bool:
    """Whether two ``redis.Redis`` clients talk to one server and database."""
    pools = [getattr(c, "connection_pool", None) for c in (a, b)]
    if any(p is None or not hasattr(p, "connection_kwargs") for p in pools):
        return False
    fields = ("host", "port", "path", "db", "username")
    kwargs = [p.connection_kwargs for p in pools]  # type: ignore[union-attr]
    return all(kwargs[0].get(f) == kwargs[1].get(f) for f in fields)


class RecordCalls:
    """The pending records' script calls, built and read without I/O: the one place for
    publish.lua's and read_pending.lua's keys and arguments and for the meaning of their
    replies (the broker's epoch and mark included: ``EpochWatch``), shared by the sync
    (``PendingRecords``) and asyncio (``producer.aio``) sides. ``recent`` is the recovery
    window each side publishes again when a reply shows the broker lost accepted requests;
    ``durability``, whether a push waits for broker replicas (``broker_durability``)."""

    def __init__(
        self,
        keys: KeySpace,
        *,
        ttl_seconds: float,
        clock: SeqClock | None = None,
        max_seq_ahead_seconds: float = DEFAULT_MAX_SEQ_AHEAD_SECONDS,
        recent: RecentPublishes | None = None,
        durability: BrokerDurability = LOCAL_DURABILITY,
    ) -> None:
        self.keys = keys
        self.durability = durability
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.clock = clock or seq_clock
        self.max_ahead_us = int(max_seq_ahead_seconds * 1_000_000)
        self.epochs = EpochWatch()
        #: What this producer published lately, published again when it finds the broker
        #: lost accepted requests (``recover``).
        self.recent = RecentPublishes() if recent is None else recent
        #: Requests published again after a loss, in all.
        self.republished = 0
        #: Held by the one recovery under way (a thread's or an asyncio task's).
        self._recovering = threading.Lock()
        self._index_key, self._epoch_key = keys.pending_index(), keys.pending_epoch()
        self._mark_key, self._counts_key = keys.pending_mark(), keys.pending_counts()
        self._publish_source = script_source("publish", _SCRIPTS)
        self._publish_sha = hashlib.sha1(
            self._publish_source.encode(), usedforsecurity=False
        ).hexdigest()
        self.read_source = script_source("read_pending", _SCRIPTS)

    # -- writes ----------------------------------------------------------------------------

    def push_call(
        self,
        queue: str,
        message: bytes,
        records: Sequence[RecordWrite],
        clock_us: int,
        token: str | None = None,
    ) -> tuple[list[str], list[Any]]:
        """publish.lua's KEYS and ARGV (its header says what each is): the one place they are
        built. The Go client builds the same call (tests/go/test_publish_calls.py).
        ``token``: ARGV[3] (``new_token()`` when None)."""
        keys = [queue, self._index_key, self._epoch_key, self._mark_key, self._counts_key]
        seen_epoch, seen_mark, seen_token = self.epochs.seen()
        args: list[Any] = [message, self.ttl_ms, token or new_token(), clock_us, self.max_ahead_us]
        args += [seen_epoch, seen_mark, seen_token]
        for record in records:
            keys += [
                self.keys.pending_requests(record.session_id),
                self.keys.pending_value(record.session_id, record.request_id),
                self.keys.pending_counted(record.session_id),
            ]
            op, value = (STAGED_OP, b"") if record.staged else (record.op, record.value)
            args += [record.session_id, record.seq, op, record.request_id, value]
        return keys, args

    def push_commands(
        self,
        queue: str,
        message: bytes,
        records: Sequence[RecordWrite],
        *,
        by_digest: bool,
        token: str | None = None,
    ) -> list[tuple[Any, ...]]:
        """The commands of one push, sent in one write: each staged value's SET, then the
        script, by its digest (``by_digest``) or, after a NOSCRIPT, by its text.

        Staged values are SET just before the script, which checks they are there, gives them
        the records' lifetime and names them in the records (docs/protocol.md, "Staged
        saves"). They never pass through Lua, which copies every argument."""
        keys, args = self.push_call(queue, message, records, self.clock.now_us(), token)
        stage = [
            (
                "SET",
                self.keys.pending_value(r.session_id, r.request_id),
                r.value,
                "PX",
                STAGED_VALUE_WAIT_MS,
            )
            for r in records
            if r.staged
        ]
        script = ("EVALSHA", self._publish_sha) if by_digest else ("EVAL", self._publish_source)
        return [*stage, (*script, len(keys), *keys, *args)]

    def push_result(
        self, replies: Sequence[Any], *, seen: Seen | int, token: str = ""
    ) -> bool | None:
        """Read a push's replies (errors in their places): None when the broker lost the
        script (NOSCRIPT: it refused the call whole, nothing was pushed; send it again by
        its text); else whether the reply showed the broker lost accepted requests (its
        mark below ``seen``, the ``epochs.floor()`` read before the push went out, or a new
        epoch: then publish the window again, ``recent``). ``token``: the push's ARGV[3],
        whose first 16 characters the broker keeps as its mark's token.

        Raises:
            SeqRefused: the broker refused the requests' seq or this producer's clock.
            redis.RedisError: any other error reply (a refused staged SET, OOM or READONLY,
                is the cause: the script then refused the push).
        """
        *staged, published = replies
        if isinstance(published, redis_errors.NoScriptError):
            return None
        for reply in (*staged, published):
            if isinstance(reply, redis_errors.ResponseError) and str(reply).startswith(_REFUSED):
                raise SeqRefused(str(reply).removeprefix(_REFUSED).strip(), field="seq")
            if isinstance(reply, Exception):
                raise reply
        epoch, mark, found = published
        below = (seen.mark if isinstance(seen, Seen) else seen) + 1
        return self.epochs.observe(
            epoch, int(mark), below=below, found=bool(found), token=token[:MARK_TOKEN_CHARS]
        )

    def push_steps(
        self, queue: str, message: bytes, records: Sequence[RecordWrite], wait: bool = False
    ) -> Steps[tuple[bool, Any]]:
        """One publish.lua call (``push_commands``, ``push_result``): by the script's digest,
        then, after a NOSCRIPT (the broker refused it whole: nothing was pushed), by its
        text; ``wait``: with the WAIT in the same write, when ``durability`` is replicated.
        Returns whether the reply showed the broker lost accepted requests, and the WAIT's
        reply (None: no WAIT).

        Raises:
            SeqRefused, redis.RedisError: as ``push_result``, or as the write raised.
        """
        seen = self.epochs.floor()
        durability = self.durability
        for by_digest in (True, False):
            token = new_token()
            commands = self.push_commands(queue, message, records, by_digest=by_digest, token=token)
            answer = yield durability.with_wait(commands, wait)
            replies, acked = durability.split(_replies(answer), wait)
            lost = self.push_result(replies, seen=seen, token=token)
            if lost is not None:
                return lost, acked
        raise redis_errors.NoScriptError("the broker refused publish.lua by its text")

    def publish_steps(
        self, queue: str, message: bytes, records: Sequence[RecordWrite]
    ) -> Steps[tuple[bool, Any]]:
        """``push_steps`` (with the WAIT when replicated), then the request kept in the
        recovery window (``recent``), and the window published again (``recover_steps``)
        when the reply showed a loss. Returns whether it did, and the WAIT's reply, for the
        caller to judge (``durability.check``) once the request is kept. Raises as
        ``push_steps``."""
        lost, acked = yield from self.push_steps(queue, message, records, wait=True)
        self.recent.add(queue, message, records)
        if lost:
            yield from self.recover_steps()
        return lost, acked

    def recover_steps(self) -> Steps[int]:
        """Publish again what this producer published within its window (``recent``),
        oldest first: after a loss of accepted requests, those it still holds land after
        all. Returns how many went out; a failure stops it (logged: the loss is counted);
        none while another recovery is under way."""
        if not self._recovering.acquire(blocking=False):
            return 0  # another thread or task recovers already
        sent = 0
        try:
            for kept in self.recent.take():
                try:
                    message = with_fresh_tag(kept.message)
                    yield from self.push_steps(kept.queue, message, kept.records)
                except SeqRefused:
                    continue  # past its deadline by now: it could never apply
                except redis_errors.RedisError as exc:
                    logger.error("republished %d requests, then: %s", sent, exc)
                    break
                sent += 1
        finally:
            self._recovering.release()
        self.recovered(sent)
        return sent

    def recovered(self, sent: int) -> None:
        """Count and log a republish of the window after a loss (``sent`` went out)."""
        self.republished += sent
        logger.warning(
            "the broker lost accepted requests: republished the %d this producer published "
            "in the last %.0f s",
            sent,
            self.recent.seconds,
        )

    # -- reads -----------------------------------------------------------------------------

    def read_call(self, session_id: str, seen: Seen) -> tuple[list[str], list[Any]]:
        """read_pending.lua's 'one' call: the session's newest entry on the broker, with the
        epoch, the mark, and whether an entry the counts expect is missing. ``seen``: the
        ``epochs.floor()`` read before the call goes out, for the script to tell whether
        the broker holds that mark with another token."""
        keys = [
            self.keys.pending_requests(session_id),
            self._epoch_key,
            self.keys.pending(session_id),
            self._mark_key,
            self._index_key,
            self._counts_key,
        ]
        args = ["one", self.keys.pending_value_prefix(session_id), self.ttl_ms, session_id]
        return keys, [*args, seen.mark, seen.token]

    def read_store_call(
        self, session_id: str, store_keys: KeySpace, seen: Seen
    ) -> tuple[list[str], list[Any]]:
        """read_pending.lua's 'store' call: the entry and the store's value and fence, on
        one Redis that is broker and store (``seen``: as ``read_call``)."""
        keys, args = self.read_call(session_id, seen)
        keys += [store_keys.data(session_id), store_keys.fence(session_id)]
        return keys, ["store", *args[1:]]

    def one_reply(self, reply: Sequence[Any], *, seen: Seen) -> tuple[_Fields, bool]:
        """The entry's fields of a 'one' reply, and whether its epoch or mark showed a loss
        of accepted requests (``seen``: ``epochs.floor()`` before the read went out; then
        recover, and read again to see what was republished)."""
        *fields, epoch, mark, forked, token = reply
        lost = self._observe(epoch, mark, seen, forked, token)
        seq, op, req, value = fields
        return (seq, op, req, value), lost

    def store_reply(
        self, store: RedisStore, session_id: str, reply: Sequence[Any], *, seen: Seen
    ) -> tuple[Checkpoint | None, Fence | None, _Fields, bool]:
        """The store's checkpoint and fence and the entry's fields of a 'store' reply, and
        whether it showed a loss (as ``one_reply``)."""
        lost = self._observe(reply[4], reply[10], seen, *reply[11:13])
        # The script sends the value of whichever answers, the entry's or the store's.
        stored = reply[5]
        checkpoint = None if stored is None else store.decode_value(session_id, stored)
        seq, op, req, value = reply[:4]
        return checkpoint, store.fence_from_reply(*reply[6:10]), (seq, op, req, value), lost

    def _observe(
        self, epoch: bytes | None, mark: bytes | None, seen: Seen, forked: int, token: Any
    ) -> bool:
        return self.epochs.observe(
            epoch,
            None if mark is None else int(mark),
            below=seen.mark,
            token=_text(token) if token else "",
            forked=seen if forked else None,
        )

    def heads_call(self, session_ids: Sequence[str]) -> tuple[list[str], list[Any]]:
        """read_pending.lua's 'heads' call for up to ``_HEADS_PER_CALL`` sessions."""
        keys = [
            k for i in session_ids for k in (self.keys.pending_requests(i), self.keys.pending(i))
        ]
        return keys, ["heads", self.ttl_ms]

    def counts_commands(self, session_ids: Sequence[str]) -> list[tuple[Any, ...]]:
        """The reads that tell which of ``session_ids`` (live in the index) lost an entry:
        the pending counts, then each session's number of entries (``missing``)."""
        return [
            ("HMGET", self._counts_key, *session_ids),
            *(("HLEN", self.keys.pending_requests(i)) for i in session_ids),
        ]

    def missing(
        self, session_ids: Sequence[str], replies: Sequence[Any], display_url: str = "the broker"
    ) -> None:
        """Raise ``PendingRecordMissing`` when ``counts_commands``' replies show a session
        with fewer entries left than the pending counts say (read_pending.lua's op
        ``missing``): a list could then leave out accepted writes."""
        if not session_ids:
            return
        counts, *lengths = replies
        missing = [
            i for i, n, left in zip(session_ids, counts, lengths, strict=True) if int(n or 0) > left
        ]
        if missing:
            raise PendingRecordMissing(
                f"the pending records of {len(missing)} session(s) with requests still queued "
                f"are missing on {display_url} (deleted by hand, or evicted), e.g. "
                f"{missing[0]!r}: the list could leave out accepted writes, so it refuses "
                "until workers apply them"
            )

    def unavailable(self, display_url: str, what: str, exc: Exception) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"{what} could not read the pending records on {display_url} "
            f"({type(exc).__name__}: {exc}); the store alone could miss an accepted write"
        )


def requests_named(records: Sequence[RecordWrite]) -> str:
    """A push's requests in a few words, for ``ReplicationTimeout``."""
    if len(records) == 1:
        record = records[0]
        return f"the {record.op} of session {record.session_id!r} (seq {record.seq})"
    return f"a batch of {len(records)} requests"


def refusal_unavailable(request_id: str, display_url: str, exc: Exception) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"could not read the refusal of {request_id!r} on {display_url} "
        f"({type(exc).__name__}: {exc})"
    )


def answer(
    store: CheckpointStore,
    session_id: str,
    checkpoint: Checkpoint | None,
    fence: Fence | None,
    record: PendingRecord | None,
) -> tuple[Checkpoint | None, Fence | None]:
    """A load's answer: the store's, or the pending record's when it is ordered after."""
    if record is None:
        return checkpoint, fence
    if record.deleted or record.lapsed:
        return None, record.as_fence()
    return store.decode_value(session_id, record.value), record.as_fence()


def merge_list(
    records: dict[str, PendingRecord], listed: Sequence[str], fences: Sequence[Fence | None]
) -> list[str]:
    """A list's answer: the store's live sessions (``listed``), plus those whose newest
    pending request is a save ordered after their fence, minus those whose is a delete or a
    lapsed save (or, for a request a worker applied meanwhile, as its fence says); sorted.
    ``fences`` are those of ``sorted(records)``, read after the listing."""
    sessions = set(listed)
    # The fences are read after the listing, so where a worker applied the request
    # in between, the fence, not the listing, is the session's state.
    for session_id, fence in zip(sorted(records), fences, strict=True):
        record = records[session_id]
        if record.wins(fence):
            live = not (record.deleted or record.lapsed)
        else:
            live = fence is not None and fence.live
        if live:
            sessions.add(session_id)
        else:
            sessions.discard(session_id)
    return sorted(sessions)


def heads_records(session_ids: Sequence[str], heads: Sequence[Any]) -> dict[str, PendingRecord]:
    """The newest pending request of each session from 'heads' replies (no values)."""
    records: dict[str, PendingRecord] = {}
    for n, session_id in enumerate(session_ids):
        seq, op, req = heads[3 * n : 3 * n + 3]
        if seq is not None:
            deleted, lapsed_ = op == DELETE_OP.encode(), op == LAPSED_OP.encode()
            records[session_id] = PendingRecord(int(seq), deleted, _text(req), lapsed=lapsed_)
    return records


class PendingRecords(RecordCalls):
    """One deployment's pending records on one broker Redis: written with each push, merged
    into each load and list."""

    def __init__(
        self,
        broker: Any,
        store: CheckpointStore,
        keys: KeySpace,
        *,
        ttl_seconds: float,
        clock: SeqClock | None = None,
        max_seq_ahead_seconds: float = DEFAULT_MAX_SEQ_AHEAD_SECONDS,
        display_url: str = "the broker",
        recent: RecentPublishes | None = None,
        durability: BrokerDurability = LOCAL_DURABILITY,
    ) -> None:
        """Records on ``broker`` (a ``redis.Redis``) for ``store``, named by ``keys``; a
        request's entry lives until its deadline (its seq + ``ttl_seconds``).

        ``clock``: the producer's (its reading goes with every push, for the broker to
        compare with its own); ``max_seq_ahead_seconds``: the limit the worker applies
        (``CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS``), which the broker applies too; ``recent``:
        the recovery window (``RecentPublishes``); ``durability``: whether a push waits for
        broker replicas (``broker_durability``).
        """
        super().__init__(
            keys,
            ttl_seconds=ttl_seconds,
            clock=clock,
            max_seq_ahead_seconds=max_seq_ahead_seconds,
            recent=recent,
            durability=durability,
        )
        self.broker = broker
        self._display_url = display_url
        self.store = store
        self._read = broker.register_script(self.read_source)
        #: Broker and store are one Redis: a load reads both in one script call.
        self.one_redis = isinstance(store, RedisStore) and same_redis(broker, store.client)
        self._read_with_store = (
            store.client.register_script(self.read_source)
            if isinstance(store, RedisStore) and self.one_redis
            else None
        )

    def push(self, queue: str, message: bytes, records: Sequence[RecordWrite]) -> bool:
        """LPUSH ``message`` onto ``queue`` and write ``records``, atomically: one
        publish.lua call in one round trip, the whole request in one send
        (``publish_steps``: by the script's digest, then by its text after a NOSCRIPT; kept
        in the recovery window, published again after a loss). With ``durability``
        replicated, the WAIT goes in the same write, and is checked once the request is
        kept. Returns whether the reply showed the broker lost accepted requests.

        Raises:
            SeqRefused: the broker refused the requests' seq or this producer's clock.
            ReplicationTimeout: accepted by the primary, not by enough replicas in time.
            redis.RedisError: as redis-py raises it (the publisher retries connection errors).
        """
        steps = self.publish_steps(queue, message, records)
        lost, acked = drive(steps, self._round_trip)
        if acked is not None:  # replicated (named only then: local saves pay nothing)
            self.durability.check(acked, requests_named(records), self._display_url)
        return lost

    def recover(self) -> int:
        """Publish the recovery window again (``recover_steps``); how many went out. Called
        by ``push``, and by reads that find the loss."""
        return drive(self.recover_steps(), self._round_trip)

    def _round_trip(self, commands: Commands) -> list[Any]:
        return redis_hooks.round_trip(self.broker, commands)

    # -- reads -----------------------------------------------------------------------------

    def read(self, session_id: str) -> PendingRecord | None:
        """The session's newest pending request, read from the broker.

        Raises:
            BrokerUnavailable: the broker did not answer.
            PendingRecordMissing: an entry the session's count expects is gone.
        """
        return parse_record(*self._read_one(session_id))

    def _read_one(self, session_id: str, again: bool = True) -> _Fields:
        seen = self.epochs.floor()
        keys, args = self.read_call(session_id, seen)
        try:
            reply = self._read(keys=keys, args=args)
        except redis_errors.RedisError as exc:
            raise self._unavailable(f"the load of {session_id!r}", exc) from exc
        fields, lost = self.one_reply(reply, seen=seen)
        if lost and self.recover() > 0 and again:
            return self._read_one(session_id, again=False)  # with what was republished
        return fields

    def load(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """The newest accepted write of the session and its fence: the newest pending
        request's when it is ordered after the store's fence, else the store's.

        Raises:
            BrokerUnavailable: the broker did not answer (a separate broker), or the newest
                pending request answers and is a save whose value is gone (evicted).
            PendingRecordMissing: an entry the session's count expects is gone.
            StoreUnavailable: the store did not answer.
        """
        store = self.store
        store.check_session_id(session_id)
        if self._read_with_store is None:
            fields = self._read_one(session_id)  # first: an entry is gone only once applied
            checkpoint, fence, store_now_ms = store.load_at(session_id)
            # A save alive at the broker read may be past its deadline by the store read,
            # and a fence ordered after it may have expired in between: judge it now.
            record = _answering(fields, fence, self.ttl_ms, store_now_ms)
        else:
            checkpoint, fence, fields = self._load_one_redis(session_id)
            record = _answering(fields, fence)  # one script: judged at its own time
        return answer(store, session_id, checkpoint, fence, record)

    def _load_one_redis(
        self, session_id: str, again: bool = True
    ) -> tuple[Checkpoint | None, Fence | None, _Fields]:
        store = self.store
        if not isinstance(store, RedisStore) or self._read_with_store is None:  # one_redis
            raise TypeError("a one-Redis load needs a RedisStore")
        seen = self.epochs.floor()
        keys, args = self.read_store_call(session_id, store.keys, seen)
        with redis_unavailable(f"load {session_id!r}"):
            reply = self._read_with_store(keys=keys, args=args)
        checkpoint, fence, fields, lost = self.store_reply(store, session_id, reply, seen=seen)
        if lost and self.recover() > 0 and again:
            return self._load_one_redis(session_id, again=False)  # with what was republished
        return checkpoint, fence, fields

    def live_records(self) -> dict[str, PendingRecord]:
        """Every session's newest pending request (no values), by session id.

        Raises:
            BrokerUnavailable: the broker did not answer.
            PendingRecordMissing: a session's entries are fewer than its count says.
        """
        try:
            seconds, micros = self.broker.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            ids = [
                _text(i)
                for i in self.broker.zrangebyscore(self.keys.pending_index(), now_ms, "+inf")
            ]
            heads: list[Any] = []
            for start in range(0, len(ids), _HEADS_PER_CALL):
                keys, args = self.heads_call(ids[start : start + _HEADS_PER_CALL])
                heads += self._read(keys=keys, args=args)
            epoch = self.broker.get(self._epoch_key)
            pipe = self.broker.pipeline(transaction=False)
            for command in self.counts_commands(ids) if ids else []:
                pipe.execute_command(*command)
            counts = pipe.execute()
        except redis_errors.RedisError as exc:
            raise self._unavailable("the list", exc) from exc
        self.missing(ids, counts, self._display_url)
        self.epochs.observe(epoch)
        return heads_records(ids, heads)

    def list(self) -> list[str]:
        """The store's live sessions, plus those whose newest pending request is a save
        ordered after their fence, minus those whose is a delete or a lapsed save (or, for
        a request a worker applied meanwhile, as its fence says); sorted.

        Raises:
            BrokerUnavailable: the broker did not answer.
            StoreUnavailable: the store did not answer.
        """
        records = self.live_records()  # first, as for a load
        listed = self.store.list()
        return merge_list(records, listed, self.store.fences(sorted(records)))

    def refusal(self, session_id: str, request_id: str) -> Refusal | None:
        """The refusal a worker recorded for ``request_id`` in its session, on the broker
        (where workers keep them beside a store that does not: ``keeps_refusals``)."""
        try:
            raw = self.broker.hget(self.keys.refusals(session_id), request_id)
        except redis_errors.RedisError as exc:
            raise refusal_unavailable(request_id, self._display_url, exc) from exc
        return Refusal.decode(raw)

    def _unavailable(self, what: str, exc: Exception) -> BrokerUnavailable:
        return self.unavailable(self._display_url, what, exc)


class Settlement(NamedTuple):
    """A request the worker is done with (applied, superseded, lapsed or dead-lettered):
    its entry goes, and its value unless ``keep_value`` (a dead letter that could not take
    it: the value stays on the broker, for people, until its deadline). The entry is the
    request's own only if it holds the request's stamp, ``seq`` and op (``deleted``): a
    message carrying another request's id settles nothing of it; with no ``seq`` (none that
    parses), no entry is its own. ``legacy_staged``: its staged value was found in the layout
    before issue 31 (``KeySpace.legacy_pending_value``), holding its own session's
    checkpoint. ``tag``: the delivery tag of the message settled ('' unknown): a request
    published again since (a broker that lost it) is its newer message's to settle, and
    this settle leaves it alone (tests/model/README.md, finding 5)."""

    session_id: str
    request_id: str
    seq: int | None
    deleted: bool = False
    keep_value: bool = False
    legacy_staged: bool = False
    tag: str = ""


def settle_command(keys: KeySpace, settled: Sequence[Settlement]) -> tuple[list[str], list[Any]]:
    """settle.lua's KEYS and ARGV for ``settled`` requests."""
    script_keys = [keys.pending_index(), keys.pending_counts()]
    args: list[Any] = []
    for session_id, request_id, seq, deleted, keep_value, legacy_staged, tag in settled:
        script_keys += [
            keys.pending_requests(session_id),
            keys.pending(session_id),
            keys.pending_value(session_id, request_id),
            keys.legacy_pending_value(request_id),
            keys.pending_counted(session_id),
        ]
        values = "0" if keep_value else "2" if legacy_staged else "1"
        op = DELETE_OP if deleted else SAVE_OP
        args += [session_id, request_id, "" if seq is None else str(seq), op, values, tag]
    return script_keys, args


def settle_source() -> str:
    """settle.lua's text (the worker registers it once per broker client)."""
    return script_source("settle", _SCRIPTS)


class Settler:
    """The worker's pool processes settle records with this, one script call per task
    (the coalesced path rides its acks instead: ``worker/coalesce.py``)."""

    def __init__(self, broker: Any, keys: KeySpace) -> None:
        self.broker = broker
        self.keys = keys
        self._script = broker.register_script(settle_source())

    def settle(self, settled: Sequence[Settlement]) -> None:
        """Remove the entries and the values of ``settled`` requests.

        Never raises: a record left behind is only read until it expires or the session's
        next request settles it, and loads order it below the store's fence anyway."""
        if not settled:
            return
        keys, args = settle_command(self.keys, settled)
        try:
            self._script(keys=keys, args=args)
        except redis_errors.RedisError as exc:
            logger.warning("could not settle %d pending records: %s", len(settled), exc)

    def close(self) -> None:
        self.broker.close()


def _replies(answer: Answer | None) -> list[Any]:
    """A write's replies, or what its sending raised, raised here (in the steps)."""
    if isinstance(answer, Exception):
        raise answer
    if answer is None:
        raise TypeError("steps were resumed without an answer")
    return answer


class Exchange(Generic[_T]):
    """The state of ``Steps`` being driven: the next write's commands (``next``), then
    ``answer`` set from its sending; ``result`` once they are done."""

    def __init__(self, steps: Steps[_T]) -> None:
        self.steps = steps
        self.answer: Answer | None = None
        self.result: _T

    def next(self) -> Commands | None:
        """The commands of the next write, or None once the steps returned ``result``."""
        try:
            return self.steps.send(self.answer)
        except StopIteration as done:
            self.result = done.value
            return None


def caught(send: Callable[[Commands], list[Any]], commands: Commands) -> Answer:
    """``send(commands)``, or the exception it raised (for the steps to judge)."""
    try:
        return send(commands)
    except Exception as exc:
        return exc


def drive(steps: Steps[_T], send: Callable[[Commands], list[Any]]) -> _T:
    """Run ``steps`` with ``send`` making each write, blocking (the sync client)."""
    exchange = Exchange(steps)
    while (commands := exchange.next()) is not None:
        exchange.answer = caught(send, commands)
    return exchange.result
