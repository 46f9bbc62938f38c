"""Apply many single ``checkpoint.save``/``checkpoint.delete`` requests in one round trip.

The worker's main process groups the messages of single requests that arrive close together
(``checkpointq.worker.coalesce``) and hands their bodies here, to a pool process, as one
job. Only the happy path is handled here: each request that parses as a plain save or
delete becomes one item of ``CheckpointStore.apply_batch`` (each fenced by its own ``seq``,
in arrival order, so the end state is the one of applying them one by one), and is reported
as done. Everything else (a body that does not parse, bad arguments, invalid input, a value
the store refuses, a session whose row another client holds) is reported as not done: the
main process then runs that message as the single task it is, through ``CheckpointTask``,
which dead-letters or retries it exactly as without coalescing. An unavailable store raises,
and every message of the group takes that path too.

Each request also gets Celery's task signals (``checkpointq.tasks.item_signals``) when a
handler listens; for that the main process hands over each message's headers and
``delivery_info`` with its body.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import RedisError

from checkpointq.store.base import BatchOp, DeleteOp, LapseOp, SaveOp
from checkpointq.store.encryption import MissingEncryptionKey
from checkpointq.store.errors import InvalidInput, SessionBusy
from checkpointq.store.model import validate_session_id
from checkpointq.store.serde import checkpoint_from_wire
from checkpointq.tasks import batch, held_rows, messages, observers, runtime, staged
from checkpointq.tasks.checkpoints import outcomes
from checkpointq.tasks.item_signals import ItemSignals, wanted
from checkpointq.tasks.producer.pending import Settlement
from checkpointq.tasks.seq import accepted_seq
from checkpointq.tasks.staged import StagedSave

logger = logging.getLogger(__name__)

#: One request as the main process hands it over: (task name, task id, protocol 2 body,
#: message headers, delivery_info).
Request = tuple[str, str, bytes, dict[str, Any], dict[str, Any]]

#: A request now settled, as the main process needs it to settle its pending entry: its
#: session id and request id (``pending.Settlement``).
Settled = Settlement

_NAMES = {messages.SAVE: "checkpoint", messages.DELETE: "session_id"}


def parse(task: str, task_id: str, body: bytes) -> BatchOp:
    """The store operation a single save or delete message asks for.

    Raises:
        InvalidInput: anything but ``save(checkpoint, seq=None)`` / ``delete(session_id,
            seq=None)`` with valid arguments (the task path then says precisely why).
    """
    return _parse(task, task_id, body)[0]


def _parse(task: str, task_id: str, body: bytes) -> tuple[BatchOp, list[Any], dict[str, Any]]:
    """``parse``, with the message's arguments."""
    parsed = messages.parse_body(body)
    if parsed is None or task not in _NAMES:
        raise InvalidInput("not a protocol 2 save or delete body")
    args, kwargs = parsed
    if not 1 <= len(args) <= 2 or set(kwargs) - {"seq"} or (len(args) == 2 and kwargs):
        raise InvalidInput("arguments do not match the task's signature")
    seq = accepted_seq(kwargs.get("seq", args[1] if len(args) == 2 else None))
    if task == messages.SAVE:
        return SaveOp(checkpoint_from_wire(args[0]), seq, task_id), args, kwargs
    return DeleteOp(validate_session_id(args[0]), seq, task_id), args, kwargs


def _parse_staged(task_id: str, body: bytes) -> tuple[StagedSave, list[Any], dict[str, Any]]:
    parsed = messages.parse_body(body)
    if parsed is None:
        raise InvalidInput("not a protocol 2 save_staged body")
    args, kwargs = parsed
    return staged.parse(args, kwargs, task_id), args, kwargs


#: The least a staged value may take of a group's byte budget before it is read alone.
MIN_VALUE_SHARE = 64 * 1024

#: A request that parsed: its position in the group, what it asks, its arguments.
_Parsed = tuple[int, BatchOp | StagedSave, list[Any], dict[str, Any]]


def _parse_all(requests: list[Request]) -> list[_Parsed]:
    parsed: list[_Parsed] = []
    for position, (task, task_id, body, *_) in enumerate(requests):
        try:
            if task == messages.SAVE_STAGED:
                parsed.append((position, *_parse_staged(task_id, body)))
            else:
                parsed.append((position, *_parse(task, task_id, body)))
        except InvalidInput:
            continue
    return parsed


#: A request resolved to its store operation: its position in the group, the operation, its
#: arguments, and whether its staged value is of the earlier layout (``staged.StagedValue``).
_Resolved = tuple[int, BatchOp, list[Any], dict[str, Any], bool]


