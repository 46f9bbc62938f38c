"""The producer client for asyncio API servers (FastAPI, Starlette, aiohttp, agent SDKs).

``AsyncCheckpointClient`` is ``CheckpointClient`` on ``redis.asyncio``: the same requests
(``requests.Requests``), the same scripts (publish.lua writes a message and its pending record
in one call; read_pending.lua merges the records into loads), so the same guarantees, awaited
instead of blocking the event loop.

**Cancellation.** A save or delete is one script call sent in one write (a staged value's SET
just before it), so a cancelled ``save`` was accepted whole (record and message) or not at all
(a staged value left alone expires unread); ``load`` says which.

**Where it reads.** The broker's records, and a Redis store, through ``redis.asyncio`` (one
script call when they are one Redis); a store without an asyncio client (PostgreSQL, a Redis
Cluster, in memory) by its sync client in a worker thread, as are ``list``'s store pages.
Redis brokers only: on Sentinel or RabbitMQ the sync client publishes through Celery.

**As the sync client**, the shared core decides sealing (encryption at rest), broker losses
(counted, the recovery window published again), missing pending entries (refused) and
outcomes (by the whole stamp). docs/api.md ("Producing from asyncio") is the user's side.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import redis.asyncio
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from checkpointq.store.base import CheckpointStore, Fence, Refusal, new_identity
from checkpointq.store.errors import CheckpointError, InvalidInput, StoreUnavailable
from checkpointq.store.factory import store_from_settings
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.store.redis import RedisStore
from checkpointq.store.redis_hooks_aio import RoundTrips
from checkpointq.store.scripts import script_source
from checkpointq.store.serde import dumps_go
from checkpointq.store.urls import redact_url, redis_py_url
from checkpointq.tasks import messages, store_identity
from checkpointq.tasks.errors import BrokerUnavailable, ReplicationTimeout
from checkpointq.tasks.messages import EXPIRE_STALE, REFRESH
from checkpointq.tasks.producer.broker_durability import LOCAL_DURABILITY, BrokerDurability
from checkpointq.tasks.producer.client import (
    PUBLISH_RETRY_POLICY,
    ClientSettings,
    client_options,
)
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.core import ProducerCore
from checkpointq.tasks.producer.fast_publish import (
    ATTEMPT_TIMEOUT,
    PUBLISH_TIMEOUT,
    Attempts,
    Envelopes,
    new_id,
    supports,
)
from checkpointq.tasks.producer.outcomes import RequestOutcome
from checkpointq.tasks.producer.pending import (
    _HEADS_PER_CALL,
    DEFAULT_MAX_SEQ_AHEAD_SECONDS,
    DEFAULT_REPUBLISH_BYTES,
    DEFAULT_REPUBLISH_REQUESTS,
    DEFAULT_REPUBLISH_SECONDS,
    Answer,
    Commands,
    Exchange,
    PendingRecord,
    RecentPublishes,
    RecordCalls,
    Steps,
    _answering,
    answer,
    heads_records,
    merge_list,
    parse_record,
    refusal_unavailable,
    requests_named,
    same_redis,
)
from checkpointq.tasks.producer.requests import (
    Handle,
    Publication,
    brief,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Seconds a read waits for its answer (the store's default socket timeout).
READ_TIMEOUT = 5.0

#: The fence hash fields, as ``RedisStore.fence_from_reply`` takes them.
_FENCE_FIELDS = ("seq", "deleted", "req", "deadline")


class AsyncCheckpointClient(ProducerCore):
    """Enqueue checkpoint requests and read checkpoints from asyncio code; share one per
    event loop (it holds that loop's connections)."""

    def __init__(
        self,
        broker_url: str,
        store: CheckpointStore,
        *,
        queue: str = "checkpoints",
        max_message_bytes: int = 8 * 1024 * 1024,
        clock: SeqClock | None = None,
        key_prefix: str | None = None,
        compress_messages: bool = True,
        stage_saves: bool = True,
        max_seq_ahead_seconds: float = DEFAULT_MAX_SEQ_AHEAD_SECONDS,
        republish_seconds: float = DEFAULT_REPUBLISH_SECONDS,
        republish_requests: int = DEFAULT_REPUBLISH_REQUESTS,
        republish_bytes: int = DEFAULT_REPUBLISH_BYTES,
        retry_policy: Mapping[str, float] = PUBLISH_RETRY_POLICY,
        durability: BrokerDurability = LOCAL_DURABILITY,
    ) -> None:
        """Publish to ``broker_url``'s ``queue``; read (and wait on) ``store``. The options
        are ``CheckpointClient``'s.

        Raises:
            InvalidInput: ``broker_url`` is not a plain Redis broker.
        """
        if not supports(broker_url):
            raise InvalidInput(
                f"the asyncio client publishes to Redis brokers only, not "
                f"{redact_url(broker_url)}: use CheckpointClient there",
                field="broker_url",
            )
        super().__init__(
            broker_url,
            store,
            queue=queue,
            max_message_bytes=max_message_bytes,
            clock=clock,
            compress_messages=compress_messages,
            stage_saves=stage_saves,
        )
        self.retry_policy = dict(retry_policy)
        self.envelopes = Envelopes(queue)
        #: ``broker_durability``: a replicated publish's WAIT lengthens its waits.
        self.durability = durability
        # Publishes: our own retry loop decides how long one may take (``Attempts``), each
        # attempt bounded at a second by ``RoundTrips``'s watchdog (the publishing
        # connections have no socket timeout of their own). Reads: one wait as long as a
        # store read's (a loaded loop stretches every wait), as the sync client's reads.
        url = redis_py_url(broker_url)
        self.broker, self.reader = (
            redis.asyncio.Redis.from_url(
                url,
                socket_timeout=wait,
                socket_connect_timeout=connect,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=30,
            )
            for wait, connect in ((None, ATTEMPT_TIMEOUT), (READ_TIMEOUT, READ_TIMEOUT))
        )
        #: One write and its replies a call (``redis_hooks_aio``: hand-sent where proven).
        # (A replicated publish waits for its replicas too: the WAIT's timeout is added.)
        self.round_trip = RoundTrips(self.broker, ATTEMPT_TIMEOUT + durability.wait_seconds)
        #: publish.lua's and read_pending.lua's calls and replies (``pending.RecordCalls``).
        self.records = RecordCalls(
            self.record_keys(key_prefix),
            ttl_seconds=store.options.ttl_seconds,
            clock=self.clock,
            max_seq_ahead_seconds=max_seq_ahead_seconds,
            recent=RecentPublishes(republish_seconds, republish_requests, republish_bytes),
            durability=durability,
        )
        self._read = self.reader.register_script(self.records.read_source)
        #: Broker and store are one Redis: a load reads both in one script call.
        self.one_redis = isinstance(store, RedisStore) and same_redis(self.broker, store.client)
        self._store_client: redis.asyncio.Redis | None = None
        if isinstance(store, RedisStore):
            self._store_client = self.reader if self.one_redis else store.asyncio_client()
        self._store_load = (
            None
            if self._store_client is None
            else self._store_client.register_script(_load_source())
        )

    @classmethod
    def from_settings(cls, settings: ClientSettings) -> AsyncCheckpointClient:
        """A client for the deployment ``settings`` describe (a Redis broker URL).

        Raises:
            StoreNotConfigured: no broker URL (as ``CheckpointClient.from_settings``).
            InvalidInput: the broker is not a plain Redis.
        """
        broker_url, options = client_options(settings)
        return cls(broker_url, store_from_settings(settings), **options)

    def __repr__(self) -> str:
        return (
            f"AsyncCheckpointClient({self._display_url}, queue={self.queue!r}, "
            f"store={self.store!r})"
        )

    # -- enqueue ------------------------------------------------------------------------

    async def save(
        self, checkpoint: Checkpoint | dict[str, Any], *, after: int | None = None
    ) -> Handle:
        """Enqueue a save stamped with a fresh causal ``seq``; return once the broker has it
        (as ``CheckpointClient.save``: a ``Checkpoint`` or a dict of its JSON fields).

        Raises:
            InvalidCheckpoint, CheckpointTooLarge, InvalidInput, SeqRefused,
            BrokerUnavailable: as ``CheckpointClient.save``.
        """
        if self.stage_saves or self.encrypted:  # encrypted: always (as the sync client)
            return await self.publish(self.requests.save_staged(checkpoint, after))
        return await self.publish(self.requests.save(checkpoint, after, fast=True))

    async def delete(self, session_id: str, *, after: int | None = None) -> Handle:
        """Enqueue a delete stamped with a fresh causal ``seq``; return once the broker has
        it. Raises as ``save``."""
        return await self.publish(self.requests.delete(session_id, after))

    async def refresh(self, session_id: str) -> Handle:
        """Enqueue a TTL refresh (no rewrite)."""
        validate_session_id(session_id)
        return Handle(await self.send(REFRESH, [session_id], {}), REFRESH, session_id, None)

    async def sweep(self) -> str:
        """Enqueue a sweep of expired sessions; return its task id."""
        return await self.send(EXPIRE_STALE, [], {})

    async def send(self, task: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """Publish ``task(*args, **kwargs)`` by name (no records); return the task id."""
        body = messages.body(dumps_go(args), dumps_go(kwargs))
        task_id = new_id()
        message, hooks = self.envelopes.message(
            task, body, brief.repr(args), brief.repr(kwargs), task_id
        )
        await self._retrying(task, lambda: self._lpush(message))
        if hooks is not None:
            hooks.after(task, body, message, self.queue)
        return task_id

    async def _lpush(self, message: bytes) -> None:
        (reply,) = await self.round_trip([("LPUSH", self.queue, message)])
        if isinstance(reply, Exception):
            raise reply

    async def publish(self, publication: Publication) -> Handle:
        """Push ``publication``'s message and pending records in one publish.lua call.

        Raises:
            SeqRefused, BrokerUnavailable, ReplicationTimeout: as ``save``.
        """
        p = publication
        message, hooks = self.envelopes.message(
            p.task, p.body, p.argsrepr, p.kwargsrepr, p.task_id, p.zstd_body
        )
        steps = self.records.publish_steps
        _lost, acked = await self._retrying(
            p.task, lambda: self._drive(steps(self.queue, message, p.records))
        )
        if hooks is not None:
            hooks.after(p.task, p.body, message, self.queue)
        if acked is not None:  # replicated
            try:
                self.durability.check(acked, requests_named(p.records), self._display_url)
            except ReplicationTimeout as exc:
                exc.handle = p.handle  # accepted by the primary: its outcome can be waited on
                raise
        return p.handle

    async def recover(self) -> int:
        """Publish again what this client published within its recovery window, oldest
        first (``RecordCalls.recover_steps``, as the sync client): after a loss of accepted
        requests, those it still holds land after all. Returns how many went out; a failure
        stops it."""
        return await self._drive(self.records.recover_steps())

    async def _drive(self, steps: Steps[_T]) -> _T:
        """Run ``steps`` (``pending.drive``'s twin), each write awaited."""
        exchange = Exchange(steps)
        while (commands := exchange.next()) is not None:
            exchange.answer = await self._caught(commands)
        return exchange.result

    async def _caught(self, commands: Commands) -> Answer:
        try:
            return await self.round_trip(commands)
        except Exception as exc:  # for the steps to judge (a cancellation ends them)
            return exc

    async def _retrying(self, what: str, push: Callable[[], Awaitable[_T]]) -> _T:
        extra = self.durability.wait_seconds
        attempts = Attempts(
            what,
            self.retry_policy,
            PUBLISH_TIMEOUT + extra,
            2 * ATTEMPT_TIMEOUT + extra,
            self._display_url,
        )
        while True:
            try:
                return await push()
            except redis_errors.RedisError as exc:
                await asyncio.sleep(attempts.retry_after(exc))

    # -- read-your-writes ---------------------------------------------------------------

    async def wait_durable(
        self, handle: Handle, timeout: float = 10.0, interval: float = 0.01
    ) -> RequestOutcome:
        """Until ``handle``'s own outcome is known, polling without blocking the loop; answers
        and raises as ``CheckpointClient.wait_durable``."""
        poll = self.requests.poll(handle, timeout, interval)
        while True:
            fence, refusal = await self._request_outcome(handle.session_id, handle.request)
            await self.check_store()
            if refusal is None and not self.store.keeps_refusals:
                refusal = await self._broker_refusal(handle.session_id, handle.request)
            outcome = poll.judge(fence, refusal)
            if outcome is not None:
                return outcome
            await asyncio.sleep(poll.pause(fence))

    async def _request_outcome(
        self, session_id: str, request_id: str
    ) -> tuple[Fence | None, Refusal | None]:
        store, client = self.store, self._store_client
        if not isinstance(store, RedisStore) or client is None:
            return await asyncio.to_thread(store.request_outcome, session_id, request_id)
        store.check_session_id(session_id)
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hmget(store.keys.fence(session_id), *_FENCE_FIELDS)
            pipe.hget(store.keys.refusals(session_id), request_id)
            fence, refusal = await pipe.execute()
        except redis_errors.RedisError as exc:
            raise _store_unavailable(f"read outcome of {request_id!r}", exc) from exc
        return store.fence_from_reply(*fence), Refusal.decode(refusal)

    async def _broker_refusal(self, session_id: str, request_id: str) -> Refusal | None:
        try:
            raw = await self.reader.hget(self.records.keys.refusals(session_id), request_id)
        except redis_errors.RedisError as exc:
            raise refusal_unavailable(request_id, self._display_url, exc) from exc
        return Refusal.decode(raw)

    # -- reads --------------------------------------------------------------------------

    async def load(self, session_id: str) -> Checkpoint | None:
        """The newest accepted write of the session (a ``Checkpoint``), or None when absent,
        expired or deleted; as ``CheckpointClient.load``, fence remembered.

        Raises:
            BrokerUnavailable: the pending records could not be read.
            StoreUnavailable: the store could not be read.
        """
        return (await self.load_with_fence(session_id))[0]

    async def load_with_fence(
        self, session_id: str, again: bool = True
    ) -> tuple[Checkpoint | None, Fence | None]:
        """The checkpoint and the fence of what was loaded (``CheckpointClient``'s). One
        script call when broker and store are one Redis. Raises as ``load``; a load that
        finds the broker lost accepted requests republishes the window and reads again."""
        store = self.store
        store.check_session_id(session_id)
        records = self.records
        if self.one_redis and isinstance(store, RedisStore):
            # Before the read: a mark seen after it may be other tasks' later publishes.
            seen = records.epochs.floor()
            keys, args = records.read_store_call(session_id, store.keys, seen)
            try:
                reply = await self._read(keys=keys, args=args)
            except redis_errors.RedisError as exc:
                raise _store_unavailable(f"load {session_id!r}", exc) from exc
            checkpoint, fence, fields, lost = records.store_reply(
                store, session_id, reply, seen=seen
            )
            if lost and await self.recover() > 0 and again:
                return await self.load_with_fence(session_id, again=False)
            record = _answering(fields, fence)  # one script: judged at its own time
        else:
            seen = records.epochs.floor()
            keys, args = records.read_call(session_id, seen)
            try:  # first: an entry is gone only once applied
                reply = await self._read(keys=keys, args=args)
            except redis_errors.RedisError as exc:
                what = f"the load of {session_id!r}"
                raise records.unavailable(self._display_url, what, exc) from exc
            fields, lost = records.one_reply(reply, seen=seen)
            if lost and await self.recover() > 0 and again:
                return await self.load_with_fence(session_id, again=False)
            checkpoint, fence, store_now_ms = await self._store_load_at(session_id)
            record = _answering(fields, fence, records.ttl_ms, store_now_ms)
        checkpoint, fence = answer(store, session_id, checkpoint, fence, record)
        await self.check_store()
        if fence is not None:
            self.clock.observe(session_id, fence.seq)
        return checkpoint, fence

    async def _store_load_at(self, session_id: str) -> tuple[Checkpoint | None, Fence | None, int]:
        store, script = self.store, self._store_load
        if not isinstance(store, RedisStore) or script is None:
            return await asyncio.to_thread(store.load_at, session_id)
        keys = store.keys.session(session_id)
        try:
            stored, seq, deleted, req, deadline, now = await script(
                keys=[keys.data, keys.fence], args=[]
            )
        except redis_errors.RedisError as exc:
            raise _store_unavailable(f"load {session_id!r}", exc) from exc
        checkpoint = None if stored is None else store.decode_value(session_id, stored)
        return checkpoint, store.fence_from_reply(seq, deleted, req, deadline), int(now)

    async def pending_record(self, session_id: str) -> PendingRecord | None:
        """The session's newest pending request on the broker (None: none).

        Raises:
            BrokerUnavailable: as ``PendingRecords.read``.
        """
        seen = self.records.epochs.floor()
        keys, args = self.records.read_call(session_id, seen)
        try:
            reply = await self._read(keys=keys, args=args)
        except redis_errors.RedisError as exc:
            raise self.records.unavailable(self._display_url, "the read", exc) from exc
        fields, lost = self.records.one_reply(reply, seen=seen)
        if lost:
            await self.recover()
        return parse_record(*fields)

    async def list(self) -> list[str]:
        """Every live session id: the store's, with the pending saves and without the
        pending deletes; sorted. The store's pages are read in a worker thread.

        Raises:
            BrokerUnavailable, StoreUnavailable: as ``CheckpointClient.list``.
        """
        records = await self._live_records()  # first, as for a load
        listed = await asyncio.to_thread(self.store.list)
        fences = await asyncio.to_thread(self.store.fences, sorted(records))
        await self.check_store()
        return merge_list(records, listed, fences)

    async def _live_records(self) -> dict[str, PendingRecord]:
        broker, records = self.reader, self.records
        try:
            seconds, micros = await broker.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            index = records.keys.pending_index()
            members: list[Any] = await broker.zrangebyscore(index, now_ms, "+inf")
            ids = [bytes(member).decode() for member in members]
            heads: list[Any] = []
            for start in range(0, len(ids), _HEADS_PER_CALL):
                keys, args = records.heads_call(ids[start : start + _HEADS_PER_CALL])
                heads += await self._read(keys=keys, args=args)
            epoch: Any = await broker.get(records.keys.pending_epoch())
            counts: list[Any] = []
            if ids:
                pipe = broker.pipeline(transaction=False)
                for command in records.counts_commands(ids):
                    pipe.execute_command(*command)
                counts = await pipe.execute()
        except redis_errors.RedisError as exc:
            raise records.unavailable(self._display_url, "the list", exc) from exc
        records.missing(ids, counts, self._display_url)
        records.epochs.observe(epoch)
        return heads_records(ids, heads)

    async def check_store(self) -> None:
        """As ``CheckpointClient.check_store``: this store against the workers', after each
        read until they agree.

        Raises:
            StoreMismatch: they are two stores (naming both).
        """
        check = self.store_check
        if not check.due():
            return
        try:
            mine = await self._store_identity()  # first: an announcement made after it counts
            published = await self._published_store()
        except (redis_errors.RedisError, CheckpointError):
            check.unknown()
            return
        check.compare(mine, repr(self.store), published, self._display_url)

    async def _store_identity(self) -> str | None:
        store, client = self.store, self._store_client
        if not isinstance(store, RedisStore) or client is None:
            return await asyncio.to_thread(store.identity)
        key = store.keys.identity()
        found: Any
        try:
            found = await client.get(key)
            if found is None:  # (only then a write: a store refusing writes still reads)
                await client.set(key, new_identity(), nx=True)
                found = await client.get(key)
        except redis_errors.RedisError as exc:
            raise _store_unavailable("read the store's identity", exc) from exc
        return None if found is None else bytes(found).decode()

    async def _published_store(self) -> store_identity.PublishedStore | None:
        try:
            raw = await self.reader.get(self.records.keys.published_store())
        except redis_errors.RedisError as exc:
            raise BrokerUnavailable(
                f"could not read the workers' store on {self._display_url}: {exc}"
            ) from exc
        return store_identity.PublishedStore.decode(raw)

    @property
    def epoch_changes(self) -> int:
        """How many times this client found the broker had lost accepted requests (as
        ``CheckpointClient.epoch_changes``); each is logged and the window republished."""
        return self.records.epochs.changes

    async def close(self) -> None:
        """Close the connections (and the store's sync client)."""
        if self._store_client is not None and self._store_client is not self.reader:
            await self._store_client.aclose()
        await self.reader.aclose()
        await self.broker.aclose()
        self.store.close()

    async def __aenter__(self) -> AsyncCheckpointClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


def _load_source() -> str:
    return script_source("load")


def _store_unavailable(action: str, exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(f"{action}: Redis error ({type(exc).__name__}: {exc})")
