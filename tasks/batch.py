"""``checkpoint.apply_batch(items)``: many saves and deletes in one message, one round trip.

Opt-in for producers that coalesce requests (``BatchingClient``, in
``checkpointq.tasks.producer.batching``). ``items`` is an ordered list; each item is what a
single request would carry::

    {"op": "save", "checkpoint": {...}, "seq": 1733130000000000}
    {"op": "delete", "session_id": "sess-42", "seq": 1733130000000001}

Every item keeps its own fence (``CheckpointStore.apply_batch``), so a batch ends exactly
as its items applied one by one, in order. A bad item (invalid checkpoint, id or seq, an
unknown op, a checkpoint too large to store) is dead-lettered alone, as the single request
it stands for (so that ``dlq replay`` re-sends just that request), and the others apply. An
unavailable store fails the whole message, which ``CheckpointTask`` retries as a whole:
safe, since applying an item twice is harmless.
"""

from __future__ import annotations

from typing import Any

from celery import Task

from checkpointq.store.base import BatchOp, BatchResult, DeleteOp, LapseOp, SaveOp, SaveResult
from checkpointq.store.errors import InvalidInput, SessionBusy
from checkpointq.store.model import validate_session_id
from checkpointq.store.serde import checkpoint_from_wire, dumps_go
from checkpointq.tasks import observers, runtime
from checkpointq.tasks.dead_letters import Reason, RefusedRequest
from checkpointq.tasks.messages import (
    APPLY_BATCH,
    DELETE,
    MAX_ITEMS,
    SAVE,
    delivery_tag,
    requested_seq,
    requested_session,
    save_outcome,
)
from checkpointq.tasks.producer.pending import Settlement
from checkpointq.tasks.refusals import refuse
from checkpointq.tasks.seq import accepted_seq

_SAVE_FIELDS = frozenset({"op", "checkpoint", "seq"})
_DELETE_FIELDS = frozenset({"op", "session_id", "seq"})

Outcome = dict[str, Any]


def item_request_id(task_id: str | None, position: int) -> str:
    """The id of item ``position`` of batch ``task_id``: what the fence and the refusal
    records know it by (``BatchingClient`` hands out handles with it)."""
    return f"{task_id}:{position}" if task_id else ""


def parse_item(item: object, request_id: str = "") -> BatchOp:
    """One item of ``items`` as a store operation named ``request_id``.

    Raises:
        InvalidInput: not a save or delete item, or its checkpoint, id or seq is invalid.
    """
    if not isinstance(item, dict):
        raise InvalidInput(f"must be a JSON object, got {type(item).__name__}", field="item")
    op = item.get("op")
    allowed = _SAVE_FIELDS if op == "save" else _DELETE_FIELDS if op == "delete" else None
    if allowed is None:
        raise InvalidInput(f"op must be 'save' or 'delete', got {op!r}", field="op")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown} in a {op} item", field="item")
    seq = accepted_seq(item.get("seq"))
    if op == "save":
        return SaveOp(checkpoint_from_wire(item.get("checkpoint")), seq, request_id)
    return DeleteOp(validate_session_id(item.get("session_id")), seq, request_id)


def _as_request(item: object) -> tuple[str, list[Any], dict[str, Any]]:
    """The single request a bad item stands for: (task, args, kwargs) for its dead letter."""
    if isinstance(item, dict) and item.get("op") in ("save", "delete"):
        kwargs = {"seq": item["seq"]} if "seq" in item else {}
        if item["op"] == "save":
            return SAVE, [item.get("checkpoint")], kwargs
        return DELETE, [item.get("session_id")], kwargs
    return APPLY_BATCH, [[item]], {}


def item_outcome(op: BatchOp, result: SaveResult | bool) -> Outcome:
    if isinstance(op, SaveOp) and isinstance(result, SaveResult):
        return save_outcome(result)
    if isinstance(op, LapseOp):  # a staged save past its deadline: never stored
        return {"outcome": "expired", "session_id": op.session_id, "seq": op.seq}
    session_id = op.session_id if isinstance(op, DeleteOp) else op.checkpoint.session_id
    outcome = "deleted" if result else "superseded"
    return {"outcome": outcome, "session_id": session_id, "seq": op.seq}


def _item_request(
    task: str, args: list[Any], kwargs: dict[str, Any], request_id: str
) -> list[RefusedRequest]:
    """A bad item as the request it stands for, for its refusal record, if its session
    reads."""
    session_id = requested_session(task, args, kwargs)
    if not session_id or not request_id:
        return []
    return [RefusedRequest(session_id, request_id, requested_seq(args, kwargs))]