def _resolve(rt: runtime.Runtime, parsed: list[_Parsed]) -> list[_Resolved]:
    """The parsed requests as store operations, staged saves with their values (read in one
    round trip); a staged save past its deadline lapses unread; one without a usable value
    is left out, to the task path."""
    now_ms = int(rt.store.clock() * 1000)
    lapsed = {
        p[0] for p in parsed if isinstance(p[1], StagedSave) and rt.store.lapsed(p[1].seq, now_ms)
    }
    stage = [p[1] for p in parsed if isinstance(p[1], StagedSave) and p[0] not in lapsed]
    # Each value is read up to its share of the group's byte budget: a larger one goes to
    # the task path, which reads it alone, so a pool process holds a group's values within
    # the budget whatever their sizes (as the prefetch budget bounds carried checkpoints).
    share = rt.group_value_bytes // max(1, len(stage)) if rt.group_value_bytes else 0
    limit = (
        min(rt.max_message_bytes, max(share, MIN_VALUE_SHARE)) if share else rt.max_message_bytes
    )
    try:
        values = iter(staged.fetch(rt.pending, stage, limit))
    except RedisError:
        values = iter([None] * len(stage))  # the task path retries them
    resolved: list[_Resolved] = []
    for position, request, args, kwargs in parsed:
        if not isinstance(request, StagedSave):
            resolved.append((position, request, args, kwargs, False))
        elif position in lapsed:
            lapse = LapseOp(request.session_id, request.seq, request.request_id)
            resolved.append((position, lapse, args, kwargs, False))
        elif (found := next(values)) is not None:
            try:
                save = staged.save_op(rt.store, request, found[0], limit)
            except (InvalidInput, MissingEncryptionKey):
                continue  # the task path refuses it, or holds it for a worker with the key
            resolved.append((position, save, args, kwargs, found[1]))
    return resolved


def apply_requests(requests: list[Request]) -> list[Settled | None]:
    """Apply what parses in one pipelined round trip; for each request now durable its
    session id and seq (the main process settles its pending record with the ack), None
    for each one left to the task path.

    Staged saves' values are read first, in one more round trip to the broker; one whose
    value is not there (a redelivery, or a lost value) is left to the task path, which
    tells the two apart.

    Raises:
        StoreUnavailable: the store could not be reached (nothing is reported done).
    """
    started = time.perf_counter()
    rt = runtime.current()
    ops: list[BatchOp] = []
    positions: list[int] = []
    #: Each parsed request's arguments, kept only if a signal handler listens.
    arguments: list[tuple[list[Any], dict[str, Any]]] | None = [] if wanted() else None
    legacy: set[int] = set()
    for position, op, args, kwargs, legacy_value in _resolve(rt, _parse_all(requests)):
        ops.append(op)
        positions.append(position)
        if legacy_value:
            legacy.add(position)
        if arguments is not None:
            arguments.append((args, kwargs))
    done: list[Settled | None] = [None] * len(requests)
    if not ops:
        return done
    results = rt.store.apply_batch(ops)
    seconds = (time.perf_counter() - started) / len(ops)
    busy = [r for r in results if isinstance(r, SessionBusy) and not r.by_worker]
    if busy:
        # Its session's row is held: it runs as its own task and backs off alone.
        for held in busy:
            held_rows.record(rt.redis, rt.keys, held)
        logger.warning(
            "%s; it retries on its own, the other %d request(s) of its group applied",
            "; ".join(str(b) for b in busy),
            sum(1 for r in results if not isinstance(r, (InvalidInput, SessionBusy))),
        )
    for index, (position, op, result) in enumerate(zip(positions, ops, results, strict=True)):
        if isinstance(result, (InvalidInput, SessionBusy)):
            continue
        outcome = batch.item_outcome(op, result)
        task, task_id = requests[position][:2]
        done[position] = Settlement(
            str(outcome["session_id"]),
            task_id,
            op.seq,
            deleted=isinstance(op, DeleteOp),
            legacy_staged=position in legacy,
        )
        _observe(task, task_id, outcome, op.seq, seconds)
        if arguments is not None:
            args, kwargs = arguments[index]
            headers, delivery_info = requests[position][3:]
            item = ItemSignals.for_request(task, task_id, args, kwargs, headers, delivery_info)
            item.applied(outcome)
    return done


def _observe(task: str, task_id: str, outcome: dict[str, Any], seq: int | None, s: float) -> None:
    """What ``CheckpointTask`` would log and tell the observers for this request alone."""
    outcomes.record(task, outcome, task_id)
    observers.notify(
        observers.Observation(
            task=observers.task_label(task),
            outcome=str(outcome["outcome"]),
            task_id=task_id,
            session_id=outcome.get("session_id"),
            seq=seq,
            seconds=s,
            stored_bytes=outcome.get("stored_bytes"),
            trimmed=int(outcome.get("trimmed") or 0),
        )
    )
