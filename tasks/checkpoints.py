"""The checkpoint tasks: validate, call one store method, report a small JSON outcome.

Task names are the message contract (``checkpointq.tasks.messages``, docs/protocol.md):

    checkpoint.save(checkpoint: object, seq: int | None = None)
    checkpoint.save_staged(session_id: str, seq: int, trimmed: int = 0)
    checkpoint.delete(session_id: str, seq: int | None = None)
    checkpoint.refresh(session_id: str)
    checkpoint.expire_stale()
    checkpoint.reconcile()
    checkpoint.apply_batch(items: list)   (tasks/batch.py)

Policy lives in ``CheckpointTask.__call__`` and the helpers below: bad input and anything
unexpected are dead-lettered at once. An unavailable store is retried with backoff; with the
retries spent, the message goes back to the queue while the store refuses writes; only a
request that keeps failing while the store accepts other writes is dead-lettered, never one
whose row another client holds (``SessionBusy``), one applied but not durable yet
(``NotDurableYet``) or one sealed under a key this worker lacks (``MissingEncryptionKey``:
retried, then requeued for a worker that has it). Staged saves: tasks/staged.py.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import Counter
from typing import Any, NoReturn

from celery import Celery, Task
from celery.exceptions import Reject, Retry
from redis.exceptions import RedisError

from checkpointq.store.base import SaveResult
from checkpointq.store.encryption import MissingEncryptionKey
from checkpointq.store.errors import InvalidInput, NotDurableYet, SessionBusy, StoreUnavailable
from checkpointq.store.model import validate_session_id
from checkpointq.store.serde import checkpoint_from_wire
from checkpointq.tasks import batch, held_rows, messages, observers, orphans, runtime, staged
from checkpointq.tasks.dead_letters import Reason, RefusedRequest
from checkpointq.tasks.messages import (
    DELETE,
    EXPIRE_STALE,
    RECONCILE,
    REFRESH,
    SAVE,
    SAVE_STAGED,
    requested_seq,
    save_outcome,
)
from checkpointq.tasks.producer.pending import Settlement
from checkpointq.tasks.reconcile import reconcile_slice
from checkpointq.tasks.refusals import refuse
from checkpointq.tasks.seq import accepted_seq
from checkpointq.tasks.sweep import sweep

logger = logging.getLogger(__name__)

Outcome = dict[str, Any]


# -- the task bodies (plain functions: each validates and calls one store method) ---------


def save(task: Task, checkpoint: object, seq: int | None = None) -> Outcome:
    """Apply a save unless a newer request (or a delete) already won."""
    cp = checkpoint_from_wire(checkpoint)
    seq = accepted_seq(seq)
    # The task id names the request in the fence: its producer learns from it whether its
    # own save is the one applied (docs/protocol.md).
    return save_outcome(runtime.current().store.save(cp, seq, task.request.id or ""))


def save_staged(task: Task, session_id: object, seq: object, trimmed: object = 0) -> Outcome:
    """Apply a save whose value its producer staged on the broker (``tasks/staged.py``)."""
    rt = runtime.current()
    request = staged.request(session_id, seq, trimmed, task.request.id or "")
    if rt.store.lapsed(request.seq, _now_ms(rt)):
        # Past its deadline: never stored, whether or not its value is still there.
        rt.store.lapse(request.session_id, request.seq, request.request_id)
        return {"outcome": "expired", "session_id": request.session_id, "seq": request.seq}
    try:
        (found,) = staged.fetch(rt.pending, [request], rt.max_message_bytes)
    except RedisError as exc:
        raise StoreUnavailable(f"could not read the staged value from the broker: {exc}") from exc
    if found is None:
        if staged.settled_before(rt.store, request):
            return {"outcome": "superseded", "session_id": request.session_id, "seq": request.seq}
        raise staged.lost(request)
    op = staged.save_op(rt.store, request, found[0], rt.max_message_bytes)
    # The value holds this session's checkpoint (save_op checked): its settle may delete it.
    task.request.checkpointq_staged_legacy = found[1]
    (result,) = rt.store.apply_batch([op])
    if isinstance(result, (InvalidInput, SessionBusy)):
        raise result
    assert isinstance(result, SaveResult)  # a save's result, or its refusal above
    return save_outcome(result)


def _now_ms(rt: runtime.Runtime) -> int:
    return int(rt.store.clock() * 1000)


def delete(task: Task, session_id: object, seq: int | None = None) -> Outcome:
    """Delete a session and leave a tombstone, unless a newer save already won."""
    sid = validate_session_id(session_id)
    seq = accepted_seq(seq)
    applied = runtime.current().store.delete(sid, seq, task.request.id or "")
    return {"outcome": "deleted" if applied else "superseded", "session_id": sid, "seq": seq}


def refresh(session_id: object) -> Outcome:
    """Extend a live session's lifetime without rewriting it."""
    sid = validate_session_id(session_id)
    refreshed = runtime.current().store.refresh(sid)
    return {"outcome": "refreshed" if refreshed else "absent", "session_id": sid}


