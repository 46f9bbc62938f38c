"""The Redis store: Go-compatible values, fenced atomic writes, an index instead of SCAN.

Each write (fence check, value, TTL, fence metadata, index entry) is one Lua script call,
so a crash can never leave a value without its TTL or an index entry without its value.
Listing and expiry read a sorted set of deadlines, so their cost follows what they return,
not the size of the keyspace.

On Redis Cluster (see ``store/cluster.py`` for the URLs) the same scripts run unchanged: the
``ClusterKeySpace`` puts each session's keys and its shard of the deadline index in one slot,
and listing and sweeping walk the shards in turn (see ``checkpointq.store.keys``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import redis
from redis import exceptions as redis_errors
from redis.cluster import RedisCluster

from checkpointq.store.base import (
    BatchOp,
    BatchResult,
    CheckpointStore,
    Clock,
    EncodedCheckpoint,
    Fence,
    Page,
    Refusal,
    SaveOp,
    SaveResult,
    StoreOptions,
)
from checkpointq.store.cluster import cluster_client_from_url, is_cluster_url
from checkpointq.store.codec import CodecError
from checkpointq.store.errors import (
    CorruptCheckpoint,
    InvalidCheckpoint,
    InvalidInput,
    StoreNotConfigured,
    StoreUnavailable,
)
from checkpointq.store.keys import DEFAULT_PREFIX, DEFAULT_SHARDS, ClusterKeySpace, KeySpace
from checkpointq.store.model import Checkpoint
from checkpointq.store.reconcile import Reconciler, ReconcileReport
from checkpointq.store.scripts import Scripts, queue
from checkpointq.store.serde import deserialize_checkpoint
from checkpointq.store.urls import redact_url, redis_py_url

logger = logging.getLogger(__name__)

#: Sessions expired per pipelined round trip in a sweep: large enough to amortise the round
#: trip, small enough that one pipeline never holds Redis for more than a millisecond or so.
SWEEP_BATCH = 500

#: Index shards read per pipelined round trip when listing or sweeping a cluster layout.
SHARD_BATCH = 128


class StoreSettings(Protocol):
    """What ``RedisStore.from_settings`` reads (``checkpointq.worker.settings.Settings``)."""

    key_prefix: str
    store_shards: int

    @property
    def resolved_store_url(self) -> str | None: ...

    def store_options(self) -> StoreOptions: ...


# Errors that say "try again later" rather than "this request is wrong".
_TRANSIENT = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    redis_errors.ReadOnlyError,
    redis_errors.ClusterError,
    redis_errors.TryAgainError,
    redis_errors.MasterDownError,
    # Not a RedisError: raised while the client relearns the slot map (a failover, or no
    # node answering yet), e.g. SlotNotCoveredError.
    redis_errors.RedisClusterException,
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


#: The fence hash fields the store reads, in the order ``RedisStore._fence`` takes them.
_FENCE_FIELDS = ("seq", "deleted", "req", "deadline")


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
        keys: KeySpace | None = None,
    ) -> None:
        """Wrap ``client``, a ``redis.Redis`` or ``redis.cluster.RedisCluster`` built with
        ``decode_responses=False``.

        ``keys`` overrides the layout implied by ``prefix``: by default the Go layout on a
        single Redis and ``ClusterKeySpace(prefix)`` on a cluster client.

        Raises:
            ValueError: a cluster client with a single-Redis layout (its scripts would span
                slots).
        """
        super().__init__(options, clock)
        cluster = isinstance(client, RedisCluster)
        if keys is None:
            keys = ClusterKeySpace(prefix) if cluster else KeySpace(prefix)
        elif cluster and not isinstance(keys, ClusterKeySpace):
            raise ValueError("a Redis Cluster client needs a ClusterKeySpace layout")
        self.client = client
        self.keys = keys
        self.scripts = Scripts.register(client)
        self._display_url = redact_url(url) if url else "<client>"
        # Where the next sweep starts, so that a backlog in early shards cannot starve the rest.
        self._sweep_from = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        options: StoreOptions | None = None,
        clock: Clock = time.time,
        socket_timeout: float = 5.0,
        shards: int = DEFAULT_SHARDS,
        **client_kwargs: Any,
    ) -> RedisStore:
        """Connect lazily to ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs (kombu's
        ``redis+socket://`` spelling too), or to a Redis Cluster given as
        ``redis+cluster://host:port[,host:port...]`` or with ``?cluster=true`` (see
        ``checkpointq.store.cluster``; ``shards`` applies to clusters only).

        Credentials in the URL are used but never shown: ``repr`` and errors carry a
        redacted form.

        Raises:
            StoreUnavailable: a cluster URL whose seeds do not answer (a cluster client
                connects at once to learn the slot map).
        """
        common: dict[str, Any] = {
            "decode_responses": False,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "health_check_interval": 30,
            **client_kwargs,
        }
        if is_cluster_url(url):
            with _store_errors(f"connect to {redact_url(url)}"):
                cluster = cluster_client_from_url(url, **common)
            keys = ClusterKeySpace(prefix, shards)
            return cls(cluster, options=options, clock=clock, url=url, keys=keys)
        client = redis.Redis.from_url(redis_py_url(url), **common)
        return cls(client, prefix=prefix, options=options, clock=clock, url=url)

    @classmethod
    def from_settings(cls, settings: StoreSettings, *, socket_timeout: float = 5.0) -> RedisStore:
        """The store a deployment's settings describe: its URL, prefix, options and shards.

        The one factory from settings to a store (worker, producer client and CLI use it).

        Raises:
            StoreNotConfigured: the settings name no store URL.
            StoreUnavailable: a cluster URL whose seeds do not answer.
        """
        url = settings.resolved_store_url
        if not url:
            raise StoreNotConfigured(
                "no store URL: set CHECKPOINTQ_STORE_URL, or a Redis CHECKPOINTQ_BROKER_URL"
            )
        return cls.from_url(
            url,
            prefix=settings.key_prefix,
            options=settings.store_options(),
            socket_timeout=socket_timeout,
            shards=settings.store_shards,
        )

    def __repr__(self) -> str:
        shards = f", shards={self.keys.shards}" if isinstance(self.keys, ClusterKeySpace) else ""
        return f"RedisStore({self._display_url}, prefix={self.keys.prefix!r}{shards})"

    # -- writes -------------------------------------------------------------------------

    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
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
                    request_id,
                ],
            )
        ref = self.ref(session_id, checkpoint.version)
        if not applied:
            return SaveResult(ref, False, session_id, checkpoint.version, seq)
        return SaveResult(
            ref, True, session_id, checkpoint.version, seq, encoded.trimmed, len(encoded.value)
        )

    def delete(self, session_id: str, seq: int | None = None, request_id: str = "") -> bool:
        self.check_session_id(session_id)
        seq = self.resolve_seq(seq)
        with _store_errors(f"delete {session_id!r}"):
            applied = self.scripts.delete(
                keys=self.keys.session(session_id).as_list(),
                args=[seq, _ms(self.options.tombstone_ttl_seconds), session_id, request_id],
            )
        return bool(applied)

    def apply_batch(self, ops: Sequence[BatchOp]) -> list[BatchResult]:
        """Apply the batch in one pipelined round trip: one save or delete script per item,
        in order (Redis runs them one by one, so each is as atomic and fenced as alone).

        Items are validated and encoded first; one the store refuses gets its
        ``InvalidInput`` as its result and is not sent.
        """
        results: list[BatchResult | None] = []
        finish: list[Callable[[Any], BatchResult]] = []
        opts = self.options
        ttl_ms = _ms(opts.ttl_seconds)
        fence_ttl_ms = ttl_ms + _ms(opts.tombstone_ttl_seconds)
        tombstone_ms = _ms(opts.tombstone_ttl_seconds)
        deadline = _ms(self.clock()) + ttl_ms
        pipe = self.client.pipeline(transaction=False)
        for op in ops:
            try:
                if isinstance(op, SaveOp):
                    seq = self.resolve_seq(op.seq)
                    cp = op.checkpoint
                    encoded = self.encode(cp)
                    keys = self.keys.session(cp.session_id).as_list()
                    args = [
                        *(seq, encoded.value, ttl_ms, deadline, fence_ttl_ms, cp.session_id),
                        op.request_id,
                    ]
                    queue(self.scripts.save, pipe, keys, args)
                    finish.append(
                        _save_result(self.ref(cp.session_id, cp.version), cp, seq, encoded)
                    )
                else:
                    self.check_session_id(op.session_id)
                    seq = self.resolve_seq(op.seq)
                    keys = self.keys.session(op.session_id).as_list()
                    args = [seq, tombstone_ms, op.session_id, op.request_id]
                    queue(self.scripts.delete, pipe, keys, args)
                    finish.append(bool)
                results.append(None)
            except InvalidInput as exc:
                results.append(exc)
        if finish:
            with _store_errors(f"apply a batch of {len(finish)}"):
                replies = iter(pipe.execute())
        else:
            replies = iter(())
        finishers = iter(finish)
        return [
            result if result is not None else next(finishers)(next(replies)) for result in results
        ]

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
        return None if stored is None else self._decode(session_id, stored)

    def _decode(self, session_id: str, stored: bytes) -> Checkpoint:
        try:
            return deserialize_checkpoint(self.codec.decode(stored))
        except (CodecError, InvalidCheckpoint) as exc:
            raise CorruptCheckpoint(session_id, str(exc)) from None

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """One script call (load.lua): the value and the fence, read atomically."""
        self.check_session_id(session_id)
        keys = self.keys.session(session_id)
        with _store_errors(f"load {session_id!r}"):
            stored, *fence = self.scripts.load(keys=[keys.data, keys.fence], args=[])
        checkpoint = None if stored is None else self._decode(session_id, stored)
        return checkpoint, self._fence(*fence)

    def fence(self, session_id: str) -> Fence | None:
        self.check_session_id(session_id)
        with _store_errors(f"read fence of {session_id!r}"):
            reply = self.client.hmget(self.keys.fence(session_id), *_FENCE_FIELDS)
        return self._fence(*reply)

    def request_outcome(
        self, session_id: str, request_id: str
    ) -> tuple[Fence | None, Refusal | None]:
        """The fence and the request's refusal record, in one pipelined round trip (two
        keys of different slots on a cluster, hence no script)."""
        self.check_session_id(session_id)
        with _store_errors(f"read outcome of {request_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(self.keys.fence(session_id), *_FENCE_FIELDS)
            pipe.hmget(self.keys.refused(request_id), "kind", "reason", "entry")
            fence, (kind, reason, entry) = pipe.execute()
        refusal = None if kind is None else Refusal(_text(kind), _text(reason), _text(entry))
        return self._fence(*fence), refusal

    def _fence(
        self,
        seq: bytes | None,
        deleted: bytes | None,
        request_id: bytes | None,
        deadline: bytes | None = None,
    ) -> Fence | None:
        """A fence from its hash fields (``_FENCE_FIELDS``, as HMGET or load.lua return
        them). The sweep and reconciliation remove ``deadline`` once the value is gone."""
        if seq is None:
            return None
        live = deadline is not None and float(deadline) > _ms(self.clock())
        return Fence(int(seq), deleted == b"1", _text(request_id), live and deleted != b"1")

    def list_page(self, cursor: str | None = None, count: int = 1000) -> Page:
        """One page of live ids; the cursor is ZSCAN's on a single Redis and
        ``"<shard>:<zscan cursor>"`` on a cluster layout, which walks the shards in order."""
        now_ms = _ms(self.clock())
        shard, inner = self._parse_cursor(cursor)
        indexes = self.keys.index_keys()
        ids: list[str] = []
        while shard < len(indexes):
            # The first shard resumes at its cursor; the rest of the batch start afresh.
            batch = indexes[shard : shard + min(SHARD_BATCH, max(1, count))]
            with _store_errors("list sessions"):
                pipe = self.client.pipeline(transaction=False)
                for position, index in enumerate(batch):
                    pipe.zscan(index, cursor=inner if position == 0 else 0, count=count)
                replies = pipe.execute()
            for next_cursor, entries in replies:
                ids.extend(member.decode() for member, score in entries if score > now_ms)
                if int(next_cursor):
                    # This shard has more: resume it next time, drop the later replies.
                    return Page(ids, self._format_cursor(shard, int(next_cursor)))
                shard, inner = shard + 1, 0
                if len(ids) >= count:
                    break
            if len(ids) >= count:
                break
        more = shard < len(indexes)
        return Page(ids, self._format_cursor(shard, 0) if more else None)

    def _parse_cursor(self, cursor: str | None) -> tuple[int, int]:
        if not cursor:
            return 0, 0
        shard, _, inner = cursor.rpartition(":")
        try:
            parsed = (int(shard) if shard else 0, int(inner))
        except ValueError:
            raise InvalidInput(f"not a cursor this store returned: {cursor!r}") from None
        if not 0 <= parsed[0] < self.keys.shards or parsed[1] < 0:
            raise InvalidInput(f"not a cursor this store returned: {cursor!r}")
        return parsed

    def _format_cursor(self, shard: int, inner: int) -> str:
        # A single Redis keeps plain ZSCAN cursors, as before sharding existed.
        return str(inner) if self.keys.shards == 1 else f"{shard}:{inner}"

    # -- expiry -------------------------------------------------------------------------

    def expire_stale(self, now: float | None = None, limit: int = 1000) -> list[str]:
        """Expire up to ``limit`` due sessions: per index shard, ZRANGE BYSCORE for the due
        ids, then one pipelined expire script per id (each touches one slot only).

        On a cluster layout each call starts at the shard where the last one stopped, so a
        backlog in some shards delays the others by at most one sweep.
        """
        now_ms = _ms(self.clock() if now is None else now)
        indexes = self.keys.index_keys()
        start = self._sweep_from % len(indexes)
        order = indexes[start:] + indexes[:start]
        expired: list[str] = []
        remaining = limit
        for offset in range(0, len(order), SHARD_BATCH):
            batch = order[offset : offset + SHARD_BATCH]
            with _store_errors("list stale sessions"):
                pipe = self.client.pipeline(transaction=False)
                for index in batch:
                    pipe.zrange(index, "-inf", now_ms, byscore=True, offset=0, num=remaining)
                replies = pipe.execute()
            candidates: list[str] = []
            for position, members in enumerate(replies):
                candidates.extend(member.decode() for member in members[:remaining])
                remaining = limit - len(expired) - len(candidates)
                if remaining <= 0:
                    # Resume here next time: this shard may hold more due sessions.
                    self._sweep_from = start + offset + position
                    break
            expired.extend(self._expire(candidates, now_ms))
            if remaining <= 0:
                break
        return expired

    def _expire(self, candidates: list[str], now_ms: int) -> list[str]:
        expired: list[str] = []
        for start in range(0, len(candidates), SWEEP_BATCH):
            batch = candidates[start : start + SWEEP_BATCH]
            with _store_errors("expire stale sessions"):
                pipe = self.client.pipeline(transaction=False)
                for session_id in batch:
                    queue(
                        self.scripts.expire,
                        pipe,
                        self.keys.session(session_id).as_list(),
                        [now_ms, session_id],
                    )
                results = pipe.execute()
            expired.extend(sid for sid, done in zip(batch, results, strict=True) if done)
        return expired

    # -- maintenance --------------------------------------------------------------------

    def reconcile(self, budget: int = 10_000) -> ReconcileReport:
        """One slice of the continuous reconciliation (``store/reconcile.py``): about
        ``budget`` keys and index entries looked at, from where the last slice stopped.

        Adopts values that other writers (a Go ``RedisStore``) saved without our index,
        moves deadlines to the values' own, and drops the entries of values deleted
        directly. The beat runs it every ``CHECKPOINTQ_RECONCILE_INTERVAL_SECONDS``.
        """
        with _store_errors("reconcile"):
            return Reconciler(self).step(budget)

    def reindex(self) -> int:
        """The reconciliation pass run to completion, from the start; return how many
        sessions written by another store alone (Go's ``RedisStore``) it adopted."""
        with _store_errors("reindex"):
            return len(Reconciler(self).run_pass().adopted)

    def ping(self) -> None:
        """Raise StoreUnavailable unless Redis answers."""
        with _store_errors("ping"):
            self.client.ping()

    def close(self) -> None:
        self.client.close()


def _save_result(
    ref: str, cp: Checkpoint, seq: int, encoded: EncodedCheckpoint
) -> Callable[[Any], SaveResult]:
    """Turn save.lua's reply into the ``SaveResult`` that ``save`` would have returned."""

    def finish(applied: Any) -> SaveResult:
        if not applied:
            return SaveResult(ref, False, cp.session_id, cp.version, seq)
        return SaveResult(
            ref, True, cp.session_id, cp.version, seq, encoded.trimmed, len(encoded.value)
        )

    return finish


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")
