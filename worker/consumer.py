"""A Celery consumer that dead-letters what it cannot hand to a task, instead of dropping it.

Stock Celery logs and discards unknown task names (``on_unknown_task``), messages without a
task header (``on_unknown_message``), refused content types such as pickle
(``on_invalid_task``) and bodies it cannot decode (``on_decode_error``, which has no signal).
We override those four hooks: record a dead letter with the raw body, then discard the
message as Celery would (and send its ``task_rejected``/``task_unknown`` signals). If the
dead letter cannot be written (store Redis down) the message is left unacknowledged: Redis
redelivers it after the visibility timeout, so it is not lost; and the worker stops taking
messages until the store accepts writes again (``worker/backpressure.py``).

Oversize bodies are refused here too, before anything decodes them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import bootsteps, signals
from celery.exceptions import WorkerShutdown, WorkerTerminate
from celery.worker.consumer import Consumer
from redis import exceptions as redis_errors

from checkpointq.store import probe
from checkpointq.store.errors import StoreUnavailable
from checkpointq.tasks import messages, observers, runtime
from checkpointq.tasks.dead_letters import Reason, RefusedRequest
from checkpointq.tasks.refusals import refuse
from checkpointq.worker import backpressure, compressed_bodies, lost_settles, timing
from checkpointq.worker.hooks import celery as celery_hooks
from checkpointq.worker.hooks import kombu as kombu_hooks

logger = logging.getLogger(__name__)

#: kombu's Message (kombu's hints are partial; we use body, headers, content_type, ack).
Message = Any

#: The namespace of the tasks Celery registers on every app (``celery.app.builtins``).
CELERY_BUILTINS = "celery."


def _refused(
    session_id: str | None,
    task_id: str | None,
    args: list[Any] | None,
    kwargs: dict[str, Any] | None,
) -> list[RefusedRequest]:
    """The request a refused message stands for, when its body names its session."""
    if not session_id or not task_id:
        return []
    return [RefusedRequest(session_id, task_id, messages.requested_seq(args or [], kwargs or {}))]


def _describe(message: Message) -> tuple[str | None, str | None]:
    """Task name and id from protocol 2 headers, else from a protocol 1 body, if any."""
    headers = message.headers or {}
    if isinstance(headers, dict) and "task" in headers:
        return headers.get("task"), headers.get("id")
    try:
        payload = json.loads(message.body)
    except (TypeError, ValueError):
        return None, None
    if isinstance(payload, dict):  # protocol 1: the task name and id are in the body
        return payload.get("task"), payload.get("id")
    return None, None


def _arguments(message: Message) -> tuple[list[Any] | None, dict[str, Any] | None]:
    """The call's args and kwargs if the body is JSON in protocol 2 or 1 shape."""
    if message.content_type != messages.JSON:
        return None, None
    try:
        parsed = messages.arguments(json.loads(message.body))
    except (TypeError, ValueError):
        return None, None
    return parsed or (None, None)


def _raw(message: Message) -> bytes:
    body = message.body
    if body is None:
        return b""
    return body if isinstance(body, bytes) else str(body).encode("utf-8", "surrogateescape")


#: Deepest JSON nesting accepted in a task body. Celery pickles the arguments to hand them
#: to a pool process, and pickling recurses once per level: a body nested ~700 levels deep
#: raised RecursionError in the worker's main process, which exited ("Unrecoverable
#: error"), and took the message down with it again after every restart. Real checkpoints
#: nest a handful of levels.
MAX_NESTING = 128

# A JSON string, written as "unrolled loop" (runs of plain characters between escapes): Python's
# re engine matches it ~4x faster than one alternation per character (1.3 MB: 4.5 vs 20 ms).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _more_openings_than(body: bytes, limit: int) -> bool:
    """Whether ``body`` holds more than ``limit`` opening brackets.

    ``bytes.find`` of one byte is a ``memchr``; with few brackets, finding each is twice as
    fast as ``bytes.count``'s byte-by-byte loop (~9 against ~20 us for a 20 KB save body),
    and it stops at the limit.
    """
    found = 0
    for opening in (b"[", b"{"):
        at = body.find(opening)
        while at != -1:
            found += 1
            if found > limit:
                return True
            at = body.find(opening, at + 1)
    return False


