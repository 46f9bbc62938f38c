"""Staged saves (``checkpoint.save_staged``): the producer SET the stored value on the broker
beside a message that only names it, so the checkpoint travels to the broker once
(docs/protocol.md, "Staged saves"). The worker reads the value by the request's id, applies it
as the producer encoded it, and deletes it when it settles the request.

A value that is gone means its request was settled already (a redelivery: the fence says so)
or lost with the broker's data; only the second is refused, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from checkpointq.store import redis_hooks
from checkpointq.store.base import CheckpointStore, EncodedCheckpoint, SaveOp
from checkpointq.store.errors import CorruptCheckpoint, InvalidInput
from checkpointq.store.model import validate_session_id
from checkpointq.tasks.producer.pending import Settler
from checkpointq.tasks.seq import accepted_seq


class StagedValueLost(InvalidInput):
    """A staged save whose value is not on the broker and whose request never applied."""


@dataclass(frozen=True, slots=True)
class StagedSave:
    """One ``checkpoint.save_staged`` request."""

    session_id: str
    seq: int
    request_id: str
    trimmed: int = 0


def parse(args: Sequence[Any], kwargs: dict[str, Any], request_id: str) -> StagedSave:
    """The request a ``save_staged(session_id, seq, trimmed=0)`` message's arguments name.

    Raises:
        InvalidInput: other arguments, or as ``request``.
    """
    names = ("session_id", "seq", "trimmed")
    if len(args) > 3 or set(kwargs) - set(names[len(args) :]):
        raise InvalidInput("arguments do not match save_staged(session_id, seq, trimmed=0)")
    given = dict(zip(names, args, strict=False)) | kwargs
    if "session_id" not in given or "seq" not in given:
        raise InvalidInput("arguments do not match save_staged(session_id, seq, trimmed=0)")
    return request(given["session_id"], given["seq"], given.get("trimmed", 0), request_id)


def request(session_id: object, seq: object, trimmed: object, request_id: str) -> StagedSave:
    """A staged save's request from its arguments and task id.

    Raises:
        InvalidInput: an invalid id, seq or count, or no task id to find the value by.
    """
    if seq is None:
        raise InvalidInput("a staged save needs its seq", field="seq")
    if isinstance(trimmed, bool) or not isinstance(trimmed, int) or trimmed < 0:
        raise InvalidInput("must be a count", field="trimmed")
    if not request_id:
        raise InvalidInput("a staged save needs its task id: its value is kept under it")
    sid = validate_session_id(session_id)
    accepted = accepted_seq(seq)
    assert accepted is not None  # not None, so accepted_seq returned it or raised
    return StagedSave(sid, accepted, request_id, trimmed)


def fetch(
    settler: Settler | None, request_ids: Sequence[str], max_bytes: int
) -> list[bytes | None]:
    """The staged value of each request id (None: not there), in one round trip to the
    broker. Each is read only up to one byte past ``max_bytes`` (``GETRANGE``): a value
    longer than ``max_bytes`` comes back that long, and is refused by ``save_op``
    without the worker ever holding it whole.

    Raises:
        redis.RedisError: the broker did not answer.
    """
    if not request_ids:
        return []
    if settler is None:  # a broker without pending records: no producer of ours staged
        return [None] * len(request_ids)
    commands = [("GETRANGE", settler.keys.pending_value(i), 0, max_bytes) for i in request_ids]
    values: list[bytes | None] = []
    for reply in redis_hooks.round_trip(settler.broker, commands):
        if isinstance(reply, Exception):
            raise reply
        values.append(bytes(reply) or None)  # GETRANGE of a missing key: ""
    return values


def save_op(store: CheckpointStore, request: StagedSave, value: bytes, max_bytes: int) -> SaveOp:
    """The store operation for ``request`` and its staged ``value`` (as ``fetch`` read it
    with ``max_bytes``), which the store writes as it is when it fits the store's own cap
    and budget (and encodes again otherwise).

    Raises:
        InvalidInput: the value is over ``max_bytes``, does not decode, or is another
            session's.
    """
    if len(value) > max_bytes:
        raise InvalidInput(
            f"its staged value (request {request.request_id}) is over the {max_bytes}-byte "
            "message limit (CHECKPOINTQ_MAX_MESSAGE_BYTES)"
        )
    try:
        checkpoint = store.decode_value(request.session_id, value)
    except CorruptCheckpoint as exc:
        raise InvalidInput(f"its staged value does not decode: {exc}") from None
    if checkpoint.session_id != request.session_id:
        raise InvalidInput("its staged value is another session's checkpoint", field="session_id")
    encoded = EncodedCheckpoint(value, request.trimmed)
    return SaveOp(checkpoint, request.seq, request.request_id, encoded)


def settled_before(store: CheckpointStore, request: StagedSave) -> bool:
    """Whether the session's fence shows ``request`` applied or superseded: its value was
    then deleted on settling, and this is a redelivery."""
    fence = store.fence(request.session_id)
    if fence is None or fence.seq < request.seq:
        return False
    return fence.seq > request.seq or fence.deleted or fence.request_id == request.request_id


def lost(request: StagedSave) -> StagedValueLost:
    return StagedValueLost(
        f"its staged value (request {request.request_id}) is not on the broker and the "
        "session's fence shows the request never applied: it expired, was evicted, or the "
        "broker lost its data"
    )


def expanded(store: CheckpointStore, value: bytes) -> list[Any] | None:
    """A staged value as ``checkpoint.save``'s arguments (the checkpoint's JSON), so that a
    dead letter keeps the checkpoint itself and replays as a plain save; None if it does
    not decode."""
    try:
        return [orjson.loads(store.codec.decode(value))]
    except Exception:
        return None
