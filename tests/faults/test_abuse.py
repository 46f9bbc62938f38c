"""Bad input and abuse against one long-running worker: every message is applied or
dead-lettered with a reason a person understands, and the worker keeps going.

Messages are pushed as raw envelopes (redis-py LPUSH), so nothing on the producer side
cleans them up first. A message counts as *handled* once its task id shows in the worker's
per-request DEBUG line or in the dead-letter store.
"""

from __future__ import annotations

import json
import math
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults.harness import (
    DELETE,
    SAVE,
    Celery,
    Deployment,
    Request,
    envelope,
    push,
    seq_base,
)
from tests.support.servers import RedisServer, wait_until

REFRESH = "checkpoint.refresh"
EXPIRE = "checkpoint.expire_stale"


@pytest.fixture(scope="module")
def victim() -> Iterator[Deployment]:
    """One worker for the whole module (small message limit, so oversize is cheap)."""
    broker = RedisServer().start()
    store = RedisServer().start()
    dep = Deployment(broker, store, settings={"max_message_bytes": 256 * 1024})
    dep.worker()
    try:
        yield dep
    finally:
        dep.cleanup()
        broker.cleanup()
        store.cleanup()


def _worker(dep: Deployment) -> Celery:
    return dep.processes[0]


def _handled(dep: Deployment, task_ids: set[str]) -> dict[str, dict[str, Any] | None]:
    """Task id -> its dead letter (as JSON), or None when the worker applied it."""
    letters = {
        e.task_id: e.as_json() for e in dep.dead_letters().list(count=100_000).entries if e.task_id
    }
    log = _worker(dep).log()
    return {t: letters.get(t) for t in task_ids if t in letters or f"task_id={t} " in log}


def _wait_handled(dep: Deployment, task_ids: set[str]) -> dict[str, dict[str, Any] | None]:
    found: dict[str, dict[str, Any] | None] = {}

    def done() -> bool:
        found.update(_handled(dep, task_ids))
        return len(found) == len(task_ids)

    wait_until(done, timeout=60, interval=0.1, message="every message to be handled")
    return found


def _assert_understandable(letter: dict[str, Any]) -> None:
    reason = letter["reason"]
    assert reason and "\n" not in reason and len(reason) < 1000, letter
    assert "Traceback" not in reason
    # "failed" is the bucket for unexpected exceptions: a bug, not a diagnosis of the input
    assert letter["kind"] != "failed", letter


def _good(dep: Deployment) -> Request:
    return Request(SAVE, f"good-{uuid.uuid4().hex[:8]}", seq_base(), version=1)


# -- hypothesis: bad payloads for every task --------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = {"n": value}
    return value


session_ids = st.one_of(
    st.text(min_size=1, max_size=20),
    st.just(""),
    st.just("x" * 300),
    st.sampled_from(["*", "?", "[", "{x}", ":", "..", "a\x00b", "\u202e", "🙂"]),
    json_values,
)


@st.composite
def checkpoints(draw: st.DrawFn) -> Any:
    """Checkpoint-like objects, valid or broken in one of many ways."""
    sid = draw(session_ids)
    base: dict[str, Any] = {"sessionId": sid, "version": draw(st.integers(0, 5))}
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "missing-id",
                "wrong-version",
                "huge-history",
                "oversize-string",
                "deep",
                "nan",
                "unknown",
                "not-object",
                "bad-history",
            ]
        )
    )
    if kind == "missing-id":
        del base["sessionId"]
    elif kind == "wrong-version":
        base["version"] = draw(st.one_of(st.text(max_size=5), st.floats(), st.lists(st.none())))
    elif kind == "huge-history":
        base["conversationHistory"] = [
            {"role": "user", "content": f"m{i}"} for i in range(draw(st.integers(101, 3000)))
        ]
    elif kind == "oversize-string":
        base["lastRunRef"] = "y" * draw(st.integers(100_000, 400_000))
    elif kind == "deep":
        base["extra"] = _deep(draw(st.integers(50, 800)))  # deeper: see the garbage test
    elif kind == "nan":
        base["metadata"] = {"totalTokens": draw(st.sampled_from([math.nan, math.inf, -math.inf]))}
        base["weird"] = draw(st.sampled_from([math.nan, math.inf]))
    elif kind == "unknown":
        base["unknownField"] = draw(json_values)
    elif kind == "not-object":
        return draw(json_values)
    elif kind == "bad-history":
        base["conversationHistory"] = draw(json_values)
    return base


