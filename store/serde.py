"""Checkpoint <-> JSON, byte for byte as Go's ``encoding/json`` writes it.

Field order is the Go struct's, empty fields are omitted where the Go tags say
``omitempty``, and ``<``, ``>``, ``&``, U+2028 and U+2029 are escaped as Go escapes them, so a
document written here is the document Go would have written. Unknown fields follow the known
ones in the order they arrived.

Reading follows Go's ``encoding/json`` too: a key names a field when it equals the field's
name up to case (``bytes.EqualFold``), so ``VERSION`` is the version, never an unknown field
that Go would read while we did not. A document in which two keys name the same field
(``version`` and ``VERSION``, or one key twice) is refused: Go keeps the last for a scalar but
merges repeated objects and lists in place, and a JSON parser has already dropped the earlier
of two equal keys before we see them, so refusing is the only answer both sides agree on.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from checkpointq.store.errors import InvalidCheckpoint
from checkpointq.store.model import (
    Checkpoint,
    CheckpointMetadata,
    ConversationMessage,
    format_rfc3339,
)

# Go matches a JSON key to a struct field with bytes.EqualFold: ASCII letters in either case,
# and the only two other letters whose Unicode simple-fold orbits hold an ASCII letter,
# KELVIN SIGN (with k) and LONG S (with s). Dotted and dotless i fold only with themselves.
_GO_FOLD = str.maketrans(
    {**{chr(c): chr(c + 32) for c in range(ord("A"), ord("Z") + 1)}, "\u212a": "k", "\u017f": "s"}
)


class _WireNames:
    """The JSON names of one Go struct's fields, exact and folded."""

    __slots__ = ("exact", "folded", "where")

    def __init__(self, model: type[BaseModel], where: str) -> None:
        names = [field.alias or name for name, field in model.model_fields.items()]
        self.exact = frozenset(names)
        self.folded = {name.translate(_GO_FOLD): name for name in names}
        self.where = where

    def field(self, key: str) -> str | None:
        """The field Go decodes ``key`` into, if any."""
        return key if key in self.exact else self.folded.get(key.translate(_GO_FOLD))


_CHECKPOINT_NAMES = _WireNames(Checkpoint, "checkpoint")
_MESSAGE_NAMES = _WireNames(ConversationMessage, "conversationHistory[{}]")
_METADATA_NAMES = _WireNames(CheckpointMetadata, "metadata")


class _RepeatedKeys(dict[str, Any]):
    """A decoded JSON object in which some key occurred more than once (last value kept)."""

    __slots__ = ("repeated",)

    def __init__(self, pairs: list[tuple[str, Any]], repeated: set[str]) -> None:
        super().__init__(pairs)
        self.repeated = repeated


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    repeated: set[str] = set()
    for key, _ in pairs:
        (repeated if key in seen else seen).add(key)
    return _RepeatedKeys(pairs, repeated)


def _go_field_names(obj: dict[str, Any], names: _WireNames, index: int = 0) -> dict[str, Any]:
    """``obj`` with every key that Go decodes into a field renamed to that field's name.

    Returns ``obj`` itself when nothing needs renaming.

    Raises:
        InvalidCheckpoint: two keys (or one key twice) name the same field.
    """
    repeated = obj.repeated if isinstance(obj, _RepeatedKeys) else None
    if repeated is None and names.exact.issuperset(obj):
        return obj
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in obj.items():
        field = names.field(key)
        if field is None:
            out[key] = value
            continue
        earlier = seen.get(field)
        if earlier is not None or (repeated and key in repeated):
            what = f"keys {earlier!r} and {key!r} both" if earlier else f"key {key!r} twice"
            raise InvalidCheckpoint(
                f"{names.where.format(index)}: {what} name the field {field!r}; Go matches "
                "keys to fields ignoring case and keeps only the last, so the document is "
                "refused as ambiguous"
            )
        seen[field] = key
        out[field] = value
    return out