def _json_depth(message: Message) -> int:
    """How deeply a JSON body nests, without decoding it: 0 for other content types and for
    bodies with too few brackets to nest deeper than ``MAX_NESTING``."""
    if message.content_type != messages.JSON or not message.body:
        return 0
    body = message.body if isinstance(message.body, bytes) else str(message.body).encode()
    # Nesting never exceeds the number of opening brackets, and counting them is ~100x
    # cheaper than the scan below: a typical checkpoint has far fewer than the limit, so
    # only bodies that could be too deep pay for the exact depth.
    if not _more_openings_than(body, MAX_NESTING):
        return 0
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(_STEP[b] for b in brackets), default=0)


def forget_locally(channel: Any, tag: Any) -> None:
    """Free a delivered message's prefetch slot without telling the broker anything.

    kombu's virtual (Redis) QoS keeps that bookkeeping; the broker's ``unacked`` entry
    stays, so the visibility timeout redelivers the message. Other transports have no such
    bookkeeping, and then this does nothing.
    """
    kombu_hooks.forget_locally(channel, tag)


def _settle_later(channel: Any, tag: Any, requeue: bool) -> None:
    """Free a message's prefetch slot now; the lost settles do its ack or requeue on a
    connection that reaches the broker."""
    forget_locally(channel, tag)
    lost_settles.lost.lost_settle(tag, requeue=requeue)


def _release_slot_when_broker_lost(
    message: Message, errors: tuple[type[BaseException], ...]
) -> None:
    """Free the message's prefetch slot even when its ack or requeue cannot reach Redis.

    kombu's Redis QoS forgets a delivered message only after removing it from the broker's
    ``unacked`` hash; when the broker is unreachable that removal raises, Celery logs
    "Couldn't ack", and the slot stays taken for good. Once every slot of the prefetch
    window is taken that way, the worker never polls the broker again, so it never notices
    the broker came back: it sits idle with work queued until it is restarted. Forgetting
    the message locally is safe: if the broker kept its ``unacked`` entry, the visibility
    timeout redelivers it, and a replayed request is harmless (writes are fenced).

    The wrappers live on the message and reach it only through a weak reference: a strong
    one would make a reference cycle, and every message, with its whole body, would then be
    freed by the cyclic garbage collector long after its ack instead of at once. With 260 KB
    envelopes that grew the main process by ~4 MB per 300 messages (bench, memory section).
    One ``weakref.ref`` and the two methods' functions are what ``weakref.WeakMethod`` keeps,
    made once instead of twice (its Python constructor was ~5% of the main process).
    """
    target = weakref.ref(message)
    # (``__func__`` of a bound method, as WeakMethod takes it: anything else raises here too)
    ack, reject = message.ack.__func__, message.reject.__func__
    channel, tag = message.channel, message.delivery_tag

    def settle(method: Callable[..., Any], **options: bool) -> None:
        settled = target()
        if settled is None:
            # The QoS holds each message until it is settled or forgotten: a message that
            # no longer exists has nothing left to settle.
            return
        requeue = options.get("requeue", False)
        if kombu_hooks.detached(channel):
            # Delivered before a consumer restart, settled after it (a pool result that
            # arrived once the lost connection was closed): the old channel cannot reach
            # the broker, and kombu would fail with AttributeError, which ended the worker.
            # The restart's restore put the message back, or the lost settles will.
            _settle_later(channel, tag, requeue)
            logger.info("%s settled after its connection closed: settled on the next one", tag)
            return
        try:
            method(settled, **options)
        except errors:
            _settle_later(channel, tag, requeue)
            raise
        except redis_errors.RedisError as exc:
            refusal = probe.refused(exc)
            if refusal is None:
                raise
            # The broker answered and refused (out of memory, read-only): the message stays
            # in its ``unacked`` hash, settled again once the broker takes writes, and the
            # worker holds still until then. Raising would end the consumer (this is no
            # connection error to Celery).
            _settle_later(channel, tag, requeue)
            logger.warning("broker refused to settle %s (%s): left for redelivery", tag, refusal)
            backpressure.trip_broker(refusal)

    def ack_or_forget(multiple: bool = False) -> None:
        settle(ack, multiple=multiple)

    def reject_or_forget(requeue: bool = False) -> None:
        settle(reject, requeue=requeue)

    message.ack, message.reject = ack_or_forget, reject_or_forget


