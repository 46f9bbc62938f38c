"""Pending records: the newest accepted request per session, kept on the broker until a
worker settles it, so that every replica's load sees a write the queue still holds.

docs/protocol.md ("Pending records") is the contract; this module is its Python side:

* ``PendingRecords.push`` runs ``tasks/lua/publish.lua``: the LPUSH and the records of every
  request the message carries, in one script call (the Go client embeds the same file).
* ``PendingRecords.load`` and ``list`` merge the records with the store by ``seq``. The
  record is read **before** the store (a record is removed only once its request was
  applied, so a missing record means the store has it): one script call when broker and
  store are one Redis (``tasks/lua/load_pending.lua``), else one read of each.
* ``settle`` (the worker's side) runs ``tasks/lua/settle.lua``: a record goes once a
  request of its seq or a later one was applied, superseded or dead-lettered.

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
from checkpointq.store.base import CheckpointStore, Fence
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import Checkpoint
from checkpointq.store.redis import RedisStore
from checkpointq.store.scripts import script_source
from checkpointq.tasks.errors import BrokerUnavailable, redis_unavailable

logger = logging.getLogger(__name__)

_SCRIPTS = "checkpointq.tasks"

#: Record ops, as publish.lua stores them.
SAVE_OP, DELETE_OP = "save", "delete"
#: What publish.lua is told for a staged save (it stores the record as a save).
STAGED_OP = "staged"

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
    """A session's record as read back from the broker."""

    seq: int
    deleted: bool
    request_id: str
    value: bytes = b""

    def wins(self, fence: Fence | None) -> bool:
        """Whether the record, not the store, answers: its request is newer than the last
        one the store applied (or the store applied none)."""
        return fence is None or self.seq > fence.seq

    def as_fence(self) -> Fence:
        """The fence a load returns for it, so that the next request sorts after it."""
        return Fence(self.seq, self.deleted, self.request_id, live=not self.deleted)


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")