@st.composite
def bad_messages(draw: st.DrawFn) -> tuple[str, bytes]:
    """(task id, envelope) for any task, with wrong or odd arguments."""
    task = draw(st.sampled_from([SAVE, DELETE, REFRESH, EXPIRE]))
    task_id = str(uuid.uuid4())
    if draw(st.integers(0, 9)) == 0:  # a body that is not UTF-8 at all
        body = b"\xff\xfe\x80" + draw(st.binary(max_size=20))
        return task_id, envelope(task, None, None, task_id=task_id, body=body)
    first: Any = draw(checkpoints()) if task == SAVE else draw(session_ids)
    args: list[Any] = [] if task == EXPIRE else [first]
    args += draw(st.lists(json_values, max_size=2))  # extra positional args
    kwargs: dict[str, Any] = {}
    if task in (SAVE, DELETE):
        kwargs["seq"] = draw(st.one_of(st.integers(0, 2**53 - 1), json_values))
    if draw(st.booleans()):
        kwargs.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)))
    body = json.dumps([args, kwargs, {}], allow_nan=True).encode()
    return task_id, envelope(task, None, None, task_id=task_id, body=body)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(bad_messages(), min_size=1, max_size=5))
def test_bad_payloads_are_applied_or_dead_lettered_and_good_ones_still_apply(
    victim: Deployment, batch: list[tuple[str, bytes]]
) -> None:
    # Given bad messages with good saves interleaved
    goods = [_good(victim) for _ in batch]
    mixed = [
        raw for (_, raw), good in zip(batch, goods, strict=True) for raw in (raw, good.envelope())
    ]
    # When they are pushed
    push(victim.broker_client(), mixed)
    # Then every bad one is handled, and a dead-lettered one says why in one line
    found = _wait_handled(victim, {task_id for task_id, _ in batch})
    for letter in found.values():
        if letter is not None:
            _assert_understandable(letter)
    # and every good save applied, by the same worker that never died
    victim.settle(goods, timeout=60)
    assert _worker(victim).running()


# -- raw garbage ------------------------------------------------------------------------------


