"""Staged saves (``checkpoint.save_staged``): the producer SET the stored value on the broker
beside a message that only names it, so the checkpoint travels to the broker once
(docs/protocol.md, "Staged saves"). The worker reads the value by the request's id, applies it
as the producer encoded it, and deletes it when it settles the request.

A save past its deadline lapses without its value being read (``store.ordering``). Otherwise
a value that is gone means its request was settled already (a redelivery: the fence says so)
or lost (evicted, or with the broker's data); only the second is refused, with the reason.
A value is read by (session, request) and deleted only by its own request's settle, so no
message for another session carrying the same request id can read or delete it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from checkpointq.store import redis_hooks
from checkpointq.store.base import CheckpointStore, EncodedCheckpoint, SaveOp
from checkpointq.store.encryption import MissingEncryptionKey, is_sealed
from checkpointq.store.errors import CorruptCheckpoint, InvalidInput
from checkpointq.store.model import validate_session_id
from checkpointq.store.ordering import order_key
from checkpointq.tasks import messages
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


#: A staged save's value as read from the broker (up to the byte limit asked for), and
#: whether it was found in the layout before issue 31, named by request id alone: then it is
#: this request's only if it holds this session's checkpoint (``save_op`` checks). A plain
#: tuple: one is built per staged save a worker applies.
StagedValue = tuple[bytes, bool]


def fetch(
    settler: Settler | None, requests: Sequence[StagedSave], max_bytes: int
) -> list[StagedValue | None]:
    """Each request's staged value (None: not there), in one round trip to the broker (a
    second for values of the earlier layout, where some are missing). Each is read only up
    to one byte past ``max_bytes`` (``GETRANGE``): a value longer than ``max_bytes`` comes
    back that long, and is refused by ``save_op`` without the worker ever holding it whole.

    Raises:
        redis.RedisError: the broker did not answer.
    """
    if not requests:
        return []
    if settler is None:  # a broker without pending records: no producer of ours staged
        return [None] * len(requests)
    keys = settler.keys
    found = _read(
        settler, [keys.pending_value(r.session_id, r.request_id) for r in requests], max_bytes
    )
    values: list[StagedValue | None] = [
        None if value is None else (value, False) for value in found
    ]
    missing = [i for i, value in enumerate(values) if value is None]
    if missing:
        legacy = [keys.legacy_pending_value(requests[i].request_id) for i in missing]
        for i, value in zip(missing, _read(settler, legacy, max_bytes), strict=True):
            values[i] = None if value is None else (value, True)
    return values


def _read(settler: Settler, keys: list[str], max_bytes: int) -> list[bytes | None]:
    commands = [("GETRANGE", key, 0, max_bytes) for key in keys]
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
        decoded = store.decode_staged(request.session_id, value)
    except CorruptCheckpoint as exc:
        raise InvalidInput(f"its staged value does not decode: {exc}") from None
    checkpoint = decoded.checkpoint
    if checkpoint.session_id != request.session_id:
        raise InvalidInput("its staged value is another session's checkpoint", field="session_id")
    # JSON (a producer's staged save that fits) is compressed by the store, as it is when
    # canonical; only a value in its format is offered as it is (``encode_op`` checks its
    # cap and budget).
    encoded = EncodedCheckpoint(value, request.trimmed) if decoded.own_format else None
    return SaveOp(checkpoint, request.seq, request.request_id, encoded, decoded.document)


def settled_before(store: CheckpointStore, request: StagedSave) -> bool:
    """Whether the session's fence shows ``request`` applied or superseded (by a request
    ordered after it: ``store.ordering``, ties by request id included): its value was then
    deleted on settling, and this is a redelivery."""
    fence = store.fence(request.session_id)
    if fence is None:
        return False
    own = order_key(request.seq, False, request.request_id)
    return fence.request_id == request.request_id or fence.key > own


def lost(request: StagedSave) -> StagedValueLost:
    return StagedValueLost(
        f"its staged value (request {request.request_id}) is not on the broker before its "
        "deadline and the session's fence shows the request never applied: it was evicted "
        "(a maxmemory-policy other than noeviction) or the broker lost its data"
    )


def expanded(store: CheckpointStore, request: StagedSave, value: bytes) -> list[Any] | None:
    """A staged value as ``checkpoint.save``'s arguments (the checkpoint's JSON), so that a
    dead letter keeps the checkpoint itself and replays as a plain save; None if it does
    not decode, or holds another session's checkpoint (never replayed as this request)."""
    try:
        document = orjson.loads(store.codec.decode(value))
    except Exception:
        return None
    if messages.requested_session(messages.SAVE, [document], {}) != request.session_id:
        return None
    return [document]


def sealed_kwargs(
    store: CheckpointStore, request: StagedSave, value: bytes
) -> dict[str, Any] | None:
    """A sealed staged value as a dead letter keeps it (``{"sealed": <base64>}``), when it
    opens as this session's checkpoint; None for a clear value, or one that does not open
    here (another session's, altered, or under a key this worker lacks: it then stays on
    the broker, as an undecodable value does)."""
    if not is_sealed(value):
        return None
    try:
        checkpoint = store.decode_value(request.session_id, value)
    except (CorruptCheckpoint, MissingEncryptionKey):
        return None
    if checkpoint.session_id != request.session_id:
        return None
    return {messages.SEALED_KWARG: base64.b64encode(value).decode()}
