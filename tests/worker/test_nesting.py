"""The consumer's nesting check: exact depth without decoding, brackets in strings ignored."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpointq.worker.consumer import MAX_NESTING, _json_depth, _more_openings_than


def _message(body: bytes) -> SimpleNamespace:
    return SimpleNamespace(content_type="application/json", body=body)


def _nested(depth: int) -> object:
    value: object = "x"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, MAX_NESTING + 50, 700])
def test_a_body_nested_deeper_than_the_limit_is_measured_exactly(depth: int) -> None:
    body = json.dumps([[_nested(depth)], {}, {}]).encode()
    assert _json_depth(_message(body)) == depth + 2


def test_brackets_and_escaped_quotes_inside_strings_do_not_count() -> None:
    tricky = '\\"[[[{{{' * 100 + '"\\\\'
    body = json.dumps([[{"content": tricky, "k": _nested(MAX_NESTING)}], {}, {}]).encode()
    assert _json_depth(_message(body)) == MAX_NESTING + 3


def test_a_body_with_few_brackets_is_not_scanned_and_reports_zero() -> None:
    body = json.dumps([[{"content": "plain"}], {"seq": 1}, {}]).encode()
    assert _json_depth(_message(body)) == 0


#: Bodies of brackets, quotes and filler, as bytes.
BRACKETY = st.lists(st.sampled_from([b"[", b"{", b"]", b"}", b"x", b'"']), max_size=300).map(
    b"".join
)


@given(BRACKETY, st.integers(min_value=0, max_value=130))
def test_the_opening_bracket_bound_counts_as_bytes_count_does(body: bytes, limit: int) -> None:
    expected = body.count(b"[") + body.count(b"{") > limit
    assert _more_openings_than(body, limit) is expected