def _leave_for_redelivery(message: Message) -> None:
    """Free the message's prefetch slot, but leave it unacknowledged on the broker.

    Used when its dead letter cannot be written (store down): acking would lose it, and
    holding it would keep the slot taken for good, so after a few such messages the worker
    would stop consuming even once the store is back. kombu's Redis QoS forgets it locally;
    the broker's ``unacked`` entry stays, and the visibility timeout redelivers it. Only
    virtual transports (Redis) have that local bookkeeping; on RabbitMQ the message stays
    held until the connection closes, as before.
    """
    forget_locally(message.channel, message.delivery_tag)


#: Seconds a worker whose consumer failed unexpectedly has to shut down before it exits
#: anyway (Celery's own stop runs first; a supervisor restarts the process).
EXIT_GRACE = 20.0
#: Exit status then: EX_SOFTWARE, "internal software error".
EXIT_STATUS = 70
_STOPPING = (bootsteps.CLOSE, bootsteps.TERMINATE)


def _exit_soon(exc: BaseException) -> None:
    """Exit the process in ``EXIT_GRACE`` seconds, whatever Celery's shutdown is doing."""
    logger.critical(
        "consumer failed unexpectedly (%s: %s): the worker exits for its supervisor to "
        "restart it; what it held is redelivered",
        type(exc).__name__,
        exc,
    )
    timer = threading.Timer(EXIT_GRACE, os._exit, (EXIT_STATUS,))
    timer.daemon = True
    timer.start()


