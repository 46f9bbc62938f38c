"""The producer client for API servers: enqueue by task name, wait for durability, read.

Light on purpose: it imports no task code, needs no result backend, and on a Redis broker no
Celery either (Celery comes with the worker's extra, ``checkpointq[worker]``). On a Redis
broker it writes Celery protocol 2 messages itself and LPUSHes them (``fast_publish``: the
stock worker reads them as it reads ``send_task``'s, at a fraction of the producer's cost);
on any other broker it publishes with ``send_task``. It stamps every save and delete with a
causal ``seq`` (``clock``: after every fence this process has read for the session, so
"load, then save" keeps its order across producers whose clocks disagree). On a Redis broker
each save and delete also writes its pending record in the push's own script call, and loads
merge those records with the store (``pending``): every replica's load sees every
accepted write, while the workers lag or the store refuses writes::

    client = CheckpointClient.from_settings(settings)
    cp = client.load(session_id)              # also remembers the session's fence
    handle = client.save(cp)                  # returns as soon as the broker has it
    client.wait_durable(handle, timeout=5.0)  # applied or superseded; raises if refused

On other brokers (Sentinel, RabbitMQ: published through Celery) no records are written and
loads read the store alone (``pending_records`` is None): a request is seen once applied.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from redis import exceptions as redis_errors

from checkpointq.store.base import CheckpointStore, EncodedCheckpoint, Fence
from checkpointq.store.encryption import EncryptionError
from checkpointq.store.errors import CheckpointError, InvalidInput, StoreNotConfigured
from checkpointq.store.factory import StoreSettings, store_from_settings
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.store.serde import dumps_go
from checkpointq.store.urls import kombu_url
from checkpointq.tasks import brokers, messages, store_identity
from checkpointq.tasks.errors import BrokerUnavailable, ReplicationTimeout

# The task names are the contract (docs/protocol.md); the client does not import the tasks.
from checkpointq.tasks.messages import EXPIRE_STALE, REFRESH
from checkpointq.tasks.producer import fast_publish
from checkpointq.tasks.producer.broker_durability import LOCAL_DURABILITY, BrokerDurability
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.core import ProducerCore
from checkpointq.tasks.producer.outcomes import RequestOutcome
from checkpointq.tasks.producer.pending import (
    DEFAULT_MAX_SEQ_AHEAD_SECONDS,
    DEFAULT_REPUBLISH_BYTES,
    DEFAULT_REPUBLISH_REQUESTS,
    DEFAULT_REPUBLISH_SECONDS,
    PendingRecords,
    RecentPublishes,
    RecordWrite,
)
from checkpointq.tasks.producer.requests import (
    Handle,
    Publication,
    brief,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["PUBLISH_RETRY_POLICY", "CheckpointClient", "ClientSettings", "Handle"]

#: How hard a publish tries while the broker is unreachable (kombu retry policy): about
#: three seconds in all, then BrokerUnavailable.
PUBLISH_RETRY_POLICY: dict[str, float] = {
    "max_retries": 5,
    "interval_start": 0,
    "interval_step": 0.5,
    "interval_max": 1.0,
}


class ClientSettings(StoreSettings, Protocol):
    """What ``from_settings`` reads; ``checkpointq.worker.settings.Settings`` has all of it."""

    broker_url: str | None
    queue: str
    max_message_bytes: int
    compress_messages: bool
    stage_saves: bool
    max_seq_ahead_seconds: float
    republish_seconds: float
    republish_requests: int
    republish_bytes: int
    sentinel_master: str | None
    sentinel_password: str | None
    broker_replicas: int
    broker_replication_timeout_ms: int

    @property
    def broker_durability(self) -> str: ...


def client_options(settings: ClientSettings) -> tuple[str, dict[str, Any]]:
    """The broker URL ``settings`` name and the options both clients take from them.

    Raises:
        StoreNotConfigured: no broker URL (resolve the embedded one first, as ``Settings()``
            and the CLI do).
    """
    if not settings.broker_url:
        raise StoreNotConfigured(
            "no broker URL: set CHECKPOINTQ_BROKER_URL, or run `checkpointq up` in this "
            "directory (Settings() finds its embedded Redis)"
        )
    return settings.broker_url, {
        "queue": settings.queue,
        "max_message_bytes": settings.max_message_bytes,
        "compress_messages": settings.compress_messages,
        "stage_saves": settings.stage_saves,
        "max_seq_ahead_seconds": settings.max_seq_ahead_seconds,
        "republish_seconds": settings.republish_seconds,
        "republish_requests": settings.republish_requests,
        "republish_bytes": settings.republish_bytes,
        "key_prefix": settings.key_prefix,
        "durability": BrokerDurability.from_settings(settings),
    }


def _bounded(broker_url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with socket timeouts for a Redis-based broker (Sentinel included: its
    sentinels too), which kombu otherwise leaves unbounded: a sentinel that accepts
    connections and never answers hung a publish for good."""
    kind = brokers.broker_kind(broker_url)
    if kind not in (brokers.BrokerKind.REDIS, brokers.BrokerKind.SENTINEL):
        return options
    timeouts = {
        "socket_timeout": fast_publish.ATTEMPT_TIMEOUT,
        "socket_connect_timeout": fast_publish.ATTEMPT_TIMEOUT,
    }
    sentinels = {**options.get("sentinel_kwargs", {}), **timeouts}
    bounded = {**timeouts, **options}
    if kind is brokers.BrokerKind.SENTINEL:
        bounded["sentinel_kwargs"] = sentinels
    return bounded