def parse_record(
    seq: bytes | None, op: bytes | None, req: bytes | None = None, value: bytes | None = None
) -> PendingRecord | None:
    """A record from its fields as read_pending.lua and load_pending.lua return them (seq,
    op, req, value); None when there is none.

    Raises:
        BrokerUnavailable: the fields are not a record publish.lua writes (a foreign writer).
    """
    if seq is None:
        return None
    deleted = op == DELETE_OP.encode()
    if not deleted and (op != SAVE_OP.encode() or not value):
        raise BrokerUnavailable(f"unreadable pending record (op {_text(op)!r}, seq {_text(seq)})")
    return PendingRecord(int(seq), deleted, _text(req), b"" if deleted else bytes(value or b""))


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
        display_url: str = "the broker",
    ) -> None:
        """Records on ``broker`` (a ``redis.Redis``) for ``store``, named by ``keys``, living
        ``ttl_seconds`` (as long as the checkpoints they hold would)."""
        self.broker = broker
        self._display_url = display_url
        self.store = store
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.epochs = EpochWatch()
        self._index_key, self._epoch_key = keys.pending_index(), keys.pending_epoch()
        self._publish_source = script_source("publish", _SCRIPTS)
        self._publish_sha = hashlib.sha1(
            self._publish_source.encode(), usedforsecurity=False
        ).hexdigest()
        # A staged save's value is read from the key its record names, so a record is read
        # by a script: read_pending.lua, or load_pending.lua with the store's part.
        self._read = broker.register_script(script_source("read_pending", _SCRIPTS))
        #: Broker and store are one Redis: a load reads both in one script call.
        self.one_redis = isinstance(store, RedisStore) and same_redis(broker, store.client)
        self._load = (
            store.client.register_script(script_source("load_pending", _SCRIPTS))
            if isinstance(store, RedisStore) and self.one_redis
            else None
        )

    # -- writes ----------------------------------------------------------------------------

    def push(self, queue: str, message: bytes, records: Sequence[RecordWrite]) -> None:
        """LPUSH ``message`` onto ``queue`` and write ``records``, atomically: one
        publish.lua call in one round trip, the whole request in one send. The script runs
        by its digest; a broker that lost its script cache refuses it whole (NOSCRIPT, so
        nothing was pushed) and the call goes again with the script's text.

        Raises:
            redis.RedisError: as redis-py raises it (the publisher retries connection errors).
        """
        keys = [queue, self._index_key, self._epoch_key]
        # A fresh token per call, cheaply: the epoch only when the broker has none.
        args: list[Any] = [message, self.ttl_ms, os.urandom(16).hex()]
        # Staged values: SET just before the script, which checks they are there, gives them
        # the records' lifetime and names them in the records (docs/protocol.md, "Staged
        # saves"). They never pass through Lua, which copies every argument.
        stage: list[tuple[Any, ...]] = []
        value_keys: list[str] = []
        for record in records:
            keys.append(self.keys.pending(record.session_id))
            if record.staged:
                value_keys.append(value_key := self.keys.pending_value(record.request_id))
                stage.append(("SET", value_key, record.value, "PX", STAGED_VALUE_WAIT_MS))
                args += [record.session_id, record.seq, STAGED_OP, record.request_id, b""]
            else:
                args += [record.session_id, record.seq, record.op, record.request_id, record.value]
        keys += value_keys
        *staged, epoch = redis_hooks.round_trip(
            self.broker, [*stage, ("EVALSHA", self._publish_sha, len(keys), *keys, *args)]
        )
        if isinstance(epoch, redis_errors.NoScriptError):
            *staged, epoch = redis_hooks.round_trip(
                self.broker, [*stage, ("EVAL", self._publish_source, len(keys), *keys, *args)]
            )
        # A refused staged SET (OOM, READONLY) is the cause; the script then refused the push.
        for reply in (*staged, epoch):
            if isinstance(reply, Exception):
                raise reply
        self.epochs.observe(epoch)

    # -- reads -----------------------------------------------------------------------------

    def read(self, session_id: str) -> PendingRecord | None:
        """The session's live record, read from the broker.

        Raises:
            BrokerUnavailable: the broker did not answer (the store alone could be stale).
        """
        try:
            *fields, epoch = self._read(
                keys=[self.keys.pending(session_id), self._epoch_key], args=[]
            )
        except redis_errors.RedisError as exc:
            raise self._unavailable(f"the load of {session_id!r}", exc) from exc
        self.epochs.observe(epoch)
        return parse_record(*fields)

    def load(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """The newest accepted write of the session and its fence: the record's when it is
        newer than the store's fence, else the store's.

        Raises:
            BrokerUnavailable: the broker did not answer (a separate broker).
            StoreUnavailable: the store did not answer.
        """
        store = self.store
        store.check_session_id(session_id)
        if self._load is None:
            record = self.read(session_id)
            checkpoint, fence = store.load_with_fence(session_id)
        else:
            checkpoint, fence, record = self._load_one_redis(session_id)
        if record is None or not record.wins(fence):
            return checkpoint, fence
        if record.deleted:
            return None, record.as_fence()
        return store.decode_value(session_id, record.value), record.as_fence()

    def _load_one_redis(
        self, session_id: str
    ) -> tuple[Checkpoint | None, Fence | None, PendingRecord | None]:
        store = self.store
        if not isinstance(store, RedisStore) or self._load is None:  # one_redis says so
            raise TypeError("a one-Redis load needs a RedisStore")
        keys = [
            self.keys.pending(session_id),
            self.keys.pending_epoch(),
            store.keys.data(session_id),
            store.keys.fence(session_id),
        ]
        with redis_unavailable(f"load {session_id!r}"):
            reply = self._load(keys=keys, args=[])
        record = parse_record(*reply[:4])
        self.epochs.observe(reply[4])
        stored = reply[5]
        checkpoint = None if stored is None else store.decode_value(session_id, stored)
        return checkpoint, store.fence_from_reply(*reply[6:10]), record

    def live_records(self) -> dict[str, PendingRecord]:
        """Every live record's seq and op (no values), by session id.

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
            pipe = self.broker.pipeline(transaction=False)
            for session_id in ids:
                pipe.hmget(self.keys.pending(session_id), "seq", "op")
            pipe.get(self.keys.pending_epoch())
            *replies, epoch = pipe.execute()
        except redis_errors.RedisError as exc:
            raise self._unavailable("the list", exc) from exc
        self.epochs.observe(epoch)
        records: dict[str, PendingRecord] = {}
        for session_id, (seq, op) in zip(ids, replies, strict=True):
            if seq is not None:
                deleted = op == DELETE_OP.encode()
                records[session_id] = PendingRecord(int(seq), deleted, "")
        return records

    def list(self) -> list[str]:
        """The store's live sessions, plus those whose record is a save newer than their
        fence, minus those whose record is a delete newer than theirs (or, for a record a
        worker applied meanwhile, as its fence says); sorted.

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
            listed = not record.deleted if record.wins(fence) else fence is not None and fence.live
            if listed:
                sessions.add(session_id)
            else:
                sessions.discard(session_id)
        return sorted(sessions)

    def _unavailable(self, what: str, exc: Exception) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"{what} could not read the pending records on {self._display_url} "
            f"({type(exc).__name__}: {exc}); the store alone could miss an accepted write"
        )


class Settlement(NamedTuple):
    """A request the worker is done with (applied, superseded or dead-lettered)."""

    session_id: str
    seq: int
    #: A staged save's request id: its staged value goes too ("" for any other request).
    staged: str = ""


def settle_command(keys: KeySpace, settled: Sequence[Settlement]) -> tuple[list[str], list[Any]]:
    """settle.lua's KEYS and ARGV for ``settled`` requests."""
    script_keys = [keys.pending_index()]
    args: list[Any] = []
    for session_id, seq, _ in settled:
        script_keys.append(keys.pending(session_id))
        args += [session_id, seq]
    script_keys += [keys.pending_value(staged) for *_, staged in settled if staged]
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
        """Remove the records of ``settled`` requests and older ones, and their staged values.

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