class DeadLetteringConsumer(Consumer):  # type: ignore[misc]  # celery ships no type hints
    """Celery's consumer, with every refused message recorded as a dead letter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Items that are not Celery messages at all never reach this class: kombu decodes
        # them in its Redis reader, which must dead-letter them rather than crash the worker.
        kombu_hooks.install()
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        """Celery's consumer loop, which restarts itself on a lost connection; here also on
        a write the broker refused anywhere else, and an error nothing expected ends the
        process, so that its supervisor starts a fresh one.

        Celery treats any other error as fatal, and its shutdown after one could hang (a
        live process that consumes nothing and ignores SIGTERM, seen with a refused
        reject): after ``EXIT_GRACE`` seconds the process exits whatever is still running.
        What it held stays in the broker's ``unacked`` hash and is redelivered.
        """
        while True:
            try:
                super().start()
                return
            except (WorkerShutdown, WorkerTerminate):
                raise
            except redis_errors.RedisError as exc:
                refusal = probe.refused(exc)
                if refusal is None or self.blueprint.state in _STOPPING:
                    _exit_soon(exc)
                    raise
                logger.warning("broker refused a write (%s): restarting the consumer", refusal)
                backpressure.trip_broker(refusal)
                # What Celery's loop does after a lost connection (its start() restarts).
                if self.connection:
                    self.on_connection_error_after_connected(exc)
                else:
                    self.on_connection_error_before_connected(exc)
                self.on_close()
                celery_hooks.cancel_connection_timers(self)
                self.blueprint.restart(self)
            except Exception as exc:
                _exit_soon(exc)
                raise

    def on_close(self) -> None:
        """Celery's clean-up before it reconnects, which flushes the pool: the coalescer's
        groups no process had started are dropped there without a callback."""
        super().on_close()
        coalescer = getattr(self, "_checkpointq_coalescer", None)  # (worker/coalesce.py's)
        if coalescer is not None:
            coalescer.pool_flushed()

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        """Celery's clean-up of a lost connection, which must never end the worker.

        Closing the lost connection restores what its channel held, and kombu can fail
        there with more than a connection error (with the broker down, kombu 5.7's
        restore reaches a transport that ``collect()`` already detached: AttributeError
        on ``conninfo.hostname``), which Celery's ``ignore_errors`` lets through and
        which ended the worker on a broker restart. The connection is discarded either
        way; what it held stays in the broker's ``unacked`` hash for redelivery.
        """
        try:
            super().on_connection_error_after_connected(exc)
        except Exception as cleanup:
            self.connection = None
            logger.warning(
                "closing the lost broker connection failed (%s: %s); reconnecting anyway",
                type(cleanup).__name__,
                cleanup,
            )

    def update_strategies(self) -> None:
        """Celery's task table without Celery's builtins (``celery.map``, ``celery.group``,
        ``celery.chord_unlock``, ``celery.backend_cleanup``...): every app registers them,
        and a message naming one would run it, applying saves through ``celery.map`` or
        failing in the pool. Here such a message is an unknown task, dead-lettered as any
        name we do not own."""
        super().update_strategies()
        for name in [name for name in self.strategies if name.startswith(CELERY_BUILTINS)]:
            del self.strategies[name]

    def _record(
        self, message: Message, kind: Reason, reason: str, *, with_arguments: bool = False
    ) -> bool:
        """Write the dead letter (with the call's arguments, decoded, if asked: what makes
        it replayable); False (and the message left unacked) if that failed."""
        task, task_id = _describe(message)
        args, kwargs = _arguments(message) if with_arguments else (None, None)
        headers = message.headers if isinstance(message.headers, dict) else {}
        # A refusal record for the producer waiting on it, where the body names its session.
        session_id = messages.requested_session(task, args or [], kwargs or {})
        try:
            refuse(
                kind,
                reason,
                task=task,
                task_id=task_id,
                args=args,
                kwargs=kwargs,
                requests=_refused(session_id, task_id, args, kwargs),
                raw=_raw(message),
                headers={
                    **headers,
                    "content-type": message.content_type,
                    "content-encoding": message.content_encoding,
                },
            )
        except StoreUnavailable as exc:
            logger.error("left %s [%s] unacknowledged for redelivery", task, task_id)
            _leave_for_redelivery(message)
            backpressure.trip(str(exc))
            return False
        return True

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)
        limit = runtime.current().max_message_bytes
        max_eta_ahead = runtime.current().max_eta_ahead_seconds

        def on_task_received(message: Message) -> Any:
            _release_slot_when_broker_lost(message, self.connection_errors)
            size = len(message.body or b"")
            # The task name from the headers only: decoding a protocol 1 body just to label
            # its size is not worth it (those are counted under task "other").
            headers = message.headers if isinstance(message.headers, dict) else {}
            observers.notify_received(
                observers.Received(observers.task_label(headers.get("task")), size)
            )
            if size > limit:
                kind = Reason.OVERSIZE
                reason = f"message body is {size} bytes; the limit is {limit}"
            elif (depth := _json_depth(message)) > MAX_NESTING:
                kind = Reason.INVALID_INPUT
                reason = f"JSON nested {depth} levels deep; the limit is {MAX_NESTING}"
            elif timed := timing.refusal(headers, datetime.now(UTC), max_eta_ahead):
                # A valid call at the wrong time: kept with its arguments, for replay.
                if self._record(message, *timed, with_arguments=True):
                    message.ack_log_error(logger, self.connection_errors)
                return None
            else:
                timing.forget_expiry(headers)
                if isinstance(message.headers, dict):
                    # For a dead letter's raw payload (tasks/checkpoints.py). The same bytes
                    # object as the body Celery already sends to the pool process, so the
                    # pickle carrying both holds it once.
                    message.headers[messages.RAW_BODY_FIELD] = message.body
                return handle(message)
            if self._record(message, kind, reason):
                message.ack_log_error(logger, self.connection_errors)
            return None

        return on_task_received

    # Stock Celery logs each of these at ERROR or CRITICAL with the whole body and a
    # traceback, then discards the message. Ours logs one WARNING line (DeadLetters.add) and
    # discards it only once the dead letter is safely written; the signals still fire.

    def _discard(self, message: Message) -> None:
        message.reject_log_error(logger, self.connection_errors)

    def on_unknown_message(self, body: Any, message: Message) -> None:
        if self._record(message, Reason.UNDECODABLE, "not a task message (no task name)"):
            self._discard(message)
            signals.task_rejected.send(sender=self, message=message, exc=None)

    def on_unknown_task(self, body: Any, message: Message, exc: BaseException) -> None:
        reason = f"no task registered as {exc}"
        if self._record(message, Reason.UNKNOWN_TASK, reason, with_arguments=True):
            self._discard(message)
            task, task_id = _describe(message)
            signals.task_unknown.send(sender=self, message=message, exc=exc, name=task, id=task_id)

    def on_invalid_task(self, body: Any, message: Message, exc: BaseException) -> None:
        if self._record(message, Reason.UNDECODABLE, f"{type(exc).__name__}: {exc}"):
            self._discard(message)
            signals.task_rejected.send(sender=self, message=message, exc=exc)

    def on_decode_error(self, message: Message, exc: BaseException) -> None:
        if isinstance(exc, compressed_bodies.BodyTooLarge):
            recorded = self._record(message, Reason.OVERSIZE, str(exc))
        else:
            recorded = self._record(message, Reason.UNDECODABLE, f"{type(exc).__name__}: {exc}")
        if recorded:
            self._discard(message)