class CheckpointClient(ProducerCore):
    """Enqueue checkpoint requests and read checkpoints; safe to share between threads."""

    def __init__(
        self,
        broker_url: str,
        store: CheckpointStore,
        *,
        queue: str = "checkpoints",
        max_message_bytes: int = 8 * 1024 * 1024,
        transport_options: dict[str, Any] | None = None,
        clock: SeqClock | None = None,
        key_prefix: str | None = None,
        compress_messages: bool = True,
        stage_saves: bool = True,
        max_seq_ahead_seconds: float = DEFAULT_MAX_SEQ_AHEAD_SECONDS,
        republish_seconds: float = DEFAULT_REPUBLISH_SECONDS,
        republish_requests: int = DEFAULT_REPUBLISH_REQUESTS,
        republish_bytes: int = DEFAULT_REPUBLISH_BYTES,
        durability: BrokerDurability = LOCAL_DURABILITY,
    ) -> None:
        """Publish to ``broker_url``'s ``queue``; read (and wait on) ``store``.

        ``clock`` stamps the requests: by default the process's, which every client in the
        process shares (with the fences they read).

        ``transport_options`` go to kombu for brokers published to through Celery
        (``checkpointq.tasks.brokers.transport_options``: confirms on RabbitMQ, the master's name on
        Sentinel); ``from_settings`` fills them in.

        ``key_prefix`` names the pending records on the broker: the store's prefix by default
        (``store.keys``), as every producer and worker of the deployment must agree.

        ``compress_messages``: on a Redis broker, send each save's body as the zstd frame
        of its JSON under kombu's ``compression`` header (``compressed_body``: made from the
        record's value, it costs no second compression); False sends the JSON itself.

        ``stage_saves``: on a Redis broker, send each save as ``checkpoint.save_staged``:
        its stored value goes to the broker once, beside a message that names it, instead
        of in the message and again in its pending record (docs/protocol.md, "Staged
        saves"). Workers must know that task (this release on): upgrade them first.

        ``max_seq_ahead_seconds``: the workers' limit (``CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS``),
        which the broker applies at publish too: a request stamped further ahead of the
        broker's clock, or made while this producer's clock runs over half of it ahead, is
        refused at once (``SeqRefused``), never accepted and then dead-lettered.

        ``republish_*``: on a Redis broker, the recovery window (``CHECKPOINTQ_REPUBLISH_*``):
        the requests published in the last ``republish_seconds`` (at most
        ``republish_requests`` of them and ``republish_bytes`` of messages and values) are
        published again when this client finds the broker lost accepted requests
        (``epoch_changes`` counts each loss; ``pending.RecentPublishes``).

        ``durability``: when a save or delete counts as accepted
        (``CHECKPOINTQ_BROKER_DURABILITY``, ``broker_durability``): by default once the
        broker's primary has it; replicated, once that many replicas acknowledged it (WAIT,
        in the same write), else ``ReplicationTimeout``. Plain Redis brokers only.

        Encryption at rest (``store.options.encryption``): every save is staged, its value
        sealed here, so the checkpoint reaches the broker only encrypted (``stage_saves`` is
        then ignored). Other brokers carry the checkpoint in the message, so they are
        refused with encryption on (docs/security.md).

        Raises:
            EncryptionError: encryption is on and the broker is not a Redis broker.
            InvalidInput: ``durability`` is replicated and the broker is not a plain Redis
                (Celery's publish cannot send a WAIT on its connection).
        """
        super().__init__(
            broker_url,
            store,
            queue=queue,
            max_message_bytes=max_message_bytes,
            clock=clock,
            compress_messages=compress_messages,
            stage_saves=stage_saves,
        )
        self._transport_options = dict(transport_options or {})
        self._broker_url = broker_url
        # Redis brokers: our own protocol 2 messages over a pooled connection.
        self._publisher: fast_publish.RedisPublisher | None = None
        self._app: Celery | None = None
        #: The pending records on the broker (Redis brokers only): written by every save and
        #: delete, merged into every load and list.
        self.pending_records: PendingRecords | None = None
        self.durability = durability
        if fast_publish.supports(broker_url):
            # A replicated publish waits for its replicas on the publishing connection: its
            # socket wait and its whole budget grow by the WAIT's timeout.
            extra = durability.wait_seconds
            self._publisher = fast_publish.RedisPublisher(
                broker_url,
                queue,
                PUBLISH_RETRY_POLICY,
                socket_timeout=fast_publish.ATTEMPT_TIMEOUT + extra,
                timeout=fast_publish.PUBLISH_TIMEOUT + extra,
            )
            self.pending_records = self._publisher.pending = PendingRecords(
                self._publisher.client,
                store,
                self.record_keys(key_prefix),
                ttl_seconds=store.options.ttl_seconds,
                clock=self.clock,
                max_seq_ahead_seconds=max_seq_ahead_seconds,
                display_url=self._display_url,
                recent=RecentPublishes(republish_seconds, republish_requests, republish_bytes),
                durability=durability,
            )
        elif durability.is_replicated:
            raise InvalidInput(
                f"CHECKPOINTQ_BROKER_DURABILITY=replicated needs a plain Redis broker "
                f"(redis://, rediss://, unix://), not {self._display_url}: the WAIT must go "
                "on the publishing connection",
                field="durability",
            )
        elif self.encrypted:
            raise EncryptionError(
                f"encryption at rest needs a Redis broker (redis://, rediss://, unix://): on "
                f"{self._display_url} a save's checkpoint would travel in clear in its message"
            )
        else:
            self._app = self._celery_app()

    def _celery_app(self) -> Celery:
        """A private app used only to publish: JSON, protocol 2, no result backend.

        Celery is imported here, not with the module: on a Redis broker the producer needs
        none, and ``pip install checkpointq`` leaves whatever Celery the user runs alone.

        Raises:
            ImportError: Celery is not installed (it comes with ``checkpointq[worker]``).
        """
        try:
            from celery import Celery
        except ImportError as exc:
            raise ImportError(
                f"publishing to {self._display_url} goes through Celery, which is not "
                "installed: pip install 'checkpointq[worker]' (or any celery>=5.3)"
            ) from exc
        app = Celery("checkpointq-client", broker=kombu_url(self._broker_url), set_as_current=False)
        app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            task_ignore_result=True,
            result_backend=None,
            task_default_queue=self.queue,
            task_publish_retry=True,
            task_publish_retry_policy=PUBLISH_RETRY_POLICY,
            broker_connection_retry_on_startup=True,
            # Every wait bounded, as on the Redis fast path: connecting, and each answer.
            broker_connection_timeout=fast_publish.ATTEMPT_TIMEOUT,
            broker_transport_options=_bounded(self._broker_url, self._transport_options),
        )
        return app

    @classmethod
    def from_settings(cls, settings: ClientSettings) -> CheckpointClient:
        """A client for the deployment ``settings`` describe (broker URL must be set).

        Raises:
            StoreNotConfigured: no broker URL (a ``CheckpointError`` and a ``ValueError``).
        """
        broker_url, options = client_options(settings)
        transport = brokers.transport_options(
            broker_url,
            sentinel_master=settings.sentinel_master,
            sentinel_password=settings.sentinel_password,
        )
        return cls(
            broker_url, store_from_settings(settings), transport_options=transport, **options
        )

    def __repr__(self) -> str:
        return f"CheckpointClient({self._display_url}, queue={self.queue!r}, store={self.store!r})"

    # -- enqueue ------------------------------------------------------------------------

    def save(self, checkpoint: Checkpoint | dict[str, Any], *, after: int | None = None) -> Handle:
        """Enqueue a save stamped with a fresh causal ``seq``; return at once.

        ``after``: a fence ``seq`` read in another process (``load_with_fence``) that this
        save must sort after; fences read by this process count without it.

        Everything a worker would refuse deterministically is refused here, with the error
        it would record, so that a pending record never serves a value that cannot land.

        Raises:
            InvalidCheckpoint: not a valid checkpoint (checked here, before publishing).
            CheckpointTooLarge: even its newest message alone exceeds the store's
                stored-size budget (``max_value_bytes``), as the worker would find.
            InvalidInput: the request would exceed ``max_message_bytes``.
            SeqRefused: the broker refused it at once (this producer's clock runs ahead of
                the broker's, or ``after`` is too far ahead): nothing was queued.
            BrokerUnavailable: the broker stayed unreachable through the publish retries.
            ReplicationTimeout: ``durability`` replicated, and the primary took it but not
                enough replicas acknowledged it in time (``exc.handle`` is its handle).
        """
        publisher = self._publisher
        if publisher is None:
            return self.publish(self.requests.save(checkpoint, after, fast=False))
        # (a staged value is written only by the pending records' script: both or neither)
        # (encrypted, always: whatever ``stage_saves`` was set to since, a save message would
        # carry the checkpoint in clear)
        if publisher.pending is not None and (self.stage_saves or self.encrypted):
            return self.publish(self.requests.save_staged(checkpoint, after))
        return self.publish(self.requests.save(checkpoint, after, fast=True))

    def publish(self, publication: Publication) -> Handle:
        """Push ``publication`` (with its pending records, on a Redis broker); its handle.

        Raises:
            SeqRefused, BrokerUnavailable, ReplicationTimeout: as ``save``.
        """
        p = publication
        if (publisher := self._publisher) is not None:
            try:
                publisher.publish(
                    p.task, p.body, p.argsrepr, p.kwargsrepr, p.task_id, p.records, p.zstd_body
                )
            except ReplicationTimeout as exc:
                exc.handle = p.handle  # accepted by the primary: its outcome can be waited on
                raise
        else:
            self.send_encoded(p.task, p.body, p.argsrepr, p.kwargsrepr, task_id=p.task_id)
        return p.handle

    def send_sealed(self, session_id: str, seq: int, value: bytes) -> str:
        """Publish a staged save of an already sealed value under ``seq`` (the replay of an
        encrypted staged save's dead letter; ``Requests.send_sealed``); its task id.

        Raises:
            InvalidInput: the broker is not a Redis broker (staged saves need one).
            SeqRefused, BrokerUnavailable: as ``save``.
        """
        publisher = self._publisher
        if publisher is None or publisher.pending is None:
            raise InvalidInput(f"a staged save needs a Redis broker, not {self._display_url}")
        return self.publish(self.requests.send_sealed(session_id, seq, value)).task_id

    def staged_value(
        self, checkpoint: Checkpoint | dict[str, Any]
    ) -> tuple[Checkpoint, bytes, int]:
        """As ``Requests.staged_value`` (sealed with encryption on)."""
        return self.requests.staged_value(checkpoint)

    def prepare_save(
        self, checkpoint: Checkpoint | dict[str, Any]
    ) -> tuple[Checkpoint, bytes, EncodedCheckpoint]:
        """As ``Requests.prepare_save``: the checkpoint, its JSON and its stored value."""
        return self.requests.prepare_save(checkpoint)

    def encode(self, checkpoint: Checkpoint | dict[str, Any]) -> tuple[Checkpoint, bytes]:
        """As ``Requests.encode``: validated, and serialised once (with encryption on,
        the envelope counts against ``max_message_bytes``)."""
        return self.requests.encode(checkpoint)

    def delete(self, session_id: str, *, after: int | None = None) -> Handle:
        """Enqueue a delete stamped with a fresh causal ``seq``; return at once.

        Raises:
            SeqRefused, BrokerUnavailable, ReplicationTimeout: as ``save``.
        """
        return self.publish(self.requests.delete(session_id, after))

    def refresh(self, session_id: str) -> Handle:
        """Enqueue a TTL refresh (no rewrite); return at once."""
        validate_session_id(session_id)
        return Handle(self.send(REFRESH, [session_id], {}), REFRESH, session_id, None)

    def sweep(self) -> str:
        """Enqueue a sweep of expired sessions; return its task id."""
        return self.send(EXPIRE_STALE, [], {})

    def send(self, task: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """Publish ``task(*args, **kwargs)`` by name to the queue; return the task id.

        Raises:
            BrokerUnavailable: the broker stayed unreachable through the publish retries.
        """
        argsrepr, kwargsrepr = brief.repr(args), brief.repr(kwargs)
        if (publisher := self._publisher) is not None:
            body = messages.body(dumps_go(args), dumps_go(kwargs))
            return publisher.publish(task, body, argsrepr, kwargsrepr)
        return self._send_task(task, args, kwargs, argsrepr, kwargsrepr)

    def send_encoded(
        self,
        task: str,
        body: bytes,
        argsrepr: str,
        kwargsrepr: str = "{}",
        task_id: str | None = None,
        records: Sequence[RecordWrite] = (),
    ) -> str:
        """Publish ``task`` with a ready-made protocol 2 body (``messages.body``).

        On a Redis broker the bytes go out as they are, with ``records`` (the pending records
        of the requests the body carries) in the same script call; other brokers get them
        decoded and published through Celery (which encodes them again), without records.

        Raises:
            BrokerUnavailable: the broker stayed unreachable through the publish retries.
        """
        if (publisher := self._publisher) is not None:
            return publisher.publish(task, body, argsrepr, kwargsrepr, task_id, records)
        args, kwargs, _embed = orjson.loads(body)
        return self._send_task(task, args, kwargs, argsrepr, kwargsrepr, task_id=task_id)

    def _send_task(
        self,
        task: str,
        args: list[Any],
        kwargs: dict[str, Any],
        argsrepr: str,
        kwargsrepr: str,
        task_id: str | None = None,
    ) -> str:
        from kombu.exceptions import OperationalError  # installed with Celery

        if self._app is None:
            self._app = self._celery_app()
        try:
            result = self._app.send_task(
                task,
                args=args,
                kwargs=kwargs,
                queue=self.queue,
                retry=True,
                retry_policy=PUBLISH_RETRY_POLICY,
                argsrepr=argsrepr,
                kwargsrepr=kwargsrepr,
                task_id=task_id,
            )
        except OperationalError as exc:
            raise BrokerUnavailable(
                f"could not publish {task} to {self._display_url}: {exc}"
            ) from exc
        return str(result.id)

    # -- read-your-writes ---------------------------------------------------------------

    def wait_durable(
        self, handle: Handle, timeout: float = 10.0, interval: float = 0.01
    ) -> RequestOutcome:
        """Block until ``handle``'s own outcome is known: applied, superseded by a request
        ordered after it, expired (a save past its deadline, never stored), or lost (its
        message was gone while its record stayed, a purge: ``outcomes``).

        Raises:
            ValueError: the handle has no ``seq`` (a refresh).
            RequestRefused: a worker dead-lettered the request (kind, reason, entry id).
            TimeoutError: no outcome within ``timeout`` seconds.
            StoreUnavailable: the store could not be read.
        """
        poll = self.requests.poll(handle, timeout, interval)
        while True:
            fence, refusal = self.store.request_outcome(handle.session_id, handle.request)
            self.check_store()
            if refusal is None and not self.store.keeps_refusals and self.pending_records:
                refusal = self.pending_records.refusal(handle.session_id, handle.request)
            outcome = poll.judge(fence, refusal)
            if outcome is not None:
                return outcome
            time.sleep(poll.pause(fence))

    # -- reads --------------------------------------------------------------------------

    def load(self, session_id: str) -> Checkpoint | None:
        """The newest accepted write of the session: its pending request when the queue
        still holds one, else the store's live checkpoint (None when absent, expired or
        deleted, or when the newest accepted request is a delete).

        The session's fence comes with it, so a save or delete this process makes next
        sorts after what was loaded.

        Raises:
            BrokerUnavailable: the pending records could not be read (a separate broker):
                the store alone might miss an accepted write.
            StoreUnavailable: the store could not be read.
        """
        return self.load_with_fence(session_id)[0]

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """The checkpoint and the fence of what was loaded: the pending record's ``seq``
        when the record answered. One round trip when broker and store are one Redis, two
        otherwise. Pass ``fence.seq`` as ``after=`` to a save made in another process from
        what was loaded here. Raises as ``load``."""
        if self.pending_records is None:
            checkpoint, fence = self.store.load_with_fence(session_id)
        else:
            checkpoint, fence = self.pending_records.load(session_id)
        self.check_store()
        if fence is not None:
            self.clock.observe(session_id, fence.seq)
        return checkpoint, fence

    def list(self) -> list[str]:
        """Every live session id: the store's, with the pending saves and without the
        pending deletes (sorted when merged). Raises as ``load``."""
        if self.pending_records is None:
            return self.store.list()
        sessions = self.pending_records.list()
        self.check_store()
        return sessions

    def check_store(self) -> None:
        """Compare this client's store with the one the broker's workers publish, after
        each read until they agree (``checkpointq.tasks.store_identity``): a read from
        another store than theirs raises instead of answering. After the read, so that a
        server that does not answer fails the read itself; a comparison that cannot be
        made (a store refusing writes cannot make its identity) waits for the next read.

        Raises:
            StoreMismatch: they are two stores (naming both).
        """
        check, publisher = self.store_check, self._publisher
        if publisher is None or self.pending_records is None or not check.due():
            return
        key = self.pending_records.keys.published_store()
        try:
            mine = self.store.identity()  # first: an announcement made after it counts
            published = store_identity.PublishedStore.decode(publisher.client.get(key))
        except (redis_errors.RedisError, CheckpointError):
            check.unknown()
            return
        check.compare(mine, repr(self.store), published, self._display_url)

    @property
    def epoch_changes(self) -> int:
        """How many times this client found the broker had lost accepted requests: all of
        them (a restart without persistence) or a suffix (a crash inside its fsync window,
        a failover to a lagging replica, found by the pending mark going back;
        ``checkpointq_pending_epoch_changes_total``). Each is logged, and the requests this
        client published within its recovery window are published again."""
        return 0 if self.pending_records is None else self.pending_records.epochs.changes

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
        if self._app is not None:
            self._app.close()
        self.store.close()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
