"""The message contract, in one place: task names, the protocol 2 body and the ``seq`` kwarg.

docs/protocol.md describes it for producers in any language; this module is what our own
producers, tasks, consumer and probes use to build and read it. A protocol 2 message body is
the JSON array ``[args, kwargs, embed]``:

    checkpoint.save(checkpoint: object, seq: int | None = None)
    checkpoint.save_staged(session_id: str, seq: int, trimmed: int = 0)
    checkpoint.delete(session_id: str, seq: int | None = None)
    checkpoint.refresh(session_id: str)
    checkpoint.expire_stale()
    checkpoint.reconcile()
    checkpoint.apply_batch(items: list)   items: {"op": "save"|"delete", ..., "seq": int}

Task names never change. ``seq`` (µs since the epoch, stamped by the producer) may be passed
as a keyword or as the second positional argument. Protocol 1 bodies (a JSON object with
``task``, ``id``, ``args``, ``kwargs``) are still read, for old producers.

Nothing here imports Celery, so the producer side and the worker's main process stay light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from pybase64 import b64decode

from checkpointq.store.base import SaveResult

SAVE = "checkpoint.save"
#: A save whose value the producer staged on the broker (docs/protocol.md, "Staged saves"):
#: the message names the request, the value travels to the broker once.
SAVE_STAGED = "checkpoint.save_staged"
DELETE = "checkpoint.delete"
REFRESH = "checkpoint.refresh"
EXPIRE_STALE = "checkpoint.expire_stale"
RECONCILE = "checkpoint.reconcile"
APPLY_BATCH = "checkpoint.apply_batch"

#: Most items one ``apply_batch`` message may carry: a bound on one pipeline's size and one
#: task's time.
MAX_ITEMS = 1000

#: The ``embed`` part of a protocol 2 body, as Celery's ``send_task`` writes it for a plain call.
EMBED = b'{"callbacks":null,"errbacks":null,"chain":null,"chord":null}'

#: The JSON content type, the only one the worker accepts.
JSON = "application/json"

#: The ``compression`` header of a zstd-compressed body (kombu's name for zstd).
ZSTD = "application/zstd"

#: The request field under which the worker's consumer hands a task its message body as
#: received (bytes), so that a dead letter keeps it exactly: the consumer sets it among the
#: message's headers, which Celery passes to the task as ``task.request`` fields. Not a
#: header any producer sends.
RAW_BODY_FIELD = "checkpointq_raw_body"

Arguments = tuple[list[Any], dict[str, Any]]


# -- building --------------------------------------------------------------------------------


def body(args_json: bytes, kwargs_json: bytes) -> bytes:
    """A protocol 2 body, ``[args, kwargs, embed]``, from already-encoded JSON parts."""
    return b"".join((b"[", args_json, b",", kwargs_json, b",", EMBED, b"]"))


def seq_kwargs(seq: int) -> bytes:
    """``{"seq": seq}`` as JSON."""
    return b'{"seq":%d}' % seq


def save_body(document: bytes, seq: int) -> bytes:
    """The body of ``checkpoint.save(<document>, seq=seq)``; ``document`` is checkpoint JSON."""
    prefix, suffix = save_body_framing(seq)
    return b"".join((prefix, document, suffix))


#: The dead-letter kwarg holding an encrypted staged save's sealed value (base64), in place of
#: its checkpoint: ``dlq replay`` stages it again (``DeadLetters.replay``), ``dlq show``
#: opens it only with the keys.
SEALED_KWARG = "sealed"


def save_staged_body(session_id_json: bytes, seq: int, trimmed: int = 0) -> bytes:
    """The body of ``checkpoint.save_staged(<session id>, seq=seq[, trimmed=trimmed])``."""
    kwargs = b'{"seq":%d,"trimmed":%d}' % (seq, trimmed) if trimmed else seq_kwargs(seq)
    return body(b"[" + session_id_json + b"]", kwargs)


def save_body_framing(seq: int) -> tuple[bytes, bytes]:
    """What ``save_body`` puts before and after the checkpoint JSON."""
    return b"[[", b"]," + seq_kwargs(seq) + b"," + EMBED + b"]"


def envelope_body(envelope: Mapping[str, Any], max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """The body of a message as kombu's Redis transport stores it: base64, then zstd when
    its ``compression`` header says so, decoded to at most ``max_bytes``.

    Raises:
        ValueError: not base64, a compression other than zstd, or a broken or larger frame.
    """
    raw = b64decode(envelope["body"])
    headers = envelope.get("headers")
    compression = headers.get("compression") if isinstance(headers, Mapping) else None
    if not compression:
        return raw
    if compression != ZSTD:
        raise ValueError(f"unknown compression {compression!r}")
    return decompress_zstd(raw, max_bytes)


def decompress_zstd(frame: bytes, max_bytes: int) -> bytes:
    """A zstd-compressed body's JSON, refused beyond ``max_bytes`` before it is inflated.

    Raises:
        ValueError: a broken frame, or more than ``max_bytes``.
    """
    import zstandard  # on first use: the worker's main process imports this module

    try:
        if zstandard.frame_content_size(frame) > max_bytes:  # -1: not declared
            raise ValueError(f"zstd body declares more than {max_bytes} bytes")
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=max_bytes)
    except zstandard.ZstdError as exc:
        raise ValueError(f"broken zstd body: {exc}") from None


def save_item(document: bytes, seq: int) -> bytes:
    """One ``apply_batch`` item saving ``document`` (checkpoint JSON)."""
    return b'{"op":"save","checkpoint":%s,"seq":%d}' % (document, seq)


def delete_item(session_id_json: bytes, seq: int) -> bytes:
    """One ``apply_batch`` item deleting the session whose JSON-encoded id is given."""
    return b'{"op":"delete","session_id":%s,"seq":%d}' % (session_id_json, seq)


# -- reading ---------------------------------------------------------------------------------


def arguments(payload: object) -> Arguments | None:
    """``(args, kwargs)`` of a decoded body in protocol 2 or 1 shape, else None."""
    if isinstance(payload, list) and len(payload) == 3:  # protocol 2: [args, kwargs, embed]
        args, kwargs = payload[0], payload[1]
    elif isinstance(payload, dict):  # protocol 1
        args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    else:
        return None
    if isinstance(args, list) and isinstance(kwargs, dict):
        return args, kwargs
    return None


def parse_body(raw: bytes | str | None) -> Arguments | None:
    """``(args, kwargs)`` of a JSON body in protocol 2 or 1 shape; None if it is neither."""
    if raw is None:
        return None
    try:
        return arguments(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


def requested_seq(args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The ``seq`` a save or delete was stamped with, if it carries a valid-looking one."""
    seq = kwargs.get("seq", args[1] if len(args) > 1 else None)
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def requested_session(
    task: str | None, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The session id a save, staged save or delete names, read leniently (the request may
    be refused for its checkpoint, whose ``sessionId`` still names its session; keys match
    ignoring case, as Go reads them); None when there is none to read."""
    if task not in (SAVE, SAVE_STAGED, DELETE):
        return None
    if task == SAVE:
        target = args[0] if args else kwargs.get("checkpoint")
        if not isinstance(target, dict):
            return None
        found = [v for k, v in target.items() if isinstance(k, str) and k.lower() == "sessionid"]
        target = found[0] if len(found) == 1 else None
    else:
        target = args[0] if args else kwargs.get("session_id")
    return target if isinstance(target, str) and target else None


def save_outcome(result: SaveResult) -> dict[str, Any]:
    """What a save task returns (its Celery result, which a waiting producer reads), and
    what a batch reports for each save item: the one place it is built. ``expired``: it
    arrived past its deadline and was never stored (``checkpointq.store.ordering``)."""
    return {
        "outcome": "applied" if result.applied else "expired" if result.lapsed else "superseded",
        "session_id": result.session_id,
        "seq": result.seq,
        "version": result.version,
        "trimmed": result.trimmed,
        "stored_bytes": result.stored_bytes,
    }


#: The header of a retry's message that names the delivery tag of the publish it descends
#: from (Celery's retry publishes a copy, with a new tag).
TAG_HEADER = "checkpointq_tag"


def delivery_tag(request: Any) -> str:
    """Which publish of its request the message a task runs is ('' unknown): its delivery
    tag, or for a retry's copy the tag of the publish it descends from (settle.lua)."""
    tag = getattr(request, TAG_HEADER, None) or (
        (getattr(request, "properties", None) or {}).get("delivery_tag")
    )
    return tag if isinstance(tag, str) else ""


def message_tag(message: Any) -> str:
    """``delivery_tag`` for a kombu message the main process holds (the coalesced path)."""
    inherited = (getattr(message, "headers", None) or {}).get(TAG_HEADER)
    return inherited if isinstance(inherited, str) and inherited else str(message.delivery_tag)
