"""A thread-safe in-process store with the same contract as the Redis store.

It keeps *serialized, compressed bytes*, not objects, so its tests exercise the same
encoding path as Redis; and it takes an injectable clock so that TTLs and tombstones can be
tested without waiting.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from checkpointq.store.base import (
    CheckpointStore,
    Clock,
    Fence,
    Page,
    SaveResult,
    SessionCounts,
    StoreOptions,
    new_identity,
)
from checkpointq.store.errors import InvalidInput
from checkpointq.store.model import Checkpoint
from checkpointq.store.ordering import OrderKey, order_key


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


@dataclass(slots=True)
class _Fence:
    seq: int
    deleted: bool
    #: When the fence itself may be forgotten (seconds since epoch).
    expires_at: float
    request_id: str = ""
    lapsed: bool = False

    def key(self) -> OrderKey:
        return order_key(self.seq, self.deleted, self.request_id)


@dataclass(slots=True)
class _Entry:
    value: bytes
    deadline: float


class InMemoryStore(CheckpointStore):
    """For development and tests; data lives as long as the process."""

    ref_scheme = "memory"

    def __init__(self, options: StoreOptions | None = None, clock: Clock = time.time) -> None:
        super().__init__(options, clock)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._fences: dict[str, _Fence] = {}
        self._identity = new_identity()

    def identity(self) -> str:
        """One per instance: the processes sharing it are threads of one process."""
        return self._identity

    def _live_fence(self, session_id: str, now: float) -> _Fence | None:
        fence = self._fences.get(session_id)
        if fence is not None and fence.expires_at <= now:
            del self._fences[session_id]
            return None
        return fence

    def _beaten(self, session_id: str, now: float, key: OrderKey, *, repeats: bool) -> bool:
        """Whether the session's fence holds a request ordered after ``key`` (or, unless
        ``repeats``, the very request ``key`` names: a duplicate that must not apply)."""
        fence = self._live_fence(session_id, now)
        return fence is not None and (key < fence.key() or (key == fence.key() and not repeats))

    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
        seq = self.resolve_seq(seq)
        session_id = checkpoint.session_id
        if self.lapsed(seq, _ms(self.clock())):
            self.lapse(session_id, seq, request_id)
            return SaveResult.lapse(self.ref(session_id, checkpoint.version), checkpoint, seq)
        encoded = self.encode(checkpoint)
        ref = self.ref(session_id, checkpoint.version)
        with self._lock:
            now = self.clock()
            if self._beaten(session_id, now, order_key(seq, False, request_id), repeats=True):
                return SaveResult.of(ref, checkpoint, seq, encoded, applied=False)
            deadline = self.value_deadline_ms(seq, _ms(now)) / 1000
            self._entries[session_id] = _Entry(encoded.value, deadline)
            self._fences[session_id] = _Fence(
                seq, False, deadline + self.options.tombstone_ttl_seconds, request_id
            )
        return SaveResult.of(ref, checkpoint, seq, encoded, applied=True)

    def lapse(self, session_id: str, seq: int, request_id: str = "") -> bool:
        self.check_session_id(session_id)
        return self._end(session_id, order_key(seq, False, request_id), lapsed=True)

    def _end(self, session_id: str, key: OrderKey, *, lapsed: bool = False) -> bool:
        """A delete's tombstone, or a lapsed save's fence (``lapsed``), unless beaten."""
        seq, rank, request_id = key
        with self._lock:
            now = self.clock()
            if self._beaten(session_id, now, key, repeats=not lapsed):
                return False
            self._entries.pop(session_id, None)
            expires = self.tombstone_expiry_ms(seq, _ms(now)) / 1000
            self._fences[session_id] = _Fence(
                seq, bool(rank), expires, request_id.decode("utf-8", "surrogatepass"), lapsed
            )
        return True

    def load(self, session_id: str) -> Checkpoint | None:
        return self.load_with_fence(session_id)[0]

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        self.check_session_id(session_id)
        with self._lock:
            now = self.clock()
            fence = self._public_fence(session_id, now)
            entry = self._entries.get(session_id)
            if entry is None or entry.deadline <= now:
                return None, fence
            value = entry.value
        return self._decode(session_id, value), fence

    def _decode(self, session_id: str, value: bytes) -> Checkpoint:
        return self.decode_value(session_id, value)

    def delete(self, session_id: str, seq: int | None = None, request_id: str = "") -> bool:
        self.check_session_id(session_id)
        return self._end(session_id, order_key(self.resolve_seq(seq), True, request_id))

    def refresh(self, session_id: str) -> bool:
        self.check_session_id(session_id)
        with self._lock:
            now = self.clock()
            entry = self._entries.get(session_id)
            if entry is None or entry.deadline <= now:
                return False
            entry.deadline = now + self.options.ttl_seconds
            fence = self._fences.get(session_id)
            if fence is not None:
                fence.expires_at = max(
                    fence.expires_at, entry.deadline + self.options.tombstone_ttl_seconds
                )
        return True

    def fence(self, session_id: str) -> Fence | None:
        self.check_session_id(session_id)
        with self._lock:
            return self._public_fence(session_id, self.clock())

    def _public_fence(self, session_id: str, now: float) -> Fence | None:
        fence = self._live_fence(session_id, now)
        if fence is None:
            return None
        entry = self._entries.get(session_id)
        live = not fence.deleted and entry is not None and entry.deadline > now
        return Fence(fence.seq, fence.deleted, fence.request_id, live, fence.lapsed)

    def list_page(self, cursor: str | None = None, count: int = 1000) -> Page:
        try:
            start = int(cursor) if cursor else 0
        except ValueError:
            raise InvalidInput(f"not a cursor this store returned: {cursor!r}") from None
        with self._lock:
            now = self.clock()
            live = sorted(sid for sid, e in self._entries.items() if e.deadline > now)
        chunk = live[start : start + count]
        next_cursor = str(start + count) if start + count < len(live) else None
        return Page(chunk, next_cursor)

    def count_sessions(self, now: float | None = None) -> SessionCounts:
        with self._lock:
            now = self.clock() if now is None else now
            live = sum(1 for entry in self._entries.values() if entry.deadline > now)
            return SessionCounts(live, len(self._entries) - live)

    def expire_stale(self, now: float | None = None, limit: int = 1000) -> list[str]:
        with self._lock:
            now = self.clock() if now is None else now
            stale = sorted(
                (e.deadline, sid) for sid, e in self._entries.items() if e.deadline <= now
            )[:limit]
            for _, session_id in stale:
                del self._entries[session_id]
            # Forget fences past their own lifetime, as Redis does with the fence key's TTL.
            forgotten = [sid for sid, f in self._fences.items() if f.expires_at <= now]
            for session_id in forgotten:
                del self._fences[session_id]
        return [session_id for _, session_id in stale]

    def inject_raw(self, session_id: str, value: bytes) -> None:
        """Store raw bytes as a session's value (tests of corrupt data only)."""
        with self._lock:
            self._entries[session_id] = _Entry(value, self.clock() + self.options.ttl_seconds)
