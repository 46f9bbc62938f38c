"""The Redis store: Go-compatible values, fenced atomic writes, an index instead of SCAN.

Each write (fence check, value, TTL, fence metadata, index entry) is one Lua script call,
so a crash can never leave a value without its TTL or an index entry without its value.
Listing and expiry read a sorted set of deadlines, so their cost follows what they return,
not the size of the keyspace.

On Redis Cluster (see ``store/cluster.py`` for the URLs) the same scripts run unchanged: the
data key is Go's ``<prefix>:<id>`` there too, and the ``ClusterKeySpace`` puts the session's
fence and entry in the deadline index of that key's own slot (see ``checkpointq.store.keys``).
Listing walks the 16384 slot indexes in order; a sweep reads only the slot indexes that a
small hint names as possibly due (one call when none is), and every slot's in a periodic full
pass (see ``_due_on_cluster``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol

import redis
import redis.asyncio
from redis import exceptions as redis_errors
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from checkpointq.store import probe, redis_hooks
from checkpointq.store.base import (
    BatchOp,
    BatchResult,
    CheckpointStore,
    Clock,
    Fence,
    LapseOp,
    Page,
    Refusal,
    SaveOp,
    SaveResult,
    SessionCounts,
    StoreOptions,
    new_identity,
    validate_seq,
)
from checkpointq.store.cluster import cluster_client_from_url
from checkpointq.store.errors import (
    InvalidInput,
    StoreNotConfigured,
    StoreUnavailable,
)
from checkpointq.store.keys import DEFAULT_PREFIX, ClusterKeySpace, KeySpace, ShardedKeySpace
from checkpointq.store.model import Checkpoint
from checkpointq.store.reconcile import Reconciler, ReconcileReport
from checkpointq.store.scripts import Scripts, queue
from checkpointq.store.urls import is_cluster_url, redact_url, redis_py_url

logger = logging.getLogger(__name__)

#: Sessions expired per pipelined round trip in a sweep: large enough to amortise the round
#: trip, small enough that one pipeline never holds Redis for more than a millisecond or so.
SWEEP_BATCH = 500

#: Slot indexes one ``due.lua``, ``page.lua`` or ``count.lua`` call reads on a cluster node:
#: ~0.3 ms of the node's time when none holds a due session (~1.5 ms on a loaded 2-core
#: machine), so no call holds a node for long.
INDEXES_PER_CALL = 256

#: The sweep hint's member whose score is when the next full pass is due.
HINT_FULL = "full"

#: Most slots one sweep reads on the hint's word; when more are due, it reads them all in
#: a full pass instead, so that no hint read returns more than a few thousand members.
HINTED_SLOTS_PER_SWEEP = 4096

#: Stored values at least this large (bytes, compressed) reach ``save.lua`` through a staging
#: key rather than as an argument (see ``RedisStore._save_direct``): from ~20 KB stored (a
#: 50 KB checkpoint) up, that takes more off Redis's time than the extra command adds.
STAGE_FROM_BYTES = 16 * 1024

#: How long a staged value may wait for its script: the two go in one write, so it only
#: matters when the client dies between them (the staging key then expires on its own).
STAGING_TTL_MS = 30_000

#: How far behind another writer's clock may be and its deadlines still be found by the
#: sweep hint rather than by the next full pass (at most half the TTL).
HINT_SKEW_MS = 60_000


class StoreSettings(Protocol):
    """What ``RedisStore.from_settings`` reads (``checkpointq.worker.settings.Settings``)."""

    key_prefix: str

    @property
    def resolved_store_url(self) -> str | None: ...

    def store_options(self) -> StoreOptions: ...


#: One script call on a cluster node: the node, the call's KEYS and its ARGV.
_NodeCall = tuple[Any, list[str], list[Any]]

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


def layout(url: str, prefix: str = DEFAULT_PREFIX) -> KeySpace:
    """The key layout of the store at ``url``: Go's on a single Redis; Go's data keys with
    per-slot bookkeeping on a cluster. Tools that read the store's keys without a store
    (``checkpointq.worker.connections.key_space``) take it from here."""
    return ClusterKeySpace(prefix) if is_cluster_url(url) else KeySpace(prefix)


class RedisStore(CheckpointStore):
    """Checkpoints in Redis, readable and writable by the Go ``RedisStore`` too."""

    ref_scheme = "session"
    keeps_refusals = True

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
        self._cluster = cluster
        self.scripts = Scripts.register(client)
        #: Stored values from this size (bytes) are staged (``_save_direct``); batches stage
        #: on a cluster too, single saves only on a single Redis (there they would need
        #: redis-py's pipeline, which on a single Redis cost more client CPU than staging
        #: saved up to 100 KB checkpoints, ~40 KB stored).
        self.stage_from_bytes = STAGE_FROM_BYTES
        self._display_url = redact_url(url) if url else "<client>"
        self._url = url
        # Where the next sweep starts, so that a backlog in early slots cannot starve the rest.
        self._sweep_from = 0
        # Cluster sweeps, pages and counts: the slot indexes grouped by the node serving
        # them, the slot map they were grouped by (the client replaces it when it relearns
        # the topology), and for each slot its run and the run's first slot.
        self._node_chunks: list[tuple[Any, list[str]]] = []
        self._chunked_by: object = None
        self._chunk_of_slot: list[int] = []
        self._chunk_of_slot_start: list[int] = []
        self._chunk_starts: list[int] = []
        self._relearn_slots = False

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
        """Connect lazily to ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs (kombu's
        ``redis+socket://`` spelling too), or to a Redis Cluster given as
        ``redis+cluster://host:port[,host:port...]`` or with ``?cluster=true`` (see
        ``checkpointq.store.cluster``).

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
            return cls(cluster, options=options, clock=clock, url=url, keys=layout(url, prefix))
        client = redis.Redis.from_url(redis_py_url(url), **common)
        return cls(client, options=options, clock=clock, url=url, keys=layout(url, prefix))

    @classmethod
    def from_settings(cls, settings: StoreSettings, *, socket_timeout: float = 5.0) -> RedisStore:
        """The store a deployment's settings describe: its URL, prefix and options.

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
        )

    def asyncio_client(self) -> redis.asyncio.Redis | None:
        """A ``redis.asyncio`` client to this store's Redis, with its socket timeouts (the
        asyncio producer reads through it); None for a cluster or a store made from a client
        rather than a URL."""
        if self._url is None or self._cluster:
            return None
        kwargs = self.client.connection_pool.connection_kwargs
        return redis.asyncio.Redis.from_url(
            redis_py_url(self._url),
            decode_responses=False,
            socket_timeout=kwargs.get("socket_timeout"),
            socket_connect_timeout=kwargs.get("socket_connect_timeout"),
            health_check_interval=30,
        )

    def __repr__(self) -> str:
        cluster = ", cluster" if isinstance(self.keys, ClusterKeySpace) else ""
        return f"RedisStore({self._display_url}, prefix={self.keys.prefix!r}{cluster})"

    # -- writes -------------------------------------------------------------------------

    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
        seq = self.resolve_seq(seq)
        session_id = checkpoint.session_id
        if self.lapsed(seq, _ms(self.clock())):
            self.lapse(session_id, seq, request_id)
            return SaveResult.lapse(self.ref(session_id, checkpoint.version), checkpoint, seq)
        encoded = self.encode(checkpoint)
        with _store_errors(f"save {session_id!r}"):
            if self._cluster:
                keys, args = self._save_call(session_id, encoded.value, seq, request_id)
                applied = self.scripts.save(keys=keys, args=args)
            else:
                applied = self._save_direct(session_id, encoded.value, seq, request_id)
        ref = self.ref(session_id, checkpoint.version)
        return SaveResult.of(ref, checkpoint, seq, encoded, bool(applied))

    # A staged save sends the value to a staging key of its own (``KeySpace.staging``: random
    # per call, in the session's slot, under the bookkeeping prefix) and then runs save.lua
    # with the staging key instead of the value; the script renames it onto the data key
    # when the save applies and deletes it when stale. Redis then never copies the value into
    # Lua and back out (the script cost 30 us of Redis's CPU per call at 9 KB stored and 171
    # us at 80 KB, against ~1 us for a SET of the same bytes).
    #
    # The SET and the script are pipelined without MULTI, which is safe whatever runs in
    # between: nobody else knows the staging key (it is random, names no session, and is in
    # no index or scanned pattern), so another client can neither read nor change it, and
    # every decision (fence, tombstone, index) is taken inside the one script call, as for
    # an unstaged save. What can happen between the two commands:
    # - the SET is refused (OOM under maxmemory + noeviction, a replica gone read-only): the
    #   script finds no staging key and fails, or (stale) returns 0 without applying, and
    #   the SET's error is raised: StoreUnavailable, as when the script itself was refused;
    # - the client dies after the SET: the staging key expires after STAGING_TTL_MS;
    # - the staging key expired before the script ran (Redis stalled that long): the script
    #   fails without applying and the save is retried;
    # - the script is stale: it deletes the staging key; or the script fails (NOSCRIPT,
    #   WRONGTYPE): the staging key expires on its own.
    # A save whose reply was lost may be retried; the fence makes the retry a duplicate of
    # the winner (applied again, same value) or stale, exactly as for an unstaged save.
    # Readers see the same key, bytes and TTL either way; only keyspace notifications
    # differ (``rename_to`` on the data key instead of ``set``).

    def _save_direct(self, session_id: str, value: bytes, seq: int, request_id: str) -> int:
        """One save on a single Redis, in one round trip; save.lua's reply (1 or 0).

        Values from ``stage_from_bytes`` are staged (the staging ``SET``, then the script).
        The commands go down a pooled connection directly (``_send_batch``), with the
        client's retry policy as its own commands have: redis-py's command path cost 20-30
        us of client CPU more per save (20 KB, interleaved A/B), its pipeline ~40 us more.
        """
        commands: list[tuple[Any, ...]] = []
        staged: set[int] = set()
        if len(value) >= self.stage_from_bytes:
            staging = self._staging_key(session_id)
            commands.append(("SET", staging, value, "PX", STAGING_TTL_MS))
            staged.add(0)
            keys, args = self._save_call(session_id, b"", seq, request_id, staging=staging)
        else:
            keys, args = self._save_call(session_id, value, seq, request_id)
        commands.append(("EVALSHA", self.scripts.save.sha, len(keys), *keys, *args))
        # A batch of one: ``_send_batch`` reloads a flushed script cache and sends the call
        # again (a staged value to the same staging key, so nothing is left behind).
        return int(self._send_batch(commands, staged)[-1])

    def _staging_key(self, session_id: str) -> str:
        return self.keys.staging(session_id, os.urandom(12).hex())

    def _save_call(
        self,
        session_id: str,
        value: bytes,
        seq: int,
        request_id: str,
        now_ms: int | None = None,
        ttl_ms: int | None = None,
        staging: str | None = None,
    ) -> tuple[list[str], list[Any]]:
        """``save.lua``'s KEYS and ARGV (see its header): the one place they are built.

        ``now_ms`` defaults to the store's clock. The value lives until the save's deadline
        (``value_deadline_ms``: seq + TTL for a time seq), or ``ttl_ms`` from now when given
        (a migration keeping a value's remaining life); its fence the tombstone margin
        longer. With ``staging`` (a staged save) the value is not sent: the script takes it
        from there.
        """
        now_ms = _ms(self.clock()) if now_ms is None else now_ms
        if ttl_ms is None:
            ttl_ms = max(1, self.value_deadline_ms(seq, now_ms) - now_ms)
        fence_ttl_ms = ttl_ms + self.tombstone_ms
        keys = self.keys.session(session_id).as_list()
        if staging is not None:
            keys.append(staging)
            value = b""
        args = [seq, value, ttl_ms, now_ms + ttl_ms, fence_ttl_ms, session_id, request_id]
        return keys, args

    def _delete_call(
        self, session_id: str, seq: int, request_id: str, now_ms: int, *, lapse: bool = False
    ) -> tuple[Script, list[str], list[Any]]:
        """``delete.lua``'s script, KEYS and ARGV, for a delete or (``lapse``) a lapsed save:
        the fence outlives every request ordered before it (``tombstone_expiry_ms``)."""
        fence_ttl_ms = max(1, self.tombstone_expiry_ms(seq, now_ms) - now_ms)
        keys = self.keys.session(session_id).as_list()
        args = [seq, fence_ttl_ms, session_id, request_id, "2" if lapse else "1"]
        return self.scripts.delete, keys, args

    def delete(self, session_id: str, seq: int | None = None, request_id: str = "") -> bool:
        self.check_session_id(session_id)
        seq = self.resolve_seq(seq)
        script, keys, args = self._delete_call(session_id, seq, request_id, _ms(self.clock()))
        with _store_errors(f"delete {session_id!r}"):
            applied = script(keys=keys, args=args)
        return bool(applied)

    def lapse(self, session_id: str, seq: int, request_id: str = "") -> bool:
        self.check_session_id(session_id)
        seq = validate_seq(seq)
        script, keys, args = self._delete_call(
            session_id, seq, request_id, _ms(self.clock()), lapse=True
        )
        with _store_errors(f"lapse {session_id!r}"):
            took = script(keys=keys, args=args)
        return bool(took)

    def apply_batch(self, ops: Sequence[BatchOp]) -> list[BatchResult]:
        """Apply the batch in one pipelined round trip: one save or delete script per item,
        in order (Redis runs them one by one, so each is as atomic and fenced as alone).

        Items are validated and encoded first; one the store refuses gets its
        ``InvalidInput`` as its result and is not sent. Large values are staged (see
        ``_save_direct``): their staging ``SET`` goes just before their script. On a single
        Redis the commands go down a pooled connection directly (``_send_batch``); on a
        cluster, through the cluster client's pipeline, which routes them by slot.
        """
        results: list[BatchResult | None] = []
        finish: list[Callable[[Any], BatchResult]] = []
        now_ms = _ms(self.clock())
        pipe = self.client.pipeline(transaction=False) if self._cluster else None
        commands: list[tuple[Any, ...]] = []  # single Redis: what _send_batch sends
        # Positions of the staging SETs' replies among all replies, dropped from them.
        staged: set[int] = set()
        sent = 0

        def call(script: Script, keys: list[str], args: list[Any]) -> None:
            if pipe is None:
                commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
            else:
                queue(script, pipe, keys, args)

        for op in ops:
            try:
                if isinstance(op, SaveOp) and not self.lapsed(self.resolve_seq(op.seq), now_ms):
                    seq = self.resolve_seq(op.seq)
                    cp = op.checkpoint
                    encoded = self.encode_op(op)
                    staging = None
                    if len(encoded.value) >= self.stage_from_bytes:
                        staging = self._staging_key(cp.session_id)
                        if pipe is None:
                            commands.append(("SET", staging, encoded.value, "PX", STAGING_TTL_MS))
                        else:
                            pipe.set(staging, encoded.value, px=STAGING_TTL_MS)
                        staged.add(sent)
                        sent += 1
                    keys, args = self._save_call(
                        cp.session_id, encoded.value, seq, op.request_id, now_ms, staging=staging
                    )
                    call(self.scripts.save, keys, args)
                    sent += 1
                    ref = self.ref(cp.session_id, cp.version)
                    # save.lua's reply (1 or 0) becomes the result's ``applied``.
                    finish.append(partial(SaveResult.of, ref, cp, seq, encoded))
                elif isinstance(op, SaveOp):  # lapsed: past its deadline, never stored
                    cp, seq = op.checkpoint, self.resolve_seq(op.seq)
                    call(*self._delete_call(cp.session_id, seq, op.request_id, now_ms, lapse=True))
                    sent += 1
                    finish.append(partial(_lapsed, self.ref(cp.session_id, cp.version), cp, seq))
                else:
                    self.check_session_id(op.session_id)
                    seq = self.resolve_seq(op.seq)
                    lapse = isinstance(op, LapseOp)
                    call(*self._delete_call(op.session_id, seq, op.request_id, now_ms, lapse=lapse))
                    sent += 1
                    finish.append(bool)
                results.append(None)
            except InvalidInput as exc:
                results.append(exc)
        if finish:
            with _store_errors(f"apply a batch of {len(finish)}"):
                every = pipe.execute() if pipe is not None else self._send_batch(commands, staged)
                replies = iter([reply for i, reply in enumerate(every) if i not in staged])
        else:
            replies = iter(())
        finishers = iter(finish)
        return [
            result if result is not None else next(finishers)(next(replies)) for result in results
        ]

    def _send_batch(self, commands: list[tuple[Any, ...]], staged: set[int]) -> list[Any]:
        """Send a batch's commands (``staged``: the positions of staging SETs, each just
        before its script) in one round trip; raise the first error reply, as a pipeline
        does.

        redis-py's pipeline would first ask whether the scripts are loaded (SCRIPT EXISTS,
        one more round trip per batch) and costs ~40 us of client CPU more. Here a script
        missing from Redis's cache (a restart, SCRIPT FLUSH) fails its calls with NOSCRIPT:
        the scripts are loaded and only those calls (with their staging SETs) sent again,
        in order; the calls that ran stand, each fenced as alone.
        """
        replies = redis_hooks.round_trip(self.client, commands)
        missing = [
            i for i, reply in enumerate(replies) if isinstance(reply, redis_errors.NoScriptError)
        ]
        if missing:
            for script in (self.scripts.save, self.scripts.delete):
                self.client.script_load(script.script)
            again = sorted({*missing, *(i - 1 for i in missing if i - 1 in staged)})
            resent = redis_hooks.round_trip(self.client, [commands[i] for i in again])
            for i, reply in zip(again, resent, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

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
        return self.decode_value(session_id, stored)

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """One script call (load.lua): the value and the fence, read atomically."""
        checkpoint, fence, _ = self.load_at(session_id)
        return checkpoint, fence

    def load_at(self, session_id: str) -> tuple[Checkpoint | None, Fence | None, int]:
        """``load_with_fence``, and the server's time at the read (ms; load.lua's)."""
        self.check_session_id(session_id)
        keys = self.keys.session(session_id)
        with _store_errors(f"load {session_id!r}"):
            stored, seq, deleted, req, deadline, now = self.scripts.load(
                keys=[keys.data, keys.fence], args=[]
            )
        checkpoint = None if stored is None else self._decode(session_id, stored)
        return (
            checkpoint,
            self.fence_from_reply(seq, deleted, req, deadline, now_ms=int(now)),
            int(now),
        )

    def fence(self, session_id: str) -> Fence | None:
        self.check_session_id(session_id)
        with _store_errors(f"read fence of {session_id!r}"):
            reply = self.client.hmget(self.keys.fence(session_id), *_FENCE_FIELDS)
        return self.fence_from_reply(*reply)

    def fences(self, session_ids: Sequence[str]) -> list[Fence | None]:
        """Each session's fence, in one pipelined round trip (per node on a cluster), live
        by the server's clock (as a list judges them)."""
        if not session_ids:
            return []
        for session_id in session_ids:
            self.check_session_id(session_id)
        with _store_errors(f"read {len(session_ids)} fences"):
            pipe = self.client.pipeline(transaction=False)
            for session_id in session_ids:
                pipe.hmget(self.keys.fence(session_id), *_FENCE_FIELDS)
            replies = pipe.execute()
            seconds, micros = self.client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return [self.fence_from_reply(*reply, now_ms=now_ms) for reply in replies]

    def request_outcome(
        self, session_id: str, request_id: str
    ) -> tuple[Fence | None, Refusal | None]:
        """The fence and the request's refusal record (in its session's refusals), in one
        pipelined round trip."""
        self.check_session_id(session_id)
        with _store_errors(f"read outcome of {request_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(self.keys.fence(session_id), *_FENCE_FIELDS)
            pipe.hget(self.keys.refusals(session_id), request_id)
            fence, refusal = pipe.execute()
        return self.fence_from_reply(*fence), Refusal.decode(refusal)

    def fence_from_reply(
        self,
        seq: bytes | None,
        deleted: bytes | None,
        request_id: bytes | None,
        deadline: bytes | None = None,
        *,
        now_ms: int | None = None,
    ) -> Fence | None:
        """A fence from its hash fields (``_FENCE_FIELDS``, as HMGET or load.lua return
        them), live if its deadline is after ``now_ms`` (default: this store's clock). The
        sweep and reconciliation remove ``deadline`` once the value is gone."""
        if seq is None:
            return None
        now_ms = _ms(self.clock()) if now_ms is None else now_ms
        live = deadline is not None and float(deadline) > now_ms
        kind = _text(deleted)
        return Fence(int(seq), kind == "1", _text(request_id), live and kind == "0", kind == "2")

    def list_page(self, cursor: str | None = None, count: int = 1000) -> Page:
        """One page of live ids; the cursor is ZSCAN's on a single Redis and
        ``"<slot>:<zscan cursor>"`` on a cluster layout, which walks the slots in order, a
        run of one node's slots per ``page.lua`` call. Deadlines are judged by the server's
        clock, as loads judge them (load.lua): a process whose own clock runs ahead would
        otherwise list none of the sessions its loads return."""
        slot, inner = self._parse_cursor(cursor)
        if not isinstance(self.keys, ClusterKeySpace):
            with _store_errors("list sessions"):
                pipe = self.client.pipeline(transaction=False)
                pipe.time()
                pipe.zscan(self.keys.index(), inner, count=count)
                (seconds, micros), (next_cursor, entries) = pipe.execute()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            ids = [member.decode() for member, score in entries if score > now_ms]
            return Page(ids, str(next_cursor) if int(next_cursor) else None)
        chunks = self._chunks_by_node()
        ids = []
        while slot < REDIS_CLUSTER_HASH_SLOTS:
            node, indexes = chunks[self._chunk_of_slot[slot]]
            first = slot - self._chunk_of_slot_start[slot]
            args = ["", max(1, count - len(ids)), inner, *indexes[first:]]  # the node's time
            [(done, next_inner, *members)] = self._on_nodes(
                "list sessions", self.scripts.page, [(node, [], args)]
            )
            ids.extend(member.decode() for member in members)
            slot, inner = slot + int(done), int(next_inner)
            if inner or len(ids) >= count:
                break
        more = slot < REDIS_CLUSTER_HASH_SLOTS
        return Page(ids, self._format_cursor(slot, inner) if more else None)

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
        """Expire up to ``limit`` due sessions: read the due ids from the deadline index (on
        a cluster, from the slot indexes the sweep hint names, or every slot's in a full
        pass), then run one pipelined expire script per id (each touches one slot only).
        """
        now_ms = _ms(self.clock() if now is None else now)
        if isinstance(self.keys, ClusterKeySpace):
            due = self._due_on_cluster(now_ms, limit)
        else:
            with _store_errors("list stale sessions"):
                due = self.client.zrange(
                    self.keys.index(), "-inf", now_ms, byscore=True, offset=0, num=limit
                )
        return self._expire([member.decode() for member in due], now_ms)

    # A cluster has 16384 slot indexes, and reading them all costs ~50-100 ms of the masters'
    # time even when nothing is due. The sweep hint (``KeySpace.sweep_hint``, one sorted set)
    # records for each slot the earliest deadline its index held when a sweep last read it,
    # capped at "now + TTL - skew margin", the earliest deadline a save made after that read
    # can carry. A sweep then reads only the slots whose hint is due: with nothing due, one
    # call. A save cannot update the hint atomically (it lives in another slot), so the hint
    # is only as good as that cap: a deadline earlier than it (a writer's clock behind by
    # more than the margin, a TTL lowered by configuration, a value restored with its
    # remaining TTL) is found by the next full pass, which reads every slot and rewrites the
    # hint at least every ``StoreOptions.sweep_full_pass_seconds``. Reconciliation marks
    # the slots whose deadlines it adopted or moved (``mark_slots_due``); a missing hint
    # means a full pass. A late sweep never keeps data: every value carries its own Redis
    # TTL; it only delays dropping the index entry and the ``expired`` event.

    def _due_on_cluster(self, now_ms: int, limit: int) -> list[bytes]:
        """Up to ``limit`` due ids: from the slots the sweep hint names, or every slot's
        when a full pass is due; the hint is then updated with what was read."""
        with _store_errors("read the sweep hint"):
            named = self.scripts.hinted(
                keys=[self.keys.sweep_hint()], args=[now_ms, HINTED_SLOTS_PER_SWEEP + 1]
            )
        if named is None or named == [HINT_FULL.encode()] or len(named) > HINTED_SLOTS_PER_SWEEP:
            return self._full_pass(now_ms, limit)
        if not named:
            return []
        self._chunks_by_node()  # relearns the slot map first if a call failed
        slots_cache = self.client.nodes_manager.slots_cache
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for member in named:
            slot = int(member)
            node = slots_cache[slot][0]
            by_node.setdefault(node.name, (node, []))[1].append(slot)
        runs = [
            (node, slots[start : start + INDEXES_PER_CALL])
            for node, slots in by_node.values()
            for start in range(0, len(slots), INDEXES_PER_CALL)
        ]
        due, earliest, _stopped = self._read_slots(runs, now_ms, limit)
        self._record_hint(earliest, now_ms, full_pass_done=False)
        return due

    def _full_pass(self, now_ms: int, limit: int) -> list[bytes]:
        """Read every slot's index, from where the last full pass stopped (so a backlog in
        early slots cannot starve the rest); rewrite the hint for the slots read, and put
        the next full pass off only when every slot was read."""
        chunks = self._chunks_by_node()
        start = self._sweep_from % len(chunks)
        order = list(range(start, len(chunks))) + list(range(start))
        runs = [
            (
                chunks[i][0],
                list(range(self._chunk_starts[i], self._chunk_starts[i] + len(chunks[i][1]))),
            )
            for i in order
        ]
        due, earliest, stopped = self._read_slots(runs, now_ms, limit)
        if stopped is not None:
            # These slots may hold more due sessions: the next full pass starts with them.
            self._sweep_from = order[stopped]
        self._record_hint(
            earliest, now_ms, full_pass_done=len(earliest) == REDIS_CLUSTER_HASH_SLOTS
        )
        return due

    def _read_slots(
        self, runs: list[tuple[Any, list[int]]], now_ms: int, limit: int
    ) -> tuple[list[bytes], dict[int, float], int | None]:
        """``due.lua`` over each run of one node's slots, one pipeline per node, the nodes at
        once. Returns up to ``limit`` due ids; the earliest deadline of every slot read
        (``inf`` for an empty index); and the position of the run where ``limit`` was
        reached (None if it was not)."""
        indexes = self.keys.index_keys()
        calls: list[_NodeCall] = [
            (node, [], [now_ms, limit, *(indexes[slot] for slot in slots)]) for node, slots in runs
        ]
        replies = self._on_nodes("list stale sessions", self.scripts.due, calls)
        due: list[bytes] = []
        earliest: dict[int, float] = {}
        stopped: int | None = None
        for position, ((_node, slots), (firsts, ids)) in enumerate(zip(runs, replies, strict=True)):
            # Fewer earliest deadlines than slots: the call's budget ran out before the rest.
            for slot, first in zip(slots, firsts, strict=False):
                earliest[slot] = float(first) if first else math.inf
            due.extend(ids[: limit - len(due)])
            if stopped is None and (len(due) >= limit or len(firsts) < len(slots)):
                stopped = position
        return due, earliest, stopped

    def _record_hint(
        self, earliest: dict[int, float], now_ms: int, *, full_pass_done: bool
    ) -> None:
        """Write each read slot's earliest deadline into the sweep hint, capped at the
        earliest a later save can write (a slot with due ids stays due: its earliest is
        past); with ``full_pass_done``, schedule the next full pass."""
        clock_ms = min(now_ms, _ms(self.clock()))
        ttl_ms = _ms(self.options.ttl_seconds)
        cap = clock_ms + ttl_ms - min(HINT_SKEW_MS, ttl_ms // 2)
        scores: dict[str, float] = {str(slot): min(first, cap) for slot, first in earliest.items()}
        if full_pass_done:
            scores[HINT_FULL] = clock_ms + _ms(self.options.sweep_full_pass_seconds)
        items = list(scores.items())
        with _store_errors("record the sweep hint"):
            # Bounded ZADDs (a full pass writes 16385 members), in one round trip.
            pipe = self.client.pipeline(transaction=False)
            for start in range(0, len(items), INDEXES_PER_CALL):
                pipe.zadd(self.keys.sweep_hint(), dict(items[start : start + INDEXES_PER_CALL]))
            pipe.execute()

    def mark_slots_due(self, slots: set[int], now_ms: int) -> None:
        """Cluster only: have the next sweep read these slots' indexes (reconciliation
        wrote deadlines into them that the sweep hint may not cover)."""
        if slots and isinstance(self.keys, ClusterKeySpace):
            with _store_errors("mark slots due in the sweep hint"):
                self.client.zadd(
                    self.keys.sweep_hint(), {str(slot): now_ms for slot in slots}, lt=True
                )

    def _on_nodes(
        self,
        action: str,
        script: Script,
        calls: list[_NodeCall],
        *,
        per_call_errors: bool = False,
    ) -> list[Any]:
        """Run ``script`` once per ``(node, keys, args)``, on that cluster node directly; one
        pipeline per node, the nodes concurrently. Replies come in call order.

        With ``per_call_errors`` a call that fails (its slot moved: MOVED) gets its
        exception as its reply and the others stand; the next call relearns the slot map.

        Raises:
            StoreUnavailable: a node failed, or (without ``per_call_errors``) no longer
                serves a slot it was sent; the next call relearns the slot map first.
        """
        by_node: dict[str, list[int]] = {}
        for position, (node, _keys, _args) in enumerate(calls):
            by_node.setdefault(node.name, []).append(position)

        def run(positions: list[int]) -> list[Any]:
            node = calls[positions[0]][0]
            pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
            for position in positions:
                _node, keys, args = calls[position]
                script(keys=keys, args=args, client=pipe)
            replies: list[Any] = pipe.execute(raise_on_error=not per_call_errors)
            return replies

        replies: list[Any] = [None] * len(calls)
        try:
            with _store_errors(action):
                if len(by_node) == 1:
                    results = [run(positions) for positions in by_node.values()]
                else:
                    with ThreadPoolExecutor(max_workers=len(by_node)) as pool:
                        results = list(pool.map(run, by_node.values()))
        except StoreUnavailable:
            # A failover or a slot migration: group the slots afresh on the next call.
            self._relearn_slots = True
            raise
        for positions, values in zip(by_node.values(), results, strict=True):
            for position, value in zip(positions, values, strict=True):
                replies[position] = value
                if isinstance(value, Exception):
                    self._relearn_slots = True
        return replies

    def _chunks_by_node(self) -> list[tuple[Any, list[str]]]:
        """The slot indexes of a cluster layout in slot order, cut into runs served by one
        node, each at most ``INDEXES_PER_CALL`` long; regrouped whenever the client's slot
        map changes."""
        manager = self.client.nodes_manager
        if self._relearn_slots:
            with _store_errors("learn the cluster's slot map"):
                manager.initialize()
            self._relearn_slots = False
        slots = manager.slots_cache
        if self._chunked_by is not slots:
            chunks: list[tuple[Any, list[str]]] = []
            chunk_of_slot: list[int] = []
            chunk_start: list[int] = []
            for slot, index in enumerate(self.keys.index_keys()):
                node = slots[slot][0]  # the slot's primary
                if chunks and chunks[-1][0] is node and len(chunks[-1][1]) < INDEXES_PER_CALL:
                    chunks[-1][1].append(index)
                else:
                    chunks.append((node, [index]))
                    chunk_start.append(slot)
                chunk_of_slot.append(len(chunks) - 1)
            self._node_chunks, self._chunked_by = chunks, slots
            self._chunk_of_slot = chunk_of_slot
            self._chunk_starts = chunk_start
            self._chunk_of_slot_start = [chunk_start[c] for c in chunk_of_slot]
        return self._node_chunks

    def count_sessions(self, now: float | None = None) -> SessionCounts:
        """Two ZCOUNTs of the deadline index on a single Redis; on a cluster, every slot's
        index counted by a few ``count.lua`` calls per node, the nodes at once."""
        now_ms = _ms(self.clock() if now is None else now)
        if not isinstance(self.keys, ClusterKeySpace):
            with _store_errors("count sessions"):
                pipe = self.client.pipeline(transaction=False)
                pipe.zcount(self.keys.index(), f"({now_ms}", "+inf")
                pipe.zcount(self.keys.index(), "-inf", now_ms)
                live, due = pipe.execute()
            return SessionCounts(live=int(live), expired=int(due))
        calls: list[_NodeCall] = [
            (node, [], [now_ms, *indexes]) for node, indexes in self._chunks_by_node()
        ]
        replies = self._on_nodes("count sessions", self.scripts.count, calls)
        return SessionCounts(
            live=sum(int(live) for live, _due in replies),
            expired=sum(int(due) for _live, due in replies),
        )

    def _expire(self, candidates: list[str], now_ms: int) -> list[str]:
        if isinstance(self.keys, ClusterKeySpace) and candidates:
            return self._expire_on_cluster(candidates, now_ms)
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

    def _expire_on_cluster(self, candidates: list[str], now_ms: int) -> list[str]:
        """One expire script per id, on the node serving the id's slot (``on_slot_nodes``).
        An id whose slot moved meanwhile is not expired now: it stays due and the next
        sweep, with the slot map relearned, expires it."""
        expired: list[str] = []
        for start in range(0, len(candidates), SWEEP_BATCH * 4):
            batch = candidates[start : start + SWEEP_BATCH * 4]
            calls = [
                (self.keys.shard(sid), self.keys.session(sid).as_list(), [now_ms, sid])
                for sid in batch
            ]
            results = self.on_slot_nodes("expire stale sessions", self.scripts.expire, calls)
            expired.extend(sid for sid, done in zip(batch, results, strict=True) if done == 1)
        return expired

    def on_slot_nodes(
        self, action: str, script: Script, calls: list[tuple[int, list[str], list[Any]]]
    ) -> list[Any]:
        """Cluster only: run ``script`` once per ``(slot, keys, args)``, as EVALSHA down the
        connection of the node serving that slot, one pipeline per node, the nodes at once
        (a cluster pipeline could only send the whole script text each time, through a
        slower client path). Replies come in call order; a call whose slot moved meanwhile
        (MOVED) gets its exception as its reply, and the next call relearns the slot map.

        Raises:
            StoreUnavailable: a node failed.
        """
        self._chunks_by_node()  # relearns the slot map first if a call failed
        slots = self.client.nodes_manager.slots_cache
        node_calls: list[_NodeCall] = [(slots[slot][0], keys, args) for slot, keys, args in calls]
        return self._on_nodes(action, script, node_calls, per_call_errors=True)

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

    def migrate_sharded_layout(self, shards: int = 1024, batch: int = 500) -> int:
        """Move the sessions of the earlier cluster layout (``<prefix>:{<tag>}:<id>`` data
        keys, ``shards`` index shards) to this one; return how many were moved.

        Each session is written through ``save.lua`` with its old value (bytes unchanged), its
        remaining TTL and its old fence's seq, so a newer save already made in this layout
        wins; then its old keys are deleted. Idempotent and resumable: run it again after an
        interruption. Tombstones of the old layout are not carried over, so run it with the
        queue drained (docs/scaling.md).

        Raises:
            InvalidInput: the store is not on a cluster layout.
        """
        if not isinstance(self.keys, ClusterKeySpace):
            raise InvalidInput("only a cluster store has an earlier sharded layout to migrate")
        old = ShardedKeySpace(self.keys.prefix, shards)
        moved = 0
        for shard in range(shards):
            index = old.index(shard)
            while True:
                with _store_errors("migrate the sharded layout"):
                    ids = [m.decode() for m in self.client.zrange(index, 0, batch - 1)]
                    if not ids:
                        break
                    pipe = self.client.pipeline(transaction=False)
                    for session_id in ids:
                        pipe.get(old.data(shard, session_id))
                        pipe.pttl(old.data(shard, session_id))
                        pipe.hmget(old.fence(shard, session_id), "seq", "req")
                    replies = pipe.execute()
                    now_ms = _ms(self.clock())
                    pipe = self.client.pipeline(transaction=False)
                    for i, session_id in enumerate(ids):
                        value, ttl, (seq, req) = replies[3 * i : 3 * i + 3]
                        if value is not None and ttl > 0:
                            keys, args = self._save_call(
                                session_id, value, int(seq or 0), _text(req), now_ms, ttl
                            )
                            queue(self.scripts.save, pipe, keys, args)
                    moved += sum(1 for applied in pipe.execute() if applied)
                    pipe = self.client.pipeline(transaction=False)
                    for session_id in ids:
                        pipe.delete(old.data(shard, session_id))
                        pipe.delete(old.fence(shard, session_id))
                        pipe.zrem(index, session_id)
                    pipe.execute()
        # The moved sessions kept their remaining TTLs, earlier than the sweep hint expects
        # of their slots: the next sweep is a full pass.
        with _store_errors("migrate the sharded layout"):
            self.client.delete(self.keys.sweep_hint())
        return moved

    def identity(self) -> str:
        """Written once (``SET NX``) by the store's first user, then read by everyone."""
        key = self.keys.identity()
        with _store_errors("read the store's identity"):
            found = self.client.get(key)
            if found is None:  # (only then a write: a store refusing writes still reads)
                self.client.set(key, new_identity(), nx=True)
                found = self.client.get(key)
        return _text(found)

    def ping(self) -> None:
        """Raise StoreUnavailable unless Redis answers."""
        with _store_errors("ping"):
            self.client.ping()

    def write_refusal(self) -> str | None:
        return probe.write_refusal(self.client, self.keys.write_probe())

    def close(self) -> None:
        """Close every connection now. A cluster client built from a URL gives each node a
        connection pool that its ``close`` leaves open (redis-py 8): those are disconnected
        here, rather than left for the garbage collector."""
        if isinstance(self.client, RedisCluster):
            for node in self.client.get_nodes():  # type: ignore[no-untyped-call]
                if node.redis_connection is not None:
                    node.redis_connection.connection_pool.disconnect()
        self.client.close()


def _lapsed(ref: str, checkpoint: Checkpoint, seq: int, _reply: Any) -> SaveResult:
    """A lapsed save's result, whatever lapse.lua answered."""
    return SaveResult.lapse(ref, checkpoint, seq)


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")
