"""Pending records: every accepted request of a session, kept on the broker until a worker
settles it, so that every replica's load sees a write the queue still holds.

docs/protocol.md ("Pending records") is the contract; this module is its Python side:

* ``PendingRecords.push`` runs ``tasks/lua/publish.lua``: the LPUSH and one entry per
  request the message carries (with a save's value), in one script call (the Go client
  embeds the same file). The broker checks each ``seq`` and this producer's clock first.
* ``PendingRecords.load`` and ``list`` merge the newest entry with the store, by the order of
  requests (``store.ordering``). The entries are read **before** the store (an entry goes only
  once its request was applied, so a missing entry means the store has it): one script call
  when broker and store are one Redis, else one read of each (``tasks/lua/read_pending.lua``).
* ``settle`` (the worker's side) runs ``tasks/lua/settle.lua``: each settled request removes
  its own entry and value, and nothing else, so a request refused or superseded never hides
  another that is still on its way.

A broker that lost its data (restarted without persistence) shows a new epoch token;
``EpochWatch`` counts it (``checkpointq_pending_epoch_changes_total``) and loads read the
store alone, which is then all there is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis import exceptions as redis_errors

from checkpointq.store import redis_hooks
from checkpointq.store.base import CheckpointStore, Fence, Refusal
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import Checkpoint
from checkpointq.store.ordering import OrderKey, lapsed, order_key
from checkpointq.store.redis import RedisStore
from checkpointq.store.scripts import script_source
from checkpointq.tasks.errors import BrokerUnavailable, SeqRefused, redis_unavailable
from checkpointq.tasks.producer.clock import SeqClock, seq_clock

logger = logging.getLogger(__name__)

_SCRIPTS = "checkpointq.tasks"

#: Entry ops, as publish.lua stores them.
SAVE_OP, DELETE_OP = "save", "delete"
#: What publish.lua is told for a staged save (it stores the entry as a save).
STAGED_OP = "staged"
#: What read_pending.lua answers for a save past its deadline (store.ordering).
LAPSED_OP = "lapsed"

#: The worker's default limit on how far ahead a seq may be (CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS).
DEFAULT_MAX_SEQ_AHEAD_SECONDS = 300.0

#: How publish.lua's refusals start (the rest says why).
_REFUSED = "CQREFUSED"

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
        return None
    head = PendingRecord(int(seq), op == DELETE_OP.encode(), _text(req))
    if not head.wins(fence):
        return None
    if op == SAVE_OP.encode() and now_ms is not None and lapsed(head.seq, ttl_ms, now_ms):
        return PendingRecord(head.seq, False, head.request_id, lapsed=True)
    return parse_record(seq, op, req, value)


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
        return None
    if op == DELETE_OP.encode():
        return PendingRecord(int(seq), True, _text(req))
    if op == LAPSED_OP.encode():
        return PendingRecord(int(seq), False, _text(req), lapsed=True)
    if op != SAVE_OP.encode() or not value:
        raise BrokerUnavailable(f"unreadable pending record (op {_text(op)!r}, seq {_text(seq)})")
    return PendingRecord(int(seq), False, _text(req), bytes(value))


class EpochWatch:
    """Follows the broker's pending epoch and counts the times it changed or vanished: each
    one is a broker that lost its records (and its queue). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: object = None  # None before the first token; _LOST after a loss
        #: How many losses this watch saw (``checkpointq_pending_epoch_changes_total``).
        self.changes = 0

    def observe(self, epoch: bytes | None) -> None:
        with self._lock:
            if epoch == self._last:
                return
            if self._last is None or self._last is _LOST:
                if epoch is not None:  # the first token, or the first after a loss
                    self._last = epoch
                return
            self.changes += 1
            self._last = _LOST if epoch is None else epoch


_LOST = object()


def same_redis(a: Any, b: Any) -> bool:
    """Whether two ``redis.Redis`` clients talk to one server and database."""
    pools = [getattr(c, "connection_pool", None) for c in (a, b)]
    if any(p is None or not hasattr(p, "connection_kwargs") for p in pools):
        return False
    fields = ("host", "port", "path", "db", "username")
    kwargs = [p.connection_kwargs for p in pools]  # type: ignore[union-attr]
    return all(kwargs[0].get(f) == kwargs[1].get(f) for f in fields)