class _Marker:
    """Unpickling this object creates a file: proof that a pickle body was deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def test_raw_garbage_is_refused_without_stopping_the_worker(
    victim: Deployment, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    pickle_id = str(uuid.uuid4())
    unknown_id = str(uuid.uuid4())
    deep_id = str(uuid.uuid4())
    depth = 20_000  # far beyond Python's recursion limit
    deep_body = '[[{"sessionId":"deep","version":1,"x":' + "[" * depth + "]" * depth + "}],{},{}]"
    garbage = [
        b'{"hello": "world"}',  # JSON, but not an envelope
        envelope("checkpoint.nope", [1], {}, task_id=unknown_id),
        envelope(SAVE, None, None, task_id=deep_id, body=deep_body.encode()),
        envelope(
            SAVE,
            None,
            None,
            task_id=pickle_id,
            body=pickle.dumps(_Marker(str(marker))),
            content_type="application/x-python-serialize",
            content_encoding="binary",
        ),
    ]
    # Given garbage interleaved with good saves
    goods = [_good(victim) for _ in garbage]
    push(
        victim.broker_client(),
        [raw for pair in zip(garbage, (g.envelope() for g in goods), strict=True) for raw in pair],
    )
    # Then the good ones apply, the identifiable garbage is dead-lettered, nothing unpickled
    victim.settle(goods, timeout=60)
    found = _wait_handled(victim, {pickle_id, unknown_id, deep_id})
    for task_id in (pickle_id, unknown_id, deep_id):
        letter = found[task_id]
        assert letter is not None, f"{task_id} was not dead-lettered"
        _assert_understandable(letter)
    kinds = {t: (letter or {}).get("kind") for t, letter in found.items()}
    assert kinds[unknown_id] == "unknown_task"
    assert kinds[pickle_id] == "undecodable"
    assert not marker.exists(), "a pickle body was deserialized"
    assert _worker(victim).running()


@pytest.mark.parametrize(
    "item",
    [
        pytest.param(b"this is not JSON at all \xff", id="not-json"),
        pytest.param(b"[1, 2, 3]", id="json-list"),
        pytest.param(b'{"body": "e30=", "headers": {}}', id="no-properties"),
        pytest.param(b"bad-base64", id="bad-base64"),
    ],
)
def test_malformed_queue_item_is_dead_lettered_and_worker_survives(
    deployment: Deployment, item: bytes
) -> None:
    named = None
    if item == b"bad-base64":
        message = json.loads(envelope(SAVE, [], {}))
        message["body"] = "!!! not base64 ###"
        named = message["headers"]["id"]
        item = json.dumps(message).encode()
    # Given a worker
    worker = deployment.worker()
    good = _good(deployment)
    # When a malformed item is pushed before a good save
    push(deployment.broker_client(), [item, good.envelope()])
    # Then the good save applies and the worker is still running
    deployment.settle([good], timeout=30)
    assert worker.running()
    # And the item itself is kept, raw, as an undecodable dead letter
    (letter,) = deployment.dead_letters().list().entries
    assert letter.kind == "undecodable"
    assert letter.raw == item
    assert "not a Celery message" in letter.reason
    if named is None:
        assert letter.task_id is None
    else:
        # And an envelope that names its request (only its body is bad) is dead-lettered
        # by that name, but leaves no refusal record: without its body nothing says which
        # session the id belongs to, and an id alone must not make any session's request
        # look refused (issue 31, hole 5)
        assert (letter.task, letter.task_id) == (SAVE, named)
        store = deployment.store_client()
        records = [store.hkeys(key) for key in store.scan_iter(match="*.cq:refusals:*")]
        assert not [ids for ids in records if named.encode() in ids]


# -- hostile session ids --------------------------------------------------------------------


HOSTILE = [
    "*",
    "?",
    "[",
    "]",
    "{x}",
    ":",
    "..",
    "a:b",
    "*:*",
    "x" * 10_000,
    "tab\there",
    "nul\x00",
    "bell\x07",
    "rtl\u202eover",
    "🙂🙃",
    "agentorca-session",
    "../etc",
]


def test_hostile_session_ids_are_refused_or_stored_without_touching_others(
    victim: Deployment,
) -> None:
    store = victim.store()
    # Given a bystander session
    bystander = Request(SAVE, "bystander", seq_base(), version=7)
    push(victim.broker_client(), [bystander.envelope()])
    victim.settle([bystander], timeout=30)
    before = victim.store_client().dump("agentorca-session:bystander")
    # When saves and deletes with hostile ids arrive
    base = seq_base()
    saves = [Request(SAVE, sid, base + i, version=100 + i) for i, sid in enumerate(HOSTILE)]
    deletes = [Request(DELETE, sid, base + 100 + i) for i, sid in enumerate(HOSTILE)]
    # (raw envelopes: the test's own checkpoint builder would refuse most of these ids)
    push(
        victim.broker_client(),
        (
            envelope(
                SAVE,
                [{"sessionId": r.session_id, "version": r.version}],
                {"seq": r.seq},
                task_id=r.task_id,
            )
            for r in saves
        ),
    )
    found = _wait_handled(victim, {r.task_id for r in saves})
    # Then each is stored under its own key or refused with a reason
    for req in saves:
        letter = found[req.task_id]
        if letter is None:
            cp = store.load(req.session_id)
            assert cp is not None and cp.version == req.version, req.session_id[:40]
        else:
            _assert_understandable(letter)
            assert letter["kind"] == "invalid_input"
    push(victim.broker_client(), (r.envelope() for r in deletes))
    _wait_handled(victim, {r.task_id for r in deletes})
    # and the bystander was never touched
    assert victim.store_client().dump("agentorca-session:bystander") == before
    cp = store.load("bystander")
    assert cp is not None and cp.version == 7
    # and the deletes removed exactly the hostile sessions that had been stored
    stored = [r for r in saves if found[r.task_id] is None]
    assert stored, "every hostile id was refused: the test proved nothing about storage"
    assert all(store.load(r.session_id) is None for r in stored)


# -- remote control ---------------------------------------------------------------------------


def test_remote_control_shutdown_has_no_effect_by_default(victim: Deployment) -> None:
    from celery import Celery as CeleryApp

    # Given an attacker with write access to the broker
    app = CeleryApp("attacker", broker=victim.broker.url, set_as_current=False)
    try:
        # When a broadcast shutdown is published on the pidbox exchange
        app.control.broadcast("shutdown")
        app.control.broadcast("pool_shrink", arguments={"n": 2})
    finally:
        app.close()
    # Then the worker still runs and applies the next save
    good = _good(victim)
    push(victim.broker_client(), [good.envelope()])
    victim.settle([good], timeout=30)
    assert _worker(victim).running()
    assert "Got shutdown from remote" not in _worker(victim).log()