def batch_requests(
    task_id: str | None, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
) -> list[RefusedRequest]:
    """Every item of a batch refused whole whose session reads: each gets a refusal record,
    so the producers waiting on them learn it."""
    items = args[0] if args else kwargs.get("items")
    if not isinstance(items, list) or not task_id:
        return []
    requests: list[RefusedRequest] = []
    for position, item in enumerate(items[:MAX_ITEMS]):
        name, item_args, item_kwargs = _as_request(item)
        requests += _item_request(name, item_args, item_kwargs, item_request_id(task_id, position))
    return requests


def _seq(seq: object) -> int | None:
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _notify(task_id: str | None, label: str, outcome: Outcome, seq: object) -> None:
    if outcome["outcome"] == "dead_lettered":
        return  # refuse() told the observers
    observers.notify(
        observers.Observation(
            task=label,
            outcome=str(outcome["outcome"]),
            task_id=task_id,
            session_id=outcome.get("session_id"),
            seq=_seq(seq),
            stored_bytes=outcome.get("stored_bytes"),
            trimmed=int(outcome.get("trimmed") or 0),
            kind=outcome.get("kind"),
        )
    )


def _settle_items(
    rt: runtime.Runtime,
    task_id: str | None,
    items: list[Any],
    outcomes: list[Outcome | None],
    tag: str = "",
) -> None:
    """Remove the settled items' pending entries, in one call to the broker."""
    if rt.pending is None or not task_id:
        return
    settled: list[Settlement] = []
    for position, (item, outcome) in enumerate(zip(items, outcomes, strict=True)):
        if outcome is None:
            continue
        task, args, kwargs = _as_request(item)
        session_id = outcome.get("session_id")
        if session_id is None:  # dead-lettered: the item's own id, read as its request's
            session_id = requested_session(task, args, kwargs)
        if isinstance(session_id, str) and session_id:
            request_id = item_request_id(task_id, position)
            seq = requested_seq(args, kwargs)
            settled.append(Settlement(session_id, request_id, seq, deleted=task == DELETE, tag=tag))
    rt.pending.settle(settled)


def apply_batch(task: Task, items: object) -> Outcome:
    """Apply an ordered batch of saves and deletes; dead-letter bad items one by one."""
    if not isinstance(items, list):
        raise InvalidInput(f"items must be a JSON array, got {type(items).__name__}")
    if len(items) > MAX_ITEMS:
        raise InvalidInput(f"{len(items)} items; a batch holds at most {MAX_ITEMS}")
    ops: list[BatchOp] = []
    positions: list[int] = []
    refused: dict[int, InvalidInput] = {}
    for position, item in enumerate(items):
        try:
            ops.append(parse_item(item, item_request_id(task.request.id, position)))
            positions.append(position)
        except InvalidInput as exc:
            refused[position] = exc
    rt = runtime.current()
    # Raises StoreUnavailable for the whole batch: CheckpointTask retries the message.
    results: list[BatchResult] = rt.store.apply_batch(ops)
    busy = next((r for r in results if isinstance(r, SessionBusy)), None)
    if busy is not None:
        # A session's row is held: the whole message retries (the items that applied
        # apply again harmlessly), and nothing is dead-lettered before it lands.
        raise busy
    outcomes: list[Outcome | None] = [None] * len(items)
    for position, op, result in zip(positions, ops, results, strict=True):
        if isinstance(result, SessionBusy):
            continue  # raised above
        if isinstance(result, InvalidInput):
            refused[position] = result
        else:
            outcomes[position] = item_outcome(op, result)
    # Dead letters only once the batch applied, so that a retried batch records each once.
    for position, error in sorted(refused.items()):
        name, args, kwargs = _as_request(items[position])
        item = items[position]
        entry = refuse(
            Reason.INVALID_INPUT,
            f"item {position} of {APPLY_BATCH}: {error}",
            task=name,
            task_id=task.request.id,
            args=args,
            kwargs=kwargs,
            raw=dumps_go(item),
            retries=task.request.retries or 0,
            requests=_item_request(name, args, kwargs, item_request_id(task.request.id, position)),
            seq=_seq(item.get("seq") if isinstance(item, dict) else None),
        )
        outcomes[position] = {"outcome": "dead_lettered", "kind": "invalid_input", "entry": entry}
    _settle_items(rt, task.request.id, items, outcomes, delivery_tag(task.request))
    counts: dict[str, int] = {}
    for position, outcome in enumerate(outcomes):
        if outcome is None:  # every position got an outcome above; keeps mypy honest
            continue
        counts[outcome["outcome"]] = counts.get(outcome["outcome"], 0) + 1
        item = items[position]
        label = observers.task_label(_as_request(item)[0])
        seq = item.get("seq") if isinstance(item, dict) else None
        _notify(task.request.id, label, outcome, seq)
    return {"outcome": "batch", "items": len(items), **counts}