class PendingRecords:
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
    ) -> None:
        """Records on ``broker`` (a ``redis.Redis``) for ``store``, named by ``keys``; a
        request's entry lives until its deadline (its seq + ``ttl_seconds``).

        ``clock``: the producer's (its reading goes with every push, for the broker to
        compare with its own); ``max_seq_ahead_seconds``: the limit the worker applies
        (``CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS``), which the broker applies too.
        """
        self.broker = broker
        self._display_url = display_url
        self.store = store
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.clock = clock or seq_clock
        self.max_ahead_us = int(max_seq_ahead_seconds * 1_000_000)
        self.epochs = EpochWatch()
        self._index_key, self._epoch_key = keys.pending_index(), keys.pending_epoch()
        self._publish_source = script_source("publish", _SCRIPTS)
        self._publish_sha = hashlib.sha1(
            self._publish_source.encode(), usedforsecurity=False
        ).hexdigest()
        self._read = broker.register_script(script_source("read_pending", _SCRIPTS))
        #: Broker and store are one Redis: a load reads both in one script call.
        self.one_redis = isinstance(store, RedisStore) and same_redis(broker, store.client)
        self._read_with_store = (
            store.client.register_script(script_source("read_pending", _SCRIPTS))
            if isinstance(store, RedisStore) and self.one_redis
            else None
        )

    # -- writes ----------------------------------------------------------------------------

    def push_call(
        self, queue: str, message: bytes, records: Sequence[RecordWrite], clock_us: int
    ) -> tuple[list[str], list[Any]]:
        """publish.lua's KEYS and ARGV (its header says what each is): the one place they are
        built. The Go client builds the same call (tests/go/test_publish_calls.py)."""
        keys = [queue, self._index_key, self._epoch_key]
        # A fresh token per call, cheaply: the epoch only when the broker has none.
        args: list[Any] = [message, self.ttl_ms, os.urandom(16).hex(), clock_us, self.max_ahead_us]
        for record in records:
            keys += [
                self.keys.pending_requests(record.session_id),
                self.keys.pending_value(record.session_id, record.request_id),
            ]
            op, value = (STAGED_OP, b"") if record.staged else (record.op, record.value)
            args += [record.session_id, record.seq, op, record.request_id, value]
        return keys, args

    def push(self, queue: str, message: bytes, records: Sequence[RecordWrite]) -> None:
        """LPUSH ``message`` onto ``queue`` and write ``records``, atomically: one
        publish.lua call in one round trip, the whole request in one send. The script runs
        by its digest; a broker that lost its script cache refuses it whole (NOSCRIPT, so
        nothing was pushed) and the call goes again with the script's text.

        Raises:
            SeqRefused: the broker refused the requests' seq or this producer's clock.
            redis.RedisError: as redis-py raises it (the publisher retries connection errors).
        """
        keys, args = self.push_call(queue, message, records, self.clock.now_us())
        # Staged values: SET just before the script, which checks they are there, gives them
        # the records' lifetime and names them in the records (docs/protocol.md, "Staged
        # saves"). They never pass through Lua, which copies every argument.
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
        *staged, epoch = redis_hooks.round_trip(
            self.broker, [*stage, ("EVALSHA", self._publish_sha, len(keys), *keys, *args)]
        )
        if isinstance(epoch, redis_errors.NoScriptError):
            *staged, epoch = redis_hooks.round_trip(
                self.broker, [*stage, ("EVAL", self._publish_source, len(keys), *keys, *args)]
            )
        # A refused staged SET (OOM, READONLY) is the cause; the script then refused the push.
        for reply in (*staged, epoch):
            if isinstance(reply, redis_errors.ResponseError) and str(reply).startswith(_REFUSED):
                raise SeqRefused(str(reply).removeprefix(_REFUSED).strip(), field="seq")
            if isinstance(reply, Exception):
                raise reply
        self.epochs.observe(epoch)

    # -- reads -----------------------------------------------------------------------------

    def _read_args(self, session_id: str) -> list[Any]:
        return [self.keys.pending_value_prefix(session_id), self.ttl_ms]

    def read(self, session_id: str) -> PendingRecord | None:
        """The session's newest pending request, read from the broker.

        Raises:
            BrokerUnavailable: the broker did not answer (the store alone could be stale),
                or the request is a save whose value is gone before its deadline.
        """
        return parse_record(*self._read_one(session_id))

    def _read_one(self, session_id: str) -> _Fields:
        keys = [
            self.keys.pending_requests(session_id),
            self._epoch_key,
            self.keys.pending(session_id),
        ]
        try:
            *fields, epoch = self._read(keys=keys, args=["one", *self._read_args(session_id)])
        except redis_errors.RedisError as exc:
            raise self._unavailable(f"the load of {session_id!r}", exc) from exc
        self.epochs.observe(epoch)
        seq, op, req, value = fields
        return seq, op, req, value

    def load(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """The newest accepted write of the session and its fence: the newest pending
        request's when it is ordered after the store's fence, else the store's.

        Raises:
            BrokerUnavailable: the broker did not answer (a separate broker), or the newest
                pending request answers and is a save whose value is gone (evicted).
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
        if record is None:
            return checkpoint, fence
        if record.deleted or record.lapsed:
            return None, record.as_fence()
        return store.decode_value(session_id, record.value), record.as_fence()

    def _load_one_redis(self, session_id: str) -> tuple[Checkpoint | None, Fence | None, _Fields]:
        store = self.store
        if not isinstance(store, RedisStore) or self._read_with_store is None:  # one_redis
            raise TypeError("a one-Redis load needs a RedisStore")
        keys = [
            self.keys.pending_requests(session_id),
            self._epoch_key,
            self.keys.pending(session_id),
            store.keys.data(session_id),
            store.keys.fence(session_id),
        ]
        with redis_unavailable(f"load {session_id!r}"):
            reply = self._read_with_store(keys=keys, args=["store", *self._read_args(session_id)])
        self.epochs.observe(reply[4])
        # The script sends the value of whichever answers, the entry's or the store's.
        stored = reply[5]
        checkpoint = None if stored is None else store.decode_value(session_id, stored)
        seq, op, req, value = reply[:4]
        return checkpoint, store.fence_from_reply(*reply[6:10]), (seq, op, req, value)

    def live_records(self) -> dict[str, PendingRecord]:
        """Every session's newest pending request (no values), by session id.

        Raises:
            BrokerUnavailable: the broker did not answer.
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
                chunk = ids[start : start + _HEADS_PER_CALL]
                keys = [
                    k for i in chunk for k in (self.keys.pending_requests(i), self.keys.pending(i))
                ]
                heads += self._read(keys=keys, args=["heads", self.ttl_ms])
            epoch = self.broker.get(self._epoch_key)
        except redis_errors.RedisError as exc:
            raise self._unavailable("the list", exc) from exc
        self.epochs.observe(epoch)
        records: dict[str, PendingRecord] = {}
        for n, session_id in enumerate(ids):
            seq, op, req = heads[3 * n : 3 * n + 3]
            if seq is not None:
                deleted, lapsed = op == DELETE_OP.encode(), op == LAPSED_OP.encode()
                records[session_id] = PendingRecord(int(seq), deleted, _text(req), lapsed=lapsed)
        return records

    def list(self) -> list[str]:
        """The store's live sessions, plus those whose newest pending request is a save
        ordered after their fence, minus those whose is a delete or a lapsed save (or, for
        a request a worker applied meanwhile, as its fence says); sorted.

        Raises:
            BrokerUnavailable: the broker did not answer.
            StoreUnavailable: the store did not answer.
        """
        records = self.live_records()  # first, as for a load
        sessions = set(self.store.list())
        ids = sorted(records)
        # The fences are read after the listing, so where a worker applied the request
        # in between, the fence, not the listing, is the session's state.
        for session_id, fence in zip(ids, self.store.fences(ids), strict=True):
            record = records[session_id]
            if record.wins(fence):
                listed = not (record.deleted or record.lapsed)
            else:
                listed = fence is not None and fence.live
            if listed:
                sessions.add(session_id)
            else:
                sessions.discard(session_id)
        return sorted(sessions)

    def refusal(self, session_id: str, request_id: str) -> Refusal | None:
        """The refusal a worker recorded for ``request_id`` in its session, on the broker
        (where workers keep them beside a store that does not: ``keeps_refusals``)."""
        try:
            raw = self.broker.hget(self.keys.refusals(session_id), request_id)
        except redis_errors.RedisError as exc:
            raise BrokerUnavailable(
                f"could not read the refusal of {request_id!r} on {self._display_url} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return Refusal.decode(raw)

    def _unavailable(self, what: str, exc: Exception) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"{what} could not read the pending records on {self._display_url} "
            f"({type(exc).__name__}: {exc}); the store alone could miss an accepted write"
        )


class Settlement(NamedTuple):
    """A request the worker is done with (applied, superseded, lapsed or dead-lettered):
    its entry goes, and its value unless ``keep_value`` (a dead letter that could not take
    it: the value stays on the broker, for people, until its deadline). The entry is the
    request's own only if it holds the request's stamp, ``seq`` and op (``deleted``): a
    message carrying another request's id settles nothing of it; with no ``seq`` (none that
    parses), no entry is its own. ``legacy_staged``: its staged value was found in the layout
    before issue 31 (``KeySpace.legacy_pending_value``), holding its own session's
    checkpoint."""

    session_id: str
    request_id: str
    seq: int | None
    deleted: bool = False
    keep_value: bool = False
    legacy_staged: bool = False


def settle_command(keys: KeySpace, settled: Sequence[Settlement]) -> tuple[list[str], list[Any]]:
    """settle.lua's KEYS and ARGV for ``settled`` requests."""
    script_keys = [keys.pending_index()]
    args: list[Any] = []
    for session_id, request_id, seq, deleted, keep_value, legacy_staged in settled:
        script_keys += [
            keys.pending_requests(session_id),
            keys.pending(session_id),
            keys.pending_value(session_id, request_id),
            keys.legacy_pending_value(request_id),
        ]
        values = "0" if keep_value else "2" if legacy_staged else "1"
        op = DELETE_OP if deleted else SAVE_OP
        args += [session_id, request_id, "" if seq is None else str(seq), op, values]
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