def expire_stale() -> Outcome:
    """Sweep expired sessions (under the sweep lock) and announce each on the events stream."""
    rt = runtime.current()
    result = sweep(
        rt.store,
        rt.redis,
        rt.keys,
        limit=rt.sweep_limit,
        events_maxlen=rt.events_maxlen,
    )
    outcome = result.as_json()
    if rt.pending is not None and not result.locked_out:
        # Pending records whose message is gone (a purge): settled as lost (issue 44).
        lost = orphans.reap(
            rt.pending.broker,
            rt.pending.keys,
            rt.queue,
            rt.store,
            rt.dead_letters,
            grace_seconds=rt.orphan_grace_seconds,
        )
        outcome["lost"] = len(lost)
    return outcome


def reconcile() -> Outcome:
    """One slice of reconciling the index with what other writers left (beat runs it);
    each session dropped because its value was deleted directly is announced."""
    rt = runtime.current()
    return reconcile_slice(rt.store, rt.reconcile_budget, rt.redis, rt.keys, rt.events_maxlen)


# -- policy -------------------------------------------------------------------------------


class OutcomeLog:
    """Counts outcomes per process and logs a one-line summary at most every ``every`` s.

    Per-request lines go to DEBUG; at INFO a busy worker says what it did once a minute.
    """

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._since = time.monotonic()

    def record(self, task: str, outcome: Outcome, task_id: str | None = None) -> None:
        # The "<task> -> <outcome>" tail is parsed by tests/faults/harness.py: keep it last.
        logger.debug(
            "task_id=%s %s -> %s",
            task_id,
            task,
            outcome,
            extra={
                "event": "request",
                # The request's own id and task: a coalesced group runs many requests inside
                # one pool job, so Celery's current task does not name this one.
                "task": task,
                "task_id": task_id,
                "session_id": outcome.get("session_id"),
                "seq": outcome.get("seq"),
                "outcome": outcome.get("outcome"),
            },
        )
        with self._lock:
            self._counts[f"{task.removeprefix('checkpoint.')}:{outcome.get('outcome')}"] += 1
            now = time.monotonic()
            if now - self._since < self.every:
                return
            summary = ", ".join(f"{k}={v}" for k, v in sorted(self._counts.items()))
            self._counts.clear()
            elapsed, self._since = now - self._since, now
        logger.info("last %.0fs: %s", elapsed, summary)


outcomes = OutcomeLog()


