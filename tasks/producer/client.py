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

import reprlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from checkpointq.store.base import CheckpointStore, EncodedCheckpoint, Fence, StoreOptions
from checkpointq.store.codec import zstd_bound
from checkpointq.store.errors import InvalidInput
from checkpointq.store.factory import store_from_settings
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.store.serde import checkpoint_from_wire, dumps_go, serialize_checkpoint
from checkpointq.store.urls import kombu_url, redact_url
from checkpointq.tasks import brokers, messages
from checkpointq.tasks.errors import BrokerUnavailable, RequestRefused

# The task names are the contract (docs/protocol.md); the client does not import the tasks.
from checkpointq.tasks.messages import DELETE, EXPIRE_STALE, REFRESH, SAVE, SAVE_STAGED
from checkpointq.tasks.producer import compressed_body, fast_publish
from checkpointq.tasks.producer.clock import SeqClock, seq_clock
from checkpointq.tasks.producer.outcomes import APPLIED, RequestOutcome, Trimmed, decide

if TYPE_CHECKING:
    from celery import Celery
from checkpointq.tasks.producer.pending import (
    DEFAULT_MAX_SEQ_AHEAD_SECONDS,
    DELETE_OP,
    SAVE_OP,
    PendingRecords,
    RecordWrite,
)

#: How hard a publish tries while the broker is unreachable (kombu retry policy): about
#: three seconds in all, then BrokerUnavailable.
PUBLISH_RETRY_POLICY: dict[str, float] = {
    "max_retries": 5,
    "interval_start": 0,
    "interval_step": 0.5,
    "interval_max": 1.0,
}


class ClientSettings(Protocol):
    """What ``from_settings`` reads; ``checkpointq.worker.settings.Settings`` has all of it."""

    broker_url: str | None
    key_prefix: str
    pg_schema: str
    pg_auto_upgrade: bool
    queue: str
    max_message_bytes: int
    compress_messages: bool
    stage_saves: bool
    max_seq_ahead_seconds: float
    sentinel_master: str | None
    sentinel_password: str | None

    @property
    def resolved_store_url(self) -> str | None: ...

    def store_options(self) -> StoreOptions: ...


@dataclass(frozen=True, slots=True)
class Handle:
    """A request on its way: pass it to ``wait_durable``. ``seq`` is None for refreshes.

    ``task_id`` is the message's id; ``request_id`` names the request itself: the same for a
    single request, ``"<batch task id>:<index>"`` for an item of a batch (empty: the task id).
    """

    task_id: str
    task: str
    session_id: str
    seq: int | None
    request_id: str = ""
    #: A save whose history the store will trim (as this producer encoded it): how and why.
    trimmed: Trimmed | None = None

    @property
    def request(self) -> str:
        """The id the fence and the refusal records know this request by."""
        return self.request_id or self.task_id


# Celery puts a repr of the arguments (up to 1 KB, built by walking all of them) in every
# message's headers for logs and Flower; a few dozen characters say as much.
_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxdict, _brief.maxlist, _brief.maxstring = 2, 4, 4, 40


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


