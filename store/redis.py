"""The Redis store: Go-compatible values, fenced atomic writes, an index instead of SCAN.

Each write (fence check, value, TTL, fence metadata, index entry) is one Lua script call,
so a crash can never leave a value without its TTL or an index entry without its value.
Listing and expiry read a sorted set of deadlines, so their cost follows what they return,
not the size of the keyspace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis import exceptions as redis_errors

from store.base import CheckpointStore, Clock, Fence, Page, SaveResult, StoreOptions
from store.codec import CodecError
from store.errors import CorruptCheckpoint, InvalidCheckpoint, StoreUnavailable
from store.keys import DEFAULT_PREFIX, KeySpace
from store.model import Checkpoint
from store.scripts import Scripts
from store.serde import deserialize_checkpoint
from store.urls import redact_url

logger = logging.getLogger(__name__)

#: Sessions expired per pipelined round trip in a sweep: large enough to amortise the round
#: trip, small enough that one pipeline never holds Redis for more than a millisecond or so.
SWEEP_BATCH = 500

# Errors that say "try again later" rather than "this request is wrong".
_TRANSIENT = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    redis_errors.ReadOnlyError,
    redis_errors.ClusterError,
    redis_errors.TryAgainError,
    redis_errors.MasterDownError,
)


@contextmanager
def _store_errors(action: str) -> Iterator[None]:
    """Convert redis-py exceptions into our tree at the boundary."""
    try:
        yield
    except _TRANSIENT as exc:
        raise StoreUnavailable(
            f"{action}: Redis unavailable ({type(exc).__name__}: {exc})"
        ) from exc
    except redis_errors.RedisError as exc:
        # Anything else (OOM, WRONGTYPE, ...) is an operator's problem, not the request's:
        # report it as unavailable so the request is retried and, failing that, kept.
        raise StoreUnavailable(f"{action}: Redis error ({type(exc).__name__}: {exc})") from exc


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore(CheckpointStore):
    """Checkpoints in Redis, readable and writable by the Go ``RedisStore`` too."""

    ref_scheme = "session"

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        options: StoreOptions | None = None,
        clock: Clock = time.time,
        url: str | None = None,
    ) -> None:
        """Wrap ``client`` (a ``redis.Redis`` built with ``decode_responses=False``)."""
        super().__init__(options, clock)
        self.client = client
        self.keys = KeySpace(prefix)
        self.scripts = Scripts.register(client)
        self._display_url = redact_url(url) if url else "<client>"

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        options: StoreOptions | None = None,
        clock: Clock = time.time,
        socket_timeout: float = 5.0,
        **client_kwargs: Any,
    ) -> RedisStore:
        """Connect lazily to ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs.

        Credentials in the URL are used but never shown: ``repr`` and errors carry a
        redacted form.
        """
        client = redis.Redis.from_url(
            url,
            decode_responses=False,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            health_check_interval=30,
            **client_kwargs,
        )
        return cls(client, prefix=prefix, options=options, clock=clock, url=url)

    def __repr__(self) -> str:
        return f"RedisStore({self._display_url}, prefix={self.keys.prefix!r})"

    # -- writes -------------------------------------------------------------------------

    def save(self, checkpoint: Checkpoint, seq: int | None = None) -> SaveResult:
        seq = self.resolve_seq(seq)
        session_id = checkpoint.session_id
        encoded = self.encode(checkpoint)
        opts = self.options
        ttl_ms = _ms(opts.ttl_seconds)
        deadline = _ms(self.clock()) + ttl_ms
        with _store_errors(f"save {session_id!r}"):
            applied = self.scripts.save(
                keys=self.keys.session(session_id).as_list(),
                args=[
                    seq,
                    encoded.value,
                    ttl_ms,
                    deadline,
                    ttl_ms + _ms(opts.tombstone_ttl_seconds),
                    session_id,
                ],
            )
        ref = self.ref(session_id, checkpoint.version)
        if not applied:
            return SaveResult(ref, False, session_id, checkpoint.version, seq)
        return SaveResult(
            ref, True, session_id, checkpoint.version, seq, encoded.trimmed, len(encoded.value)
        )

    def delete(self, session_id: str, seq: int | None = None) -> bool:
        self.check_session_id(session_id)
        seq = self.resolve_seq(seq)
        with _store_errors(f"delete {session_id!r}"):
            applied = self.scripts.delete(
                keys=self.keys.session(session_id).as_list(),
                args=[seq, _ms(self.options.tombstone_ttl_seconds), session_id],
            )
        return bool(applied)

    def refresh(self, session_id: str) -> bool:
        self.check_session_id(session_id)
        opts = self.options
        ttl_ms = _ms(opts.ttl_seconds)
        with _store_errors(f"refresh {session_id!r}"):
            refreshed = self.scripts.refresh(
                keys=self.keys.session(session_id).as_list(),
                args=[
                    ttl_ms,
                    _ms(self.clock()) + ttl_ms,
                    ttl_ms + _ms(opts.tombstone_ttl_seconds),
                    session_id,
                ],
            )
        return bool(refreshed)

    # -- reads --------------------------------------------------------------------------

    def load(self, session_id: str) -> Checkpoint | None:
        self.check_session_id(session_id)
        with _store_errors(f"load {session_id!r}"):
            stored = self.client.get(self.keys.data(session_id))
        if stored is None:
            return None
        try:
            return deserialize_checkpoint(self.codec.decode(stored))
        except (CodecError, InvalidCheckpoint) as exc:
            raise CorruptCheckpoint(session_id, str(exc)) from None

    def fence(self, session_id: str) -> Fence | None:
        self.check_session_id(session_id)
        with _store_errors(f"read fence of {session_id!r}"):
            seq, deleted = self.client.hmget(self.keys.fence(session_id), "seq", "deleted")
        if seq is None:
            return None
        return Fence(int(seq), deleted == b"1")

    def list_page(self, cursor: str | None = None, count: int = 1000) -> Page:
        now_ms = _ms(self.clock())
        with _store_errors("list sessions"):
            next_cursor, entries = self.client.zscan(
                self.keys.index(), cursor=int(cursor or 0), count=count
            )
        ids = [member.decode() for member, score in entries if score > now_ms]
        return Page(ids, str(next_cursor) if int(next_cursor) else None)

    # -- expiry -------------------------------------------------------------------------

    def expire_stale(self, now: float | None = None, limit: int = 1000) -> list[str]:
        now_ms = _ms(self.clock() if now is None else now)
        index = self.keys.index()
        with _store_errors("list stale sessions"):
            candidates = self.client.zrange(
                index, "-inf", now_ms, byscore=True, offset=0, num=limit
            )
        expired: list[str] = []
        for start in range(0, len(candidates), SWEEP_BATCH):
            batch = [member.decode() for member in candidates[start : start + SWEEP_BATCH]]
            with _store_errors("expire stale sessions"):
                pipe = self.client.pipeline(transaction=False)
                for session_id in batch:
                    self.scripts.expire(
                        keys=self.keys.session(session_id).as_list(),
                        args=[now_ms, session_id],
                        client=pipe,
                    )
                results = pipe.execute()
            expired.extend(sid for sid, done in zip(batch, results, strict=True) if done)
        return expired

    # -- maintenance --------------------------------------------------------------------

    def reindex(self, batch: int = 1000) -> int:
        """Index sessions written by the Go store directly (it keeps no index); return count.

        A one-off SCAN of ``<prefix>:*`` for deployments that switch from Go writers: it is
        the only place checkpointq scans the keyspace.
        """
        added = 0
        now_ms = _ms(self.clock())
        with _store_errors("reindex"):
            for keys in _chunks(
                self.client.scan_iter(self.keys.data_pattern(), count=batch), batch
            ):
                pipe = self.client.pipeline(transaction=False)
                for key in keys:
                    pipe.pttl(key)
                ttls = pipe.execute()
                pipe = self.client.pipeline(transaction=False)
                for key, ttl in zip(keys, ttls, strict=True):
                    if ttl is not None and ttl > 0:
                        session_id = self.keys.session_id_from_data_key(key.decode())
                        pipe.zadd(self.keys.index(), {session_id: now_ms + ttl}, nx=True)
                added += sum(pipe.execute())
        return added

    def ping(self) -> None:
        """Raise StoreUnavailable unless Redis answers."""
        with _store_errors("ping"):
            self.client.ping()

    def close(self) -> None:
        self.client.close()


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