def _dead_letter(
    task: Task, kind: Reason, reason: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Outcome:
    """Refuse the request (``refusals.refuse``: recorded, then observed)."""
    label = observers.task_label(task.name)
    session_id = messages.requested_session(task.name, args, kwargs)
    name, args, kwargs = _as_sent(task, args, kwargs)
    entry = refuse(
        kind,
        reason,
        task=name,
        task_id=task.request.id,
        args=list(args),
        kwargs=dict(kwargs),
        # The body exactly as received, when the consumer handed it on (a task called
        # directly has none: the JSON of its arguments is kept instead).
        raw=getattr(task.request, messages.RAW_BODY_FIELD, None),
        retries=task.request.retries or 0,
        requests=_refused_requests(task.name, task.request.id, session_id, args, kwargs),
        seq=requested_seq(args, kwargs) if label in ("save", "delete") else None,
    )
    return {"outcome": "dead_lettered", "kind": kind.value, "entry": entry}


def _refused_requests(
    task: str,
    task_id: str | None,
    session_id: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[RefusedRequest]:
    """Each request a dead letter refuses: the request's own, or every item's of a batch
    refused whole."""
    if task == messages.APPLY_BATCH:
        return batch.batch_requests(task_id, args, kwargs)
    if not session_id or not task_id:
        return []
    return [RefusedRequest(session_id, task_id, requested_seq(args, kwargs))]


def _as_sent(
    task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The request a dead letter keeps: a staged save as the plain ``checkpoint.save`` of
    its staged value (so that it replays with its checkpoint, whose staged copy goes when
    the request settles), or, sealed, with its ciphertext (``staged.sealed_kwargs``); every
    other request as it came. A value that is not this session's checkpoint is never kept
    as this request's (nor deleted with it)."""
    if task.name != SAVE_STAGED:
        return task.name, args, kwargs
    rt = runtime.current()
    # Read leniently: the request may be refused for its arguments (its seq, say).
    session_id = messages.requested_session(task.name, args, kwargs)
    seq = requested_seq(args, kwargs) if args else kwargs.get("seq")
    if session_id is None or not task.request.id:
        return task.name, args, kwargs
    request = staged.StagedSave(session_id, seq if isinstance(seq, int) else 0, task.request.id)
    limit = rt.max_message_bytes
    try:
        (found,) = staged.fetch(rt.pending, [request], limit)
    except RedisError as exc:
        # Retried as any dead letter that could not be written: never one without its value.
        raise StoreUnavailable(f"could not read the staged value from the broker: {exc}") from exc
    checkpoint = None
    if found is not None and len(found[0]) <= limit:
        sealed = staged.sealed_kwargs(rt.store, request, found[0])
        if sealed is not None:
            # Encrypted: the entry keeps the ciphertext, never the checkpoint in clear.
            task.request.checkpointq_staged_legacy = found[1]
            return task.name, (session_id,), {**sealed, "seq": seq}
        checkpoint = staged.expanded(rt.store, request, found[0])
    if found is None or checkpoint is None:
        # Undecodable, oversize or another session's: it stays on the broker, for people to
        # look at, until its deadline (a value of the earlier layout is never deleted then).
        task.request.checkpointq_staged_keep = found is not None
        return task.name, args, kwargs
    task.request.checkpointq_staged_legacy = found[1]
    return SAVE, tuple(checkpoint), {"seq": seq}


def _observe(
    task: Task,
    outcome: Outcome,
    started: float | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Log the outcome and tell the observers (metrics) about it; a dead letter's
    observers were told by ``refuse`` already."""
    outcomes.record(task.name, outcome, task.request.id)
    if outcome.get("outcome") == "dead_lettered":
        return
    label = observers.task_label(task.name)
    observers.notify(
        observers.Observation(
            task=label,
            outcome=str(outcome.get("outcome")),
            task_id=task.request.id,
            session_id=outcome.get("session_id"),
            seq=requested_seq(args, kwargs) if label in ("save", "delete") else None,
            seconds=None if started is None else time.perf_counter() - started,
            stored_bytes=outcome.get("stored_bytes"),
            trimmed=int(outcome.get("trimmed") or 0),
            expired=int(outcome.get("expired") or 0) if label == "expire_stale" else 0,
            kind=outcome.get("kind"),
        )
    )


#: Outcomes after which a request is settled: its pending entry is no longer needed.
_SETTLED = frozenset({"applied", "superseded", "expired", "deleted", "dead_lettered"})


#: The tasks whose requests our producers write pending records for.
_RECORDED = frozenset({SAVE, SAVE_STAGED, DELETE})


def _settle_record(
    task: Task, outcome: Outcome, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Remove a settled save's or delete's pending entry (and its value), one call to the
    broker (``pending.Settler``; a batch settles its items itself)."""
    settler = runtime.current().pending
    name, request_id = task.name, task.request.id
    if settler is None or name not in _RECORDED or outcome.get("outcome") not in _SETTLED:
        return
    session_id = messages.requested_session(name, args, kwargs)
    if session_id is None or not request_id:
        return
    try:
        validate_session_id(session_id)
    except InvalidInput:
        return  # no producer of ours wrote a record for it
    request = task.request
    settler.settle(
        [
            Settlement(
                session_id,
                request_id,
                messages.requested_seq(args, kwargs),
                deleted=name == messages.DELETE,
                keep_value=getattr(request, "checkpointq_staged_keep", False),
                legacy_staged=getattr(request, "checkpointq_staged_legacy", False),
                tag=messages.delivery_tag(request),
            )
        ]
    )


def _keep_raw_body_to_ourselves(request: Any) -> None:
    """Take the body the consumer handed on out of the request's custom headers: it stays
    a ``request`` attribute for ``_dead_letter``, but Celery copies custom headers into a
    retry's message, which must not carry the body twice."""
    headers = request.headers
    if isinstance(headers, dict) and messages.RAW_BODY_FIELD in headers:
        headers.pop(messages.RAW_BODY_FIELD)
        request.headers = headers or None


class _BackToQueue(Exception):
    """``CheckpointTask._requeue``'s decision, on its way up to ``CheckpointTask.__call__``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _RetryPublished(Exception):
    """``CheckpointTask._retry`` published the next attempt: Celery's ``Retry`` for it, and
    the error it retries, on their way up to ``CheckpointTask.__call__``."""

    def __init__(self, retry: Retry, cause: StoreUnavailable) -> None:
        super().__init__(str(cause))
        self.retry, self.cause = retry, cause


class CheckpointTask(Task):  # type: ignore[misc]  # celery ships no type hints
    """Base of the checkpoint tasks: argument checks, retries and dead letters."""

    #: Retries are bounded by ``RetryPolicy``, which dead-letters instead of failing.
    max_retries = None
    #: The message is acknowledged only after the task ran (or was dead-lettered).
    acks_late = True
    #: Celery's own argument check happens on the producer side; we check on receipt.
    typing = False

    def __call__(self, *args: Any, **kwargs: Any) -> Outcome:
        _keep_raw_body_to_ourselves(self.request)
        # Celery's Reject and Retry are raised here, from the fewest frames: Celery's tracer
        # pickles the frames of what a task raises (from its own down, each with its code's
        # positions) and the text of the errors chained to it into the result a pool process
        # pipes to the main process. That reads only a Reject's ``requeue`` (``_requeue``
        # logged its reason and request id): it is chained to nothing. A Retry keeps the error
        # it retries as its cause, whose text Celery's task-retried event carries.
        try:
            return self._apply(args, kwargs)
        except _RetryPublished as published:
            retry, cause = published.retry, published.cause
        except _BackToQueue as back:
            raise Reject(back.reason, requeue=True) from None
        raise retry from cause

    def _apply(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        try:
            return self._attempt(args, kwargs)
        except StoreUnavailable as exc:
            # Only a dead letter that could not be written gets here (its stream lives on the
            # store Redis). Acknowledging now would leave the request in a log line alone:
            # retry it like any request whose store is down, and once the retries are spent
            # give it back to the broker; never acknowledge it.
            if runtime.current().retry.exhausted(self.request.retries or 0):
                self._requeue(f"its dead letter could not be written: {exc}", args, kwargs)
            outcome = self._retry(exc, args, kwargs)
            _observe(self, outcome, None, args, kwargs)
            return outcome

    def _signature(self) -> inspect.Signature:
        """The task body's signature, computed once per task (it costs more than the bind)."""
        signature: inspect.Signature | None = self.__dict__.get("_cq_signature")
        if signature is None:
            signature = self.__dict__["_cq_signature"] = inspect.signature(self.run)
        return signature

    def _attempt(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        try:
            self._signature().bind(*args, **kwargs)
        except TypeError as exc:
            outcome = _dead_letter(self, Reason.BAD_ARGUMENTS, str(exc), args, kwargs)
            _observe(self, outcome, None, args, kwargs)
            return outcome
        started = time.perf_counter()
        try:
            outcome = self.run(*args, **kwargs)
        except InvalidInput as exc:
            outcome = _dead_letter(self, Reason.INVALID_INPUT, str(exc), args, kwargs)
        except StoreUnavailable as exc:
            outcome = self._ride_out(exc, args, kwargs)
        except Exception as exc:  # a bug or an unreadable stored value: keep the request
            logger.exception("%s [%s] failed unexpectedly", self.name, self.request.id)
            reason = f"{type(exc).__name__}: {exc}"
            outcome = _dead_letter(self, Reason.FAILED, reason, args, kwargs)
        _observe(self, outcome, started, args, kwargs)
        _settle_record(self, outcome, args, kwargs)
        return outcome

    def _ride_out(
        self, exc: StoreUnavailable, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Outcome:
        """Retry; with the retries spent, requeue while the store refuses writes. A session
        whose row another client holds retries with no limit: the store takes every other
        write, and the request is no less valid for waiting."""
        rt = runtime.current()
        retries = self.request.retries or 0
        if isinstance(exc, SessionBusy):
            held_rows.record(rt.redis, rt.keys, exc)
            return self._retry(exc, args, kwargs)
        if isinstance(exc, MissingEncryptionKey):
            # A worker with the key applies it: held, never dead-lettered. Past the retries
            # it goes back to the queue, for whichever worker takes it next.
            if not rt.retry.exhausted(retries):
                return self._retry(exc, args, kwargs)
            self._requeue(str(exc), args, kwargs)
        if not rt.retry.exhausted(retries):
            return self._retry(exc, args, kwargs)
        if isinstance(exc, NotDurableYet):
            self._requeue(str(exc), args, kwargs)
        refusal = rt.store.write_refusal()
        if refusal is not None:
            self._requeue(f"the store refuses writes: {refusal}", args, kwargs)
        try:
            # The store accepts writes again (it came back since the last failure): one last
            # attempt, so that the end of an outage never dead-letters a valid request.
            return self.run(*args, **kwargs)  # type: ignore[no-any-return]
        except SessionBusy as busy:
            held_rows.record(rt.redis, rt.keys, busy)
            return self._retry(busy, args, kwargs)
        except NotDurableYet as waiting:
            self._requeue(str(waiting), args, kwargs)
        except Exception as again:  # dead-lettered below, whatever it is: never dropped
            down = isinstance(again, StoreUnavailable)
            kind = Reason.RETRIES_EXHAUSTED if down else Reason.FAILED
            reason = (
                f"failed {retries + 2} times while the store accepts other writes: "
                f"{type(again).__name__}: {again}"
            )
            return _dead_letter(self, kind, reason, args, kwargs)

    def _requeue(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        """Give the message back to the broker's queue unacknowledged (raises
        ``_BackToQueue``, which ``__call__`` turns into Celery's ``Reject``)."""
        logger.warning(
            "%s [%s]: retries spent and %s; back to the queue", self.name, self.request.id, why
        )
        _observe(self, {"outcome": "requeued"}, None, args, kwargs)
        # Celery's worker rejects the message with requeue: kombu puts it back in the queue.
        raise _BackToQueue(why)

    def _retry(
        self, exc: StoreUnavailable, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Outcome:
        """Schedule the next attempt with backoff (raises ``_RetryPublished``, which
        ``__call__`` turns into Celery's ``Retry``)."""
        policy = runtime.current().retry
        retries = self.request.retries or 0
        countdown = policy.countdown(retries)
        limit = (
            "no limit"
            if isinstance(exc, (SessionBusy, MissingEncryptionKey))
            else str(policy.max_retries)
        )
        logger.warning(
            "%s [%s]: %s; retry %d/%s in %.1fs",
            self.name,
            self.request.id,
            exc,
            retries + 1,
            limit,
            countdown,
        )
        _observe(self, {"outcome": "retried"}, None, args, kwargs)
        # Publishes a copy with an ETA; once Celery's Retry is raised, this one is acknowledged.
        try:
            # The copy settles as the publish it descends from (settle.lua; a new message
            # gets a new delivery tag): it carries that publish's tag in a header.
            tag = messages.delivery_tag(self.request)
            headers = {**(self.request.headers or {}), messages.TAG_HEADER: tag}
            retry = self.retry(
                exc=exc, countdown=countdown, max_retries=None, throw=False, headers=headers
            )
        except Reject as unpublished:
            # Celery rejects the message *without* requeue when the retry cannot be
            # published (a broker out of memory or read-only): that would drop it. Give it
            # back instead; if the broker refuses that too, it stays unacknowledged and is
            # redelivered (worker/consumer.py).
            if unpublished.requeue:
                raise
            self._requeue(f"its retry could not be published: {unpublished.reason}", args, kwargs)
        raise _RetryPublished(retry, exc)


def register(app: Celery) -> None:
    """Register the checkpoint tasks on ``app`` under their contract names."""
    for name, fn in ((REFRESH, refresh), (EXPIRE_STALE, expire_stale), (RECONCILE, reconcile)):
        app.task(name=name, base=CheckpointTask)(fn)
    # Bound: saves and deletes record their task id in the fence; a batch dead-letters its
    # bad items itself, under the batch's task id.
    for name, bound in (
        (SAVE, save),
        (SAVE_STAGED, save_staged),
        (DELETE, delete),
        (messages.APPLY_BATCH, batch.apply_batch),
    ):
        app.task(name=name, base=CheckpointTask, bind=True)(bound)