class CheckpointClient:
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
        """
        self._transport_options = dict(transport_options or {})
        self.clock = clock or seq_clock
        self.store = store
        self.queue = queue
        self.max_message_bytes = max_message_bytes
        self.compress_messages = compress_messages
        self.stage_saves = stage_saves
        self._display_url = redact_url(broker_url)
        self._broker_url = broker_url
        # Redis brokers: our own protocol 2 messages over a pooled connection.
        self._publisher: fast_publish.RedisPublisher | None = None
        self._app: Celery | None = None
        #: The pending records on the broker (Redis brokers only): written by every save and
        #: delete, merged into every load and list.
        self.pending_records: PendingRecords | None = None
        if fast_publish.supports(broker_url):
            self._publisher = fast_publish.RedisPublisher(broker_url, queue, PUBLISH_RETRY_POLICY)
            store_keys = getattr(store, "keys", None)
            prefix = key_prefix or getattr(store_keys, "prefix", None)
            keys = KeySpace(prefix) if prefix else KeySpace()
            self.pending_records = self._publisher.pending = PendingRecords(
                self._publisher.client,
                store,
                keys,
                ttl_seconds=store.options.ttl_seconds,
                clock=self.clock,
                max_seq_ahead_seconds=max_seq_ahead_seconds,
                display_url=self._display_url,
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
            ValueError: no broker URL (resolve the embedded one first, as the CLI does).
        """
        if not settings.broker_url:
            raise ValueError(
                "no broker URL: set CHECKPOINTQ_BROKER_URL, or run `checkpointq up` in this "
                "directory (Settings() finds its embedded Redis)"
            )
        store = store_from_settings(settings)
        return cls(
            settings.broker_url,
            store,
            queue=settings.queue,
            max_message_bytes=settings.max_message_bytes,
            compress_messages=settings.compress_messages,
            stage_saves=settings.stage_saves,
            max_seq_ahead_seconds=settings.max_seq_ahead_seconds,
            key_prefix=settings.key_prefix,
            transport_options=brokers.transport_options(
                settings.broker_url,
                sentinel_master=settings.sentinel_master,
                sentinel_password=settings.sentinel_password,
            ),
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
        """
        publisher = self._publisher
        # (a staged value is written only by the pending records' script: both or neither)
        if publisher is not None and publisher.pending is not None and self.stage_saves:
            return self._save_staged(publisher, checkpoint, after)
        cp, document, stored = self.prepare_save(checkpoint)
        seq = self.clock.next(cp.session_id, after)
        argsrepr = f"[<checkpoint {cp.session_id!r} v{cp.version}, {len(document)} bytes>]"
        kwargsrepr = f"{{'seq': {seq}}}"
        task_id = fast_publish.new_id()
        record = RecordWrite(cp.session_id, seq, SAVE_OP, task_id, stored.value)
        if publisher is not None:
            # The record's value is the zstd frame of ``document`` unless the store trimmed it.
            prefix, suffix = messages.save_body_framing(seq)
            zstd_body = (
                compressed_body.enclose(stored.value, prefix, suffix)
                if self.compress_messages and not stored.trimmed
                else None
            )
            body = b"".join((prefix, document, suffix))
            publisher.publish(SAVE, body, argsrepr, kwargsrepr, task_id, [record], zstd_body)
        else:
            body = messages.save_body(document, seq)
            self.send_encoded(SAVE, body, argsrepr, kwargsrepr, task_id=task_id)
        trimmed = self._trimmed(cp, stored.trimmed)
        return Handle(task_id, SAVE, cp.session_id, seq, trimmed=trimmed)

    def _save_staged(
        self,
        publisher: fast_publish.RedisPublisher,
        checkpoint: Checkpoint | dict[str, Any],
        after: int | None,
    ) -> Handle:
        """``save`` as ``checkpoint.save_staged``: the value goes to the broker once, under
        the request's id, and the message names it (docs/protocol.md, "Staged saves")."""
        cp, value, trimmed = self.staged_value(checkpoint)
        seq = self.clock.next(cp.session_id, after)
        task_id = fast_publish.new_id()
        body = messages.save_staged_body(dumps_go(cp.session_id), seq, trimmed)
        argsrepr = f"[<checkpoint {cp.session_id!r} v{cp.version}, staged {len(value)} bytes>]"
        kwargsrepr = f"{{'seq': {seq}}}"
        record = RecordWrite(cp.session_id, seq, SAVE_OP, task_id, value, staged=True)
        publisher.publish(SAVE_STAGED, body, argsrepr, kwargsrepr, task_id, [record])
        return Handle(task_id, SAVE_STAGED, cp.session_id, seq, trimmed=self._trimmed(cp, trimmed))

    def _trimmed(self, checkpoint: Checkpoint, trimmed: int) -> Trimmed | None:
        history_cap = self.store.options.history_cap
        return Trimmed.of(len(checkpoint.conversation_history), trimmed, history_cap)

    def staged_value(
        self, checkpoint: Checkpoint | dict[str, Any]
    ) -> tuple[Checkpoint, bytes, int]:
        """The value a staged save puts on the broker, and how many messages it trimmed: the
        checkpoint's JSON as it is, when it is within the history cap and could not exceed
        the stored-size budget however it compresses (the worker compresses it, as it
        would a message's checkpoint); else the store's own ``encode`` (trimmed, zstd).

        Raises:
            InvalidCheckpoint, InvalidInput, CheckpointTooLarge: as ``prepare_save``.
        """
        cp, document = self.encode(checkpoint)
        options = self.store.options
        if (
            len(cp.conversation_history) <= options.history_cap
            and zstd_bound(len(document)) <= options.max_value_bytes
        ):
            return cp, document, 0
        stored = self.store.encode(cp, document)
        return cp, stored.value, stored.trimmed

    def prepare_save(
        self, checkpoint: Checkpoint | dict[str, Any]
    ) -> tuple[Checkpoint, bytes, EncodedCheckpoint]:
        """``encode``, and the value the store will hold (the store's own ``encode``: the
        history trimmed to the cap and the stored-size budget, compressed).

        Raises:
            InvalidCheckpoint, InvalidInput: as ``encode``.
            CheckpointTooLarge: it cannot fit the stored-size budget.
        """
        cp, document = self.encode(checkpoint)
        return cp, document, self.store.encode(cp, document)

    def encode(self, checkpoint: Checkpoint | dict[str, Any]) -> tuple[Checkpoint, bytes]:
        """Validate ``checkpoint`` and serialise it once: the Go JSON that both the size
        check and the message carry.

        Raises:
            InvalidCheckpoint: not a valid checkpoint.
            InvalidInput: its JSON exceeds ``max_message_bytes``.
        """
        cp = checkpoint if isinstance(checkpoint, Checkpoint) else checkpoint_from_wire(checkpoint)
        document = serialize_checkpoint(cp)
        if len(document) > self.max_message_bytes:
            raise InvalidInput(
                f"checkpoint is {len(document)} bytes as JSON; the limit is "
                f"{self.max_message_bytes}",
                field="checkpoint",
            )
        return cp, document

    def delete(self, session_id: str, *, after: int | None = None) -> Handle:
        """Enqueue a delete stamped with a fresh causal ``seq``; return at once.

        Raises:
            SeqRefused, BrokerUnavailable: as ``save``.
        """
        validate_session_id(session_id)
        seq = self.clock.next(session_id, after)
        body = messages.body(dumps_go([session_id]), messages.seq_kwargs(seq))
        task_id = fast_publish.new_id()
        record = RecordWrite(session_id, seq, DELETE_OP, task_id)
        argsrepr, kwargsrepr = _brief.repr([session_id]), f"{{'seq': {seq}}}"
        self.send_encoded(DELETE, body, argsrepr, kwargsrepr, task_id=task_id, records=[record])
        return Handle(task_id, DELETE, session_id, seq)

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
        argsrepr, kwargsrepr = _brief.repr(args), _brief.repr(kwargs)
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
        ordered after it, or expired (a save past its deadline, never stored; ``outcomes``).

        Raises:
            ValueError: the handle has no ``seq`` (a refresh).
            RequestRefused: a worker dead-lettered the request (kind, reason, entry id).
            TimeoutError: no outcome within ``timeout`` seconds.
            StoreUnavailable: the store could not be read.
        """
        if handle.seq is None:
            raise ValueError(f"{handle.task} requests carry no seq to wait for")
        request = handle.request
        deadline = time.monotonic() + timeout
        delay = interval
        while True:
            fence, refusal = self.store.request_outcome(handle.session_id, request)
            records = self.pending_records
            if refusal is None and not self.store.keeps_refusals and records is not None:
                refusal = records.refusal(handle.session_id, request)
            if fence is not None:
                self.clock.observe(handle.session_id, fence.seq)
            # The fence first: it is the session's own, while a refusal names a request id.
            outcome = decide(handle.task, request, handle.seq, fence, self._lapsed(handle.seq))
            if outcome is not None:
                if outcome.outcome == APPLIED and handle.trimmed is not None:
                    return replace(outcome, trimmed=handle.trimmed)
                return outcome
            if refusal is not None and refusal.names(handle.seq):
                description = f"{handle.task} {request} for session {handle.session_id!r}"
                raise RequestRefused(description, refusal.kind, refusal.reason, refusal.entry)
            if time.monotonic() >= deadline:
                at = "no fence" if fence is None else f"fence at seq {fence.seq}"
                raise TimeoutError(
                    f"{handle.task} {request} for session {handle.session_id!r} (seq "
                    f"{handle.seq}) not applied within {timeout}s ({at})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _lapsed(self, seq: int) -> bool:
        """Whether a request stamped ``seq`` is certainly past its deadline (by this
        producer's clock, less the store's tombstone margin for clocks that disagree)."""
        store = self.store
        return store.lapsed(seq, self.clock.now_us() // 1000 - store.tombstone_ms)

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
        if fence is not None:
            self.clock.observe(session_id, fence.seq)
        return checkpoint, fence

    def list(self) -> list[str]:
        """Every live session id: the store's, with the pending saves and without the
        pending deletes (sorted when merged). Raises as ``load``."""
        if self.pending_records is None:
            return self.store.list()
        return self.pending_records.list()

    @property
    def epoch_changes(self) -> int:
        """How many times this client found the broker had lost its pending records (a
        restart without persistence; ``checkpointq_pending_epoch_changes_total``)."""
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
