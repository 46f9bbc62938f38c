"""The wire format: Go's encoding/json semantics, field for field."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import pytest

from checkpointq.store import (
    Checkpoint,
    CheckpointMetadata,
    ConversationMessage,
    InvalidCheckpoint,
    checkpoint_from_wire,
    deserialize_checkpoint,
    serialize_checkpoint,
)


def test_empty_fields_are_omitted_as_go_omitempty_does() -> None:
    cp = Checkpoint(session_id="s1")
    assert serialize_checkpoint(cp) == b'{"sessionId":"s1","version":0,"metadata":{}}'


def test_attributes_are_snake_case_and_json_is_camel_case() -> None:
    cp = deserialize_checkpoint(
        b'{"sessionId":"s","version":2,"lastRunRef":"r","conversationHistory":'
        b'[{"role":"user","content":"c","traceEntries":"t"}],"metadata":{"totalMessages":1,'
        b'"totalTokens":5,"totalCostUSD":"0.000100"}}'
    )
    assert (cp.session_id, cp.version, cp.last_run_ref) == ("s", 2, "r")
    assert cp.conversation_history[0].trace_entries == "t"
    assert (cp.metadata.total_messages, cp.metadata.total_tokens) == (1, 5)
    assert cp.metadata.total_cost_usd == "0.000100"


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("2026-12-02T08:30:00Z", "2026-12-02T08:30:00Z"),
        ("2026-12-02T08:30:00.987654321Z", "2026-12-02T08:30:00Z"),
        ("2026-12-02T09:30:00+01:00", "2026-12-02T08:30:00Z"),
        ("2026-12-02T03:00:00.5-05:30", "2026-12-02T08:30:00Z"),
        # Go writes every year with four digits; a year below 1000 too.
        ("0005-06-07T08:09:10Z", "0005-06-07T08:09:10Z"),
        ("0999-12-31T23:59:59Z", "0999-12-31T23:59:59Z"),
    ],
)
def test_any_rfc3339_time_is_read_and_written_as_utc_seconds(written: str, expected: str) -> None:
    cp = deserialize_checkpoint(
        f'{{"sessionId":"s","metadata":{{"startTime":"{written}"}}}}'.encode()
    )
    assert cp.metadata.start_time is not None
    assert cp.metadata.start_time.tzinfo is not None
    assert f'"startTime":"{expected}"'.encode() in serialize_checkpoint(cp)


def test_go_zero_time_and_null_mean_absent() -> None:
    cp = deserialize_checkpoint(
        b'{"sessionId":"s","metadata":{"startTime":"0001-01-01T00:00:00Z",'
        b'"lastMessageTime":null},"conversationHistory":null,"lastRunRef":null}'
    )
    assert cp.metadata.start_time is None and cp.metadata.last_message_time is None
    assert serialize_checkpoint(cp) == b'{"sessionId":"s","version":0,"metadata":{}}'


def test_missing_metadata_is_written_as_an_empty_object() -> None:
    assert b'"metadata":{}' in serialize_checkpoint(deserialize_checkpoint(b'{"sessionId":"s"}'))


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (b'{"sessionId":"s","version":3.5}', "version"),
        (b'{"sessionId":"s","version":3.0}', "version"),
        (b'{"sessionId":"s","version":"3"}', "version"),
        (b'{"sessionId":"s","version":true}', "version"),
        (b'{"sessionId":"s","version":9223372036854775808}', "version"),
        (b'{"sessionId":"s","metadata":{"totalTokens":"12"}}', "metadata.totalTokens"),
        (b'{"sessionId":"s","metadata":{"totalCostUSD":0.5}}', "metadata.totalCostUSD"),
        (b'{"sessionId":"s","metadata":{"startTime":"yesterday"}}', "metadata.startTime"),
        (b'{"sessionId":"s","metadata":[]}', "metadata"),
        (
            b'{"sessionId":"s","conversationHistory":[{"role":"user"},{"role":7}]}',
            "conversationHistory[1].role",
        ),
        (b'{"sessionId":"s","conversationHistory":{}}', "conversationHistory"),
        (b'{"version":1}', "sessionId"),
        (b'{"sessionId":""}', "sessionId"),
        (b'{"sessionId":12}', "sessionId"),
    ],
)
def test_invalid_documents_are_rejected_naming_the_field(document: bytes, field: str) -> None:
    with pytest.raises(InvalidCheckpoint) as caught:
        deserialize_checkpoint(document)
    assert str(caught.value).startswith(f"{field}:"), str(caught.value)


@pytest.mark.parametrize(
    "document",
    [b"", b"not json", b'{"sessionId":"s","version":NaN}', b'{"sessionId":"s\xff"}', b"[1]"],
)
def test_non_json_or_non_object_input_is_rejected_clearly(document: bytes) -> None:
    with pytest.raises(InvalidCheckpoint, match="JSON"):
        deserialize_checkpoint(document)


def test_non_object_task_argument_is_rejected() -> None:
    with pytest.raises(InvalidCheckpoint, match="must be a JSON object"):
        checkpoint_from_wire(["sessionId", "s"])


def test_unknown_fields_keep_their_json_types_and_order_at_every_level() -> None:
    document = (
        b'{"sessionId":"s","version":1,"conversationHistory":[{"role":"user","content":"c",'
        b'"score":0.25,"tags":["a"]}],"metadata":{"totalTokens":2,"big":123456789012345678901234,'
        b'"flag":false},"lastRunRef":"r","z":{"deep":[null,{"x":1}]},"a":"later"}'
    )
    cp = deserialize_checkpoint(document)
    assert cp.extra_fields == {"z": {"deep": [None, {"x": 1}]}, "a": "later"}
    assert list(cp.extra_fields) == ["z", "a"]
    assert cp.metadata.extra_fields == {"big": 123456789012345678901234, "flag": False}
    assert serialize_checkpoint(cp) == document


@pytest.mark.parametrize(
    "number",
    [2**63 - 1, 2**63, 9_999_999_999_999_999_999, 2**64, -(2**63) - 1, 10**20, 10**30, 10**400],
)
def test_integers_at_and_beyond_64_bits_keep_every_digit(number: int) -> None:
    # 19 digits is where int64 ends; orjson would turn anything longer into a float.
    document = b'{"sessionId":"s","version":1,"metadata":{},"n":%d}' % number
    cp = deserialize_checkpoint(document)
    assert cp.extra_fields == {"n": number}
    assert serialize_checkpoint(cp) == document


def test_snake_case_keys_in_json_are_unknown_fields_not_aliases() -> None:
    cp = deserialize_checkpoint(b'{"sessionId":"s","session_id":"other","version":1}')
    assert cp.session_id == "s"
    assert cp.extra_fields == {"session_id": "other"}


def test_html_characters_and_line_separators_are_escaped_like_go() -> None:
    cp = Checkpoint(
        session_id="s", conversation_history=[ConversationMessage(role="u", content="<a>&\u2028")]
    )
    assert b'"content":"\\u003ca\\u003e\\u0026\\u2028"' in serialize_checkpoint(cp)
    assert deserialize_checkpoint(serialize_checkpoint(cp)) == cp


def test_naive_datetimes_given_in_python_are_taken_as_utc() -> None:
    cp = Checkpoint(
        session_id="s", metadata=CheckpointMetadata(start_time=datetime(2026, 1, 2, 3, 4, 5))
    )
    assert cp.metadata.start_time == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_other_characters_sharing_the_separators_lead_byte_stay_raw() -> None:
    # "…" (U+2026) and "“" (U+201C) start with the same UTF-8 byte as U+2028/U+2029.
    cp = Checkpoint(
        session_id="s", conversation_history=[ConversationMessage(role="u", content="…\u2029“")]
    )
    assert '"content":"…\\u2029“"'.encode() in serialize_checkpoint(cp)


@pytest.mark.parametrize(
    ("document", "path"),
    [
        ({"sessionId": "s", "score": float("nan")}, "score"),
        ({"sessionId": "s", "metadata": {"x": [1, float("inf")]}}, "metadata.x[1]"),
        (
            {"sessionId": "s", "conversationHistory": [{"role": "u", "w": {"z": -float("inf")}}]},
            "conversationHistory[0].w.z",
        ),
        (
            {"sessionId": "s", "conversationHistory": [{"role": "u"}, {"w": [float("nan")]}]},
            "conversationHistory[1].w[0]",
        ),
    ],
)
def test_nan_and_infinity_in_unknown_fields_are_refused_not_nulled(
    document: dict[str, object], path: str
) -> None:
    # Celery's JSON decoder accepts NaN/Infinity; orjson would write them back as null.
    with pytest.raises(InvalidCheckpoint, match=rf"^{re.escape(path)}: "):
        checkpoint_from_wire(document)


@pytest.mark.parametrize("cost", ["+Inf", "-Inf", "NaN", "cheap", "0.012300", " 1,5 € "])
def test_total_cost_is_any_string_as_in_go(cost: str) -> None:
    # totalCostUSD is a Go string: the apiserver's %.6f of a bad spend is "+Inf" or "NaN".
    document = json.dumps(
        {"sessionId": "s", "version": 1, "metadata": {"totalCostUSD": cost}},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    cp = deserialize_checkpoint(document)
    assert cp.metadata.total_cost_usd == cost
    assert serialize_checkpoint(cp) == document


@pytest.mark.parametrize(
    "session_id", ["tab\there", "ls\u2028ps\u2029", "x" * 300, "nul\x00", "bidi\u202e", "a b"]
)
def test_any_session_id_go_accepts_round_trips(session_id: str) -> None:
    cp = deserialize_checkpoint(json.dumps({"sessionId": session_id}).encode())
    assert cp.session_id == session_id
    assert deserialize_checkpoint(serialize_checkpoint(cp)).session_id == session_id