def _with_go_field_names(value: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint object with Go's key-to-field matching applied at every level."""
    top = _go_field_names(value, _CHECKPOINT_NAMES)
    metadata = top.get("metadata")
    if isinstance(metadata, dict):
        renamed = _go_field_names(metadata, _METADATA_NAMES)
        if renamed is not metadata:
            top = {**top, "metadata": renamed}
    history = top.get("conversationHistory")
    if isinstance(history, list):
        messages: list[Any] | None = None
        for i, message in enumerate(history):
            if isinstance(message, dict):
                renamed = _go_field_names(message, _MESSAGE_NAMES, i)
                if renamed is not message:
                    messages = messages or list(history)
                    messages[i] = renamed
        if messages is not None:
            top = {**top, "conversationHistory": messages}
    return top


# Go escapes these inside strings (HTML safety and JavaScript line terminators). None of
# them can occur in JSON outside a string, so replacing them in the encoded bytes is exact.
# Single bytes are looked for first: `in` finds one byte with memchr, while a search for a
# multi-byte sequence scans far slower (15-20 us on 20 KB); U+2028/U+2029 both start with
# the byte 0xE2, so their search only runs when that byte occurs at all.
_GO_ESCAPES_ASCII = ((b"&", b"\\u0026"), (b"<", b"\\u003c"), (b">", b"\\u003e"))
_GO_ESCAPES_E2 = (("\u2028".encode(), b"\\u2028"), ("\u2029".encode(), b"\\u2029"))


# orjson reads integers beyond 64 bits as floats, silently; a run of 19 or more digits sends
# the document to the stdlib parser instead, which keeps them exact. The run is found by
# mapping every digit to "0" and searching for 19 zeros: both steps run in C, about 8x
# faster than the regex \d{19}, which took most of a 20 KB load's CPU (see bench/).
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19


def _has_long_digit_run(raw: bytes) -> bool:
    return _LONG_DIGIT_RUN in raw.translate(_DIGITS_TO_ZERO)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _metadata_to_wire(meta: CheckpointMetadata) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if meta.total_messages:
        out["totalMessages"] = meta.total_messages
    if meta.total_tokens:
        out["totalTokens"] = meta.total_tokens
    if meta.total_cost_usd:
        out["totalCostUSD"] = meta.total_cost_usd
    if meta.start_time is not None:
        out["startTime"] = format_rfc3339(meta.start_time)
    if meta.last_message_time is not None:
        out["lastMessageTime"] = format_rfc3339(meta.last_message_time)
    if meta.__pydantic_extra__:
        out.update(_unknown_fields(meta.__pydantic_extra__, _METADATA_NAMES))
    return out


def _message_to_wire(message: ConversationMessage, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.trace_entries:
        out["traceEntries"] = message.trace_entries
    if message.__pydantic_extra__:
        out.update(_unknown_fields(message.__pydantic_extra__, _MESSAGE_NAMES, index))
    return out


def _unknown_fields(extra: dict[str, Any], names: _WireNames, index: int = 0) -> dict[str, Any]:
    """``extra``, unless one of its keys is one Go would decode into a known field.

    Only a checkpoint built in Python can hold one (``Checkpoint(..., VERSION=7)``): decoding
    renames such keys to the field.

    Raises:
        InvalidCheckpoint: an unknown field's name is a case variant of a known one.
    """
    for key in extra:
        field = names.field(key)
        if field is not None:
            raise InvalidCheckpoint(
                f"{names.where.format(index)}: unknown field {key!r} would be read by Go as "
                f"the field {field!r}"
            )
    return extra


def checkpoint_to_wire(cp: Checkpoint) -> dict[str, Any]:
    """The checkpoint as the JSON object Go would marshal, as plain Python data."""
    out: dict[str, Any] = {"sessionId": cp.session_id, "version": cp.version}
    if cp.conversation_history:
        out["conversationHistory"] = [
            _message_to_wire(m, i) for i, m in enumerate(cp.conversation_history)
        ]
    out["metadata"] = _metadata_to_wire(cp.metadata)
    if cp.last_run_ref:
        out["lastRunRef"] = cp.last_run_ref
    if cp.__pydantic_extra__:
        out.update(_unknown_fields(cp.__pydantic_extra__, _CHECKPOINT_NAMES))
    return out


def dumps_go(value: Any) -> bytes:
    """Encode plain JSON data compactly, with Go's string escaping."""
    try:
        data = orjson.dumps(value)
    except TypeError:
        # orjson refuses integers outside 64 bits; an unknown field may legitimately hold one.
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        try:
            data = text.encode()
        except UnicodeEncodeError as exc:
            # A lone surrogate ("\ud800" in the JSON that arrived): not Unicode, and Go
            # could not read it back. Refused as bad input rather than failing unexpectedly.
            raise InvalidCheckpoint(
                f"holds a lone surrogate (U+{ord(text[exc.start]):04X}), which is not valid Unicode"
            ) from None
    for raw, escaped in _GO_ESCAPES_ASCII:
        if raw in data:
            data = data.replace(raw, escaped)
    if b"\xe2" in data:
        for raw, escaped in _GO_ESCAPES_E2:
            if raw in data:
                data = data.replace(raw, escaped)
    return data


def _loads_pairs(raw: bytes) -> Any:
    """Decode with the stdlib parser, exact for long integers, marking repeated keys."""
    return json.loads(raw, parse_constant=_reject_constant, object_pairs_hook=_object_from_pairs)


def loads_json(data: bytes | str) -> Any:
    """Decode strict JSON (no NaN or Infinity, valid UTF-8), as Go's decoder would accept it."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        if _has_long_digit_run(raw):
            return _loads_pairs(raw)
        return orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise InvalidCheckpoint(f"not valid JSON ({exc})") from None


def _loads_document(data: bytes | str) -> Any:
    """Decode a stored document, seeing keys that occur twice (as Go's decoder does).

    A fast parser keeps only the last of two equal keys, silently. Documents Go or this
    module wrote are canonical (re-encoding the parsed value gives the same bytes, ~8% of a
    load's time), and a canonical document cannot repeat a key; anything else is parsed
    again, slower, by a parser that marks repeated keys.
    """
    return _loads_document_canonical(data)[0]


def _loads_document_canonical(data: bytes | str) -> tuple[Any, bool]:
    """``_loads_document``, and whether the document was canonical (compact, Go's escapes,
    no key repeated: ``dumps_go`` of what it decodes to gives it back byte for byte)."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        value = orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        if not _has_long_digit_run(raw):  # not an integer past a double's range either
            raise InvalidCheckpoint(f"not valid JSON ({exc})") from None
    else:
        # An integer orjson read as a float is written back with "." or "e", so it is never
        # canonical: this path needs no digit-run scan (loads_json's, ~8 us at 20 KB).
        if _is_canonical(value, raw):
            return value, True
    try:
        return _loads_pairs(raw), False
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCheckpoint(f"not valid JSON ({exc})") from None


def _is_canonical(value: Any, raw: bytes) -> bool:
    try:
        return dumps_go(value) == raw
    except InvalidCheckpoint:
        return False  # not encodable as it stands (a lone surrogate): not canonical either


def _describe(error: ValidationError) -> str:
    details = error.errors(include_url=False)
    first = details[0]
    path = ""
    for part in first["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = f"{path or 'checkpoint'}: {first['msg']}"
    if len(details) > 1:
        message += f" (and {len(details) - 1} more problem(s))"
    return message


def checkpoint_from_wire(value: Any) -> Checkpoint:
    """Validate already-decoded JSON data (for example a task argument) as a checkpoint.

    Raises:
        InvalidCheckpoint: the data is not a checkpoint; the message names the field.
    """
    if not isinstance(value, dict):
        raise InvalidCheckpoint(f"must be a JSON object, got {type(value).__name__}")
    value = _with_go_field_names(value)
    try:
        cp = Checkpoint.model_validate(value, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise InvalidCheckpoint(_describe(exc)) from None
    # Typed fields cannot hold floats; unknown ones can. A JSON parser that accepts NaN and
    # Infinity (Python's, which Celery uses) would let them in, and they would be written
    # back as null: refuse them rather than change a producer's data.
    # Most messages have no unknown fields: only those that do are walked (and named).
    _reject_non_finite(cp.__pydantic_extra__, "")
    _reject_non_finite(cp.metadata.__pydantic_extra__, "metadata")
    for i, message in enumerate(cp.conversation_history):
        if message.__pydantic_extra__:
            _reject_non_finite(message.__pydantic_extra__, f"conversationHistory[{i}]")
    return cp


def _reject_non_finite(value: Any, path: str) -> None:
    """Raise InvalidCheckpoint naming the first NaN or Infinity inside ``value``."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidCheckpoint(f"{path}: {value} is not a JSON number")
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_non_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_non_finite(item, f"{path}[{i}]")


def serialize_checkpoint(cp: Checkpoint) -> bytes:
    """Encode a checkpoint as Go's ``SerializeCheckpoint`` would: compact JSON bytes."""
    return dumps_go(checkpoint_to_wire(cp))


def deserialize_checkpoint(data: bytes | str) -> Checkpoint:
    """Decode a checkpoint from JSON bytes, as Go's ``DeserializeCheckpoint`` would.

    Raises:
        InvalidCheckpoint: the bytes are not JSON or not a valid checkpoint.
    """
    return checkpoint_from_wire(_loads_document(data))


def deserialize_storable(data: bytes) -> tuple[Checkpoint, bool]:
    """``deserialize_checkpoint``, and whether ``data`` may be stored as it is in place of
    ``serialize_checkpoint`` of the result: a valid checkpoint in canonical JSON (compact,
    Go's escapes, no key repeated), which every reader, Go's included, decodes to the same
    checkpoint. A staged save's JSON is such a document (its producer serialised it), so
    the worker need not serialise it again (~12 us of a 20 KB save).

    Raises:
        InvalidCheckpoint: as ``deserialize_checkpoint``.
    """
    value, canonical = _loads_document_canonical(data)
    return checkpoint_from_wire(value), canonical
