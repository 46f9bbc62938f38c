"""Worker-side coalescing: single saves and deletes from any producer, applied in groups.

Celery's per-message cost is several times the store's own work for a 20 KB save, and most
producers (Go, Node, raw ``LPUSH``) send one request per message. So the main process groups
the ``checkpoint.save`` and ``checkpoint.delete`` messages it reserves (up to ``max_items``),
hands their raw bodies to one pool process as one job
(``checkpointq.tasks.coalesced.apply_requests``: one pipelined round trip, each item fenced
by its own ``seq``), and acknowledges each message only once its own item is durable, so
delivery guarantees stay those of one task per message. A group goes at the end of the event
loop's turn when nothing is in the pool, after ``window`` while another group is, the moment
a pool process frees up while all are busy, and at once when full. Anything a group cannot
apply runs again as the single task it is (``single_task``: monitors see it received once,
and dead letters, retries and refusals keep their one path); retries, ETA, expiry and
protocol 1 never enter a group. Only the prefork and solo pools coalesce. docs/design.md
has the rules in full and why not ``celery-batches``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.utils.imports import symbol_by_name
from celery.worker import state as worker_state
from celery.worker.strategy import create_request_cls
from celery.worker.strategy import default as default_strategy
from kombu.exceptions import ContentDisallowed, DecodeError
from redis import exceptions as redis_errors
from redis.exceptions import NoScriptError

from checkpointq.store import probe, redis_hooks
from checkpointq.store.keys import KeySpace
from checkpointq.tasks import messages, runtime
from checkpointq.tasks.coalesced import Settled, apply_requests
from checkpointq.tasks.producer import pending as pending_records
from checkpointq.worker import backpressure, lost_settles
from checkpointq.worker.consumer import forget_locally
from checkpointq.worker.group_events import GroupEvents
from checkpointq.worker.hooks import kombu as kombu_hooks

logger = logging.getLogger(__name__)

_SETTLE_SOURCE = pending_records.settle_source()
_SETTLE_SHA = hashlib.sha1(_SETTLE_SOURCE.encode(), usedforsecurity=False).hexdigest()

#: Tasks whose single requests are grouped.
COALESCED = (messages.SAVE, messages.SAVE_STAGED, messages.DELETE)

Handler = Callable[..., Any]


@dataclass(slots=True)
class _Pending:
    """One reserved message waiting in a group, with what Celery gave us to settle it."""

    message: Any
    #: The registered task (``Task``), and its name.
    celery_task: Any
    task: str
    task_id: str
    ack: Any
    reject: Any
    callbacks: Any
    #: Runs the message as the single task it is (``single_task``).
    fallback: Handler

    def run_as_task(self, consumer: Any) -> None:
        """Hand the message to Celery's own path: one task, as without coalescing.

        Refusals are routed as Celery's ``on_task_received`` routes them (our consumer
        dead-letters them); anything else leaves the message to be redelivered.
        """
        try:
            self.fallback(self.message, None, self.ack, self.reject, self.callbacks)
        except (InvalidTaskError, ContentDisallowed) as exc:
            consumer.on_invalid_task(None, self.message, exc)
        except DecodeError as exc:
            consumer.on_decode_error(self.message, exc)
        except Exception:
            logger.exception("could not run %s [%s]; left for redelivery", self.task, self.task_id)
            forget_locally(self.message.channel, self.message.delivery_tag)


class Coalescer:
    """Groups a consumer's eligible messages and runs each group as one pool job."""

    def __init__(
        self,
        consumer: Any,
        max_items: int,
        window_seconds: float,
        keys: KeySpace | None = None,
        settle_elsewhere: Callable[[list[Settled]], None] | None = None,
        events: GroupEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.consumer = consumer
        #: Seconds, for the window (a test's clock stands still while its loop turns).
        self._clock = clock
        #: Names the pending records that the acks settle.
        self.keys = keys or KeySpace()
        #: Settles records where the acks cannot carry settle.lua (no kombu Redis QoS).
        self.settle_elsewhere = settle_elsewhere
        #: What Celery's Request would tell monitors about each request.
        self.events = events or GroupEvents(consumer, getattr(consumer, "app", None))
        self.max_items = max_items
        self.window = window_seconds
        self.slots = max(1, int(getattr(consumer.pool, "num_processes", 1) or 1))
        #: The event loop (None when the consumer runs without one: groups then go at once).
        self.hub: Any = getattr(consumer, "hub", None)
        self._group: list[_Pending] = []
        self._opened = 0.0
        self._timer: Any = None
        self._turn_end_due = False
        #: Groups in the pool, each counted as holding a process until it answers.
        self._in_flight = 0
        #: Pool flushes so far (``pool_flushed``): a group counts in ``_in_flight`` only
        #: while none happened since it was sent.
        self._flushes = 0

    # -- main process, on the event loop -------------------------------------------------

    def add(self, pending: _Pending) -> None:
        self.events.received(pending.celery_task, pending.message, pending.ack, pending.reject)
        self._group.append(pending)
        if len(self._group) == 1:
            self._opened = self._clock()
        self._consider(at_once=False)

    def _consider(self, *, at_once: bool) -> None:
        """Send the group now (``at_once``) or at the end of this turn of the event loop, or
        leave it to fill, by the rules in the module docstring."""
        if not self._group:
            return
        if len(self._group) < self.max_items:
            if self._in_flight >= self.slots:
                return  # every process busy: it fills; ``_settle`` considers it again
            waited = self._clock() - self._opened
            if self._in_flight and waited < self.window:
                # Another group is in the pool: the load is up, and a few ms buy a group
                # larger than one turn's delivery, so less work per message.
                if self._timer is None:
                    self._timer = self.consumer.timer.call_after(
                        self.window - waited, self._on_window
                    )
                return
        if at_once or len(self._group) >= self.max_items or self.hub is None:
            self._flush()
        elif not self._turn_end_due:
            self._turn_end_due = True
            # Runs at the start of the loop's next turn, before it polls again: by then this
            # turn has delivered everything its read took.
            self.hub.call_soon(self._on_turn_end)

    def _on_turn_end(self) -> None:
        self._turn_end_due = False
        if self._in_flight < self.slots:
            self._flush()

    def _on_window(self) -> None:
        self._timer = None
        if self._in_flight < self.slots:
            self._flush()  # else every process is busy: ``_settle`` sends it

    def _flush(self) -> None:
        group, self._group = self._group, []
        if self._timer is not None:
            self.consumer.timer.cancel(self._timer)
            self._timer = None
        if group:
            self._dispatch(group)

    def pool_flushed(self) -> None:
        """Celery's consumer flushed the pool to reconnect (``Consumer.on_close``): the pool
        dropped the jobs no process had started, without calling back (their messages come
        back from the broker). No group sent so far is counted as holding a process any
        longer: a dropped one would hold it for good, and once all were held only full
        groups went, the rest waiting for the visibility timeout. A group still running
        settles as before when it answers."""
        self._in_flight = 0
        self._flushes += 1

    def _dispatch(self, group: list[_Pending]) -> None:
        """Hand ``group`` to the pool as one job; settle it when the job answers."""
        self._in_flight += 1
        flushes = self._flushes
        requests = [
            (p.task, p.task_id, _body(p.message), p.message.headers, p.message.delivery_info)
            for p in group
        ]
        # Counted as Celery counts the tasks its pool accepts (``celery inspect stats``).
        worker_state.total_count.update(p.task for p in group)
        sent = time.monotonic()

        def on_done(done: list[Settled | None]) -> None:
            runtime = time.monotonic() - sent
            # Started only once applied: a request that leaves the group is started (and
            # ends) as the single task it runs as, once, as without coalescing.
            self.events.applied(
                ((p.celery_task, p.task_id) for p, ok in zip(group, done, strict=False) if ok),
                runtime,
            )
            self._settle(group, done, flushes)

        def on_error(exc: Any) -> None:
            logger.warning(
                "a group of %d requests failed (%s): each runs alone",
                len(group),
                _error_of(exc),
            )
            # The store said it refuses writes (a full disk, no connection slot): take no
            # more messages for now, as when the worker's own probe is refused.
            if refusal := _refusal_of(exc):
                backpressure.trip(refusal)
            self._settle(group, [None] * len(group), flushes)

        try:
            self.consumer.pool.apply_async(
                apply_requests, args=(requests,), callback=on_done, error_callback=on_error
            )
        except Exception:
            logger.exception("could not hand a group of %d requests to the pool", len(group))
            self._settle(group, [None] * len(group), flushes)

    def _settle(self, group: list[_Pending], done: list[Settled | None], flushes: int) -> None:
        if flushes == self._flushes:
            self._in_flight -= 1
        # A pool process is free again: what waited for one goes first, so that the process
        # does not idle through this group's acknowledgement round trip. Writes are fenced by
        # ``seq``, so a request of this group run again as a task below may follow it.
        self._consider(at_once=True)
        applied = [(p, ok) for p, ok in zip(group, done, strict=False) if ok is not None]
        # Each settles as the publish its message is (its delivery tag: settle.lua).
        settled = [ok._replace(tag=messages.message_tag(p.message)) for p, ok in applied if ok[1]]
        self._ack_together([p for p, _ in applied], settled)
        for pending, ok in zip(group, done, strict=False):
            if ok is None:
                pending.run_as_task(self.consumer)

    def _ack_together(self, applied: list[_Pending], settled: list[Settled]) -> None:
        """Acknowledge the applied requests' messages, and settle their pending records
        (settle.lua), in one round trip.

        kombu's Redis QoS acknowledges a message with a ZREM and an HDEL of its delivery tag
        (``QoS._remove_from_indices``) in a pipeline of its own: one round trip per message,
        as much as the group's whole store write. Here one ZREM and one HDEL take every tag of
        the group (with two commands per message, the acks were ~10% of the main process's
        busy samples), then each message is marked acknowledged as ``Message.ack`` would.
        Other transports (no such QoS) ack each message as usual. If the broker cannot be
        reached, the messages are forgotten locally, their ``unacked`` entries stay and the
        visibility timeout redelivers them:
        replaying an applied save or delete is harmless.
        """
        if not applied:
            return
        channel = applied[0].message.channel
        qos = kombu_hooks.unacked_indices(channel)
        if qos is None or any(p.message.channel is not channel for p in applied):
            for pending in applied:
                # Celery's ack promise, as a Request calls it: logs instead of raising.
                pending.ack(logger, self.consumer.connection_errors)
            if settled and self.settle_elsewhere is not None:
                self.settle_elsewhere(settled)  # one more round trip, off kombu's Redis QoS only
            return
        tags = [p.message.delivery_tag for p in applied]
        keys, args = pending_records.settle_command(self.keys, settled)
        # What ``QoS._remove_from_indices`` does for one tag (the pinned-kombu test covers
        # it), for every tag at once, in a transaction as kombu's; settle.lua rides the same
        # round trip.
        commands: list[tuple[Any, ...]] = [
            ("ZREM", qos.unacked_index_key, *tags),
            ("HDEL", qos.unacked_key, *tags),
        ]
        if settled:
            commands.append(("EVALSHA", _SETTLE_SHA, len(keys), *keys, *args))
        try:
            replies = _transaction(qos, channel, commands)
            # A refused write comes back as a reply (raise_on_error=False): the acks' own
            # replies decide, as settle.lua's failure alone must not hold the messages.
            refused_ack = next((r for r in replies[:2] if isinstance(r, Exception)), None)
            if refused_ack is not None:
                raise refused_ack
            if settled and isinstance(replies[-1], Exception):
                self._settle_again(qos, replies[-1], keys, args)
        except (
            *self.consumer.connection_errors,
            *self.consumer.channel_errors,
            redis_errors.RedisError,
        ) as exc:
            self._leave_unacknowledged(channel, tags, exc)
            if settled:
                lost_settles.lost.lost_records(keys, args)
            return
        for pending, tag in zip(applied, tags, strict=True):
            kombu_hooks.settled_as_acked(qos, pending.message, tag)

    def _leave_unacknowledged(self, channel: Any, tags: list[str], exc: Exception) -> None:
        """The acks did not reach the broker: forget the messages locally (their ``unacked``
        entries stay, the broker redelivers them); a refusal (out of memory, read-only) also
        pauses the worker until the broker accepts writes (worker/backpressure.py)."""
        refusal = probe.refused(exc)
        expected = (*self.consumer.connection_errors, *self.consumer.channel_errors)
        if refusal is None and not isinstance(exc, expected):
            raise exc
        logger.error("could not acknowledge %d applied requests: %s", len(tags), exc)
        for tag in tags:
            forget_locally(channel, tag)
            lost_settles.lost.lost_settle(tag, requeue=False)
        if refusal is not None:
            backpressure.trip_broker(refusal)

    def _settle_again(self, qos: Any, error: Exception, keys: list[str], args: list[Any]) -> None:
        """settle.lua failed in the ack pipeline: NOSCRIPT (a restarted broker) sends it
        whole once; anything else is logged, and the records expire on their own or go
        with the session's next settled request."""
        if not isinstance(error, NoScriptError):
            logger.warning("could not settle %d pending records: %s", len(keys) - 1, error)
            return
        with qos.pipe_or_acquire() as pipe:
            pipe.eval(_SETTLE_SOURCE, len(keys), *keys, *args)
            (reply,) = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            logger.warning("could not settle %d pending records: %s", len(keys) - 1, reply)


def _transaction(qos: Any, channel: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` in one MULTI/EXEC on the broker, as kombu's ``QoS.pipe_or_acquire``
    pipeline sends them: hand-sent down a connection of the channel's pool where that is
    proven (a client and a pipeline made per group cost the main process more than the
    round trip itself), else through that pipeline. Replies and errors are the pipeline's
    (``execute(raise_on_error=False)``)."""
    pool = kombu_hooks.ack_pool(channel)
    if pool is not None:
        return redis_hooks.transaction(pool, commands)
    with qos.pipe_or_acquire() as pipe:
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies


def _error_of(error: Any) -> Any:
    """A pool job's own exception, as billiard hands it over (an ``ExceptionInfo`` whose
    ``exception`` wraps it as ``exc``; the ``ExceptionInfo``'s text is its whole traceback)."""
    inner = getattr(error, "exception", error)
    return getattr(inner, "exc", inner)


def _refusal_of(error: Any) -> str | None:
    """``StoreUnavailable.refusal`` of a pool job's error (``_error_of``)."""
    refusal = getattr(_error_of(error), "refusal", None)
    return str(refusal) if refusal else None


def _body(message: Any) -> bytes:
    body = message.body
    return body if isinstance(body, bytes) else str(body).encode("utf-8", "surrogateescape")


def eligible(message: Any) -> bool:
    """A plain first delivery of a protocol 2 JSON request: nothing Celery must schedule."""
    headers = message.headers
    return (
        isinstance(headers, dict)
        and message.content_type == messages.JSON
        and not headers.get("eta")
        and not headers.get("expires")
        and not headers.get("retries")
        and not headers.get("countdown")
        and isinstance(headers.get("id"), str)
    )


def single_task(task: Any, app: Any, consumer: Any, fallback: Handler) -> Handler:
    """What Celery's strategy (``fallback``) does with a message after announcing it, for a
    request that leaves its group: it was announced (``task_received``, ``task-received``)
    when it joined, so monitors see it received once, as without coalescing. A rate-limited
    task goes through ``fallback`` whole (its bucket is Celery's to wait on)."""
    hostname, eventer = consumer.hostname, consumer.event_dispatcher
    request_cls = create_request_cls(
        symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app
    )

    def run(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        if not consumer.disable_rate_limits and consumer.task_buckets[task.name]:
            return fallback(message, body, ack, reject, callbacks)
        request = request_cls(
            message,
            on_ack=ack,
            on_reject=reject,
            app=app,
            hostname=hostname,
            eventer=eventer,
            task=task,
            connection_errors=consumer.connection_errors,
            body=message.body,
            headers=message.headers,
            decoded=False,
            utc=app.uses_utc_timezone(),
        )
        worker_state.task_reserved(request)
        for callback in callbacks or ():
            callback(request)
        consumer.on_task_request(request)
        return None

    return run


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Handler:
    """Celery strategy for the coalesced tasks: group what is eligible, the rest as usual."""
    fallback = default_strategy(task, app, consumer, **kwargs)
    resume = single_task(task, app, consumer, fallback)
    coalescer: Coalescer | None = getattr(consumer, "_checkpointq_coalescer", None)
    if coalescer is None:
        settings = app.conf.checkpointq_coalesce
        keys = KeySpace(settings["key_prefix"]) if settings.get("key_prefix") else None
        coalescer = Coalescer(
            consumer,
            settings["max_items"],
            settings["window_seconds"],
            keys,
            _settle_in_runtime,
            GroupEvents(consumer, app),
        )
        consumer._checkpointq_coalescer = coalescer

    def on_message(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any
    ) -> Any:
        if body is not None or not eligible(message):
            return fallback(message, body, ack, reject, callbacks, **kw)
        headers = message.headers
        coalescer.add(
            _Pending(message, task, task.name, headers["id"], ack, reject, callbacks, resume)
        )
        return None

    return on_message


def _settle_in_runtime(settled: list[Settled]) -> None:
    settler = runtime.current().pending
    if settler is not None:
        settler.settle(settled)


def install(app: Any, *, max_items: int, window_ms: float, key_prefix: str | None = None) -> None:
    """Coalesce ``app``'s single saves and deletes (``Settings.coalescing`` says when);
    ``key_prefix`` names the pending records the acks settle."""
    app.conf.checkpointq_coalesce = {
        "max_items": max_items,
        "window_seconds": window_ms / 1000,
        "key_prefix": key_prefix,
    }
    for name in COALESCED:
        app.tasks[name].Strategy = f"{__name__}:strategy"
