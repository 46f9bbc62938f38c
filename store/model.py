"""The checkpoint document, field for field the Go original's JSON.

Attributes are snake_case; the wire names are the Go struct tags (camelCase). Models keep
fields they do not know (``extra="allow"``) so that a newer producer's data survives a
save/load round trip through an older worker.
"""

from __future__ import annotations

import re
import unicodedata
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from checkpointq.store.errors import InvalidSessionId

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# What display_id escapes (besides whitespace), and its short escapes.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cs", "Cf", "Zl", "Zp", "Co", "Cn"})
_SHORT_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}

_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
)
_GO_ZERO_TIME = datetime(1, 1, 1, tzinfo=UTC)


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it can name a session, else raise.

    The Go store accepts any non-empty string, so we do too: any length, and any character,
    tabs, line separators and invisible ones included (``display_id`` escapes them wherever
    an id is shown). Keys are built by concatenation only, never used as patterns, so no id
    reaches another session's keys. What cannot be an id is text that has no UTF-8 form (a
    lone surrogate, which only a Python caller can make): the key is the id's UTF-8 bytes,
    exactly as Go builds it.

    Raises:
        InvalidSessionId: not a string, empty, or holding a lone surrogate.
    """
    if not isinstance(session_id, str):
        raise InvalidSessionId(
            f"must be a string, got {type(session_id).__name__}", field="sessionId"
        )
    if not session_id:
        raise InvalidSessionId("must not be empty", field="sessionId")
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidSessionId(
            f"holds a lone surrogate (U+{ord(session_id[exc.start]):04X}) at position "
            f"{exc.start}, which is not valid Unicode",
            field="sessionId",
        ) from None
    return session_id


def display_id(session_id: str) -> str:
    """``session_id`` safe to print in a log line or a terminal: unchanged when it holds
    only visible characters, else with every backslash, whitespace, control, format,
    separator, private-use and unassigned character escaped as ``\\uXXXX`` (or ``\\t``,
    ``\\n``, ``\\r``), so no id can forge a log line, hide, or move the cursor."""
    if session_id.isprintable() and "\\" not in session_id and " " not in session_id:
        return session_id
    out: list[str] = []
    for char in session_id:
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif char.isspace() or unicodedata.category(char) in _ESCAPED_CATEGORIES:
            code = ord(char)
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def parse_rfc3339(value: str) -> datetime | None:
    """Parse an RFC 3339 timestamp to an aware UTC datetime; Go's zero time becomes None."""
    match = _RFC3339.match(value)
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp: {value!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, offset = match.group(7), match.group(8)
    micro = int((fraction[1:] + "000000")[:6]) if fraction else 0
    if offset in ("Z", "z"):
        tz: timezone = UTC
    else:
        sign = 1 if offset[0] == "+" else -1
        tz = timezone(sign * timedelta(hours=int(offset[1:3]), minutes=int(offset[4:6])))
    parsed = datetime(year, month, day, hour, minute, second, micro, tzinfo=tz)
    parsed = parsed.astimezone(UTC)
    return None if parsed == _GO_ZERO_TIME else parsed


def format_rfc3339(value: datetime) -> str:
    """Format as Go's metav1.Time does: UTC, second precision, ``Z`` suffix, and always a
    four-digit year (``strftime("%Y")`` writes year 5 as ``5``, which Go cannot read)."""
    if value.tzinfo is not None and value.utcoffset():
        value = value.astimezone(UTC)
    return (
        f"{value.year:04d}-{value.month:02d}-{value.day:02d}"
        f"T{value.hour:02d}:{value.minute:02d}:{value.second:02d}Z"
    )


class _WireModel(BaseModel):
    """Shared configuration: strict JSON types, wire names as aliases, unknown fields kept."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        validate_by_alias=True,
        validate_by_name=True,
        validate_assignment=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_zero(cls, value: Any, info: Any) -> Any:
        # Go's encoding/json leaves a field at its zero value when the JSON says null.
        if value is None:
            field = cls.model_fields[info.field_name]
            return field.get_default(call_default_factory=True)
        return value

    @property
    def extra_fields(self) -> dict[str, Any]:
        """Fields the wire document had that this version does not know, in input order."""
        return dict(self.__pydantic_extra__ or {})


def _check_int64(value: int) -> int:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError("does not fit a 64-bit signed integer")
    return value


class ConversationMessage(_WireModel):
    """One message of the recent conversation history."""

    role: str = ""
    content: str = ""
    trace_entries: str = Field(default="", alias="traceEntries")


class CheckpointMetadata(_WireModel):
    """Usage counters and timestamps; every field is omitted from JSON when zero or empty."""

    total_messages: int = Field(default=0, alias="totalMessages")
    total_tokens: int = Field(default=0, alias="totalTokens")
    #: A Go string: any text passes both ways. The apiserver writes ``%.6f`` of the spend,
    #: which is ``"+Inf"`` or ``"NaN"`` for a bad value: kept as written, never parsed here.
    total_cost_usd: str = Field(default="", alias="totalCostUSD")
    start_time: datetime | None = Field(default=None, alias="startTime")
    last_message_time: datetime | None = Field(default=None, alias="lastMessageTime")

    @field_validator("total_messages", "total_tokens")
    @classmethod
    def _int64(cls, value: int) -> int:
        return _check_int64(value)

    @field_validator("start_time", "last_message_time", mode="before")
    @classmethod
    def _rfc3339(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_rfc3339(value) if value else None
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        return value


class Checkpoint(_WireModel):
    """A session's persisted state: what the next agent run needs to carry on."""

    session_id: str = Field(alias="sessionId")
    version: int = 0
    conversation_history: list[ConversationMessage] = Field(
        default_factory=list, alias="conversationHistory"
    )
    metadata: CheckpointMetadata = Field(default_factory=CheckpointMetadata)
    last_run_ref: str = Field(default="", alias="lastRunRef")

    @field_validator("session_id", mode="after")
    @classmethod
    def _session_id(cls, value: str) -> str:
        try:
            return validate_session_id(value)
        except InvalidSessionId as exc:
            # Pydantic reports ValueErrors against the field; strip our own field prefix.
            raise ValueError(str(exc).removeprefix("sessionId: ")) from None

    @field_validator("version")
    @classmethod
    def _int64(cls, value: int) -> int:
        return _check_int64(value)
