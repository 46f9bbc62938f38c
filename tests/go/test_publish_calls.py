"""The Go client's script calls, byte for byte the Python producer's (issue 31: "the Go client
shares the scripts: prove that it sends byte-identical script calls").

``tests/go/publishcall`` runs the real Go client (clients/go) over a recording Redis adapter
and prints the KEYS and ARGV of every script call: a save and a delete (publish.lua), a load
on one Redis (read_pending.lua, mode ``store``), a load with broker and store apart (mode
``one``, then the store's load.lua) and a list (mode ``heads``). Each is compared with the
call ``PendingRecords`` (tasks/producer/pending.py) makes from the same inputs, on
``redis.Redis`` clients whose ``evalsha`` records instead of sending: the session id, the
clock, the deployment's settings, and what is random or the Go client's own (the request id,
the epoch token, the message envelope) taken from the Go output.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import zstandard

from checkpointq.store import RedisStore, StoreOptions, serialize_checkpoint
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.pending import PendingRecords, RecordWrite
from tests.support.checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
#: A session id with characters a key builder could get wrong: a colon, braces (a cluster
#: hash tag), a space, a tab, multi-byte UTF-8 (its length in bytes names the value key).
SESSION = "odd ç:{tag} 日本\t🙂*"
CLOCK_US = 1_800_000_000_000_000
#: Settings other than the defaults, so that a client ignoring one of them shows.
QUEUE, PREFIX, TTL_SECONDS, MAX_AHEAD_SECONDS = "q-go", "tenant-b", 7 * 24 * 3600, 120
CHECKPOINT = make_checkpoint(SESSION, version=3, messages=3)


@dataclass(frozen=True)
class Call:
    """One script call as the server receives it: the script's SHA-1, KEYS and ARGV."""

    sha1: str
    keys: list[bytes]
    args: list[bytes]


def _sha1(path: str) -> str:
    return hashlib.sha1((REPO / path).read_bytes(), usedforsecurity=False).hexdigest()


def _wire(value: object) -> bytes:
    """An argument's bytes as redis-py's encoder sends them: text as UTF-8, an int in decimal."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    raise TypeError(f"no script argument of ours is a {type(value).__name__}")


@pytest.fixture(scope="module")
def go_calls(publishcall_binary: Path) -> dict[str, Call]:
    done = subprocess.run(
        [
            str(publishcall_binary),
            *("-session", SESSION, "-clock", str(CLOCK_US), "-queue", QUEUE, "-prefix", PREFIX),
            *("-ttl-seconds", str(TTL_SECONDS), "-max-ahead-seconds", str(MAX_AHEAD_SECONDS)),
        ],
        input=json.dumps(checkpoint_to_wire(CHECKPOINT)).encode(),
        capture_output=True,
        timeout=30,
        check=True,
    )
    return {
        name: Call(
            call["sha1"],
            [base64.b64decode(k) for k in call["keys"]],
            [base64.b64decode(a) for a in call["args"] or []],
        )
        for name, call in json.loads(done.stdout).items()
    }


class Recorder:
    """Stands in for a ``redis.Redis``'s ``evalsha``: records each call and answers as an
    empty broker and store would (no entries, no epoch, no value, no fence)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, sha: str, numkeys: int, *keys_and_args: Any) -> list[int | None]:
        keys, args = keys_and_args[:numkeys], keys_and_args[numkeys:]
        self.calls.append(Call(sha, [_wire(k) for k in keys], [_wire(a) for a in args]))
        if not args:  # load.lua: nothing stored, and the server's time
            return [None, None, None, None, None, 0]
        return [None] * {"store": 13, "heads": 3 * len(keys) // 2}.get(str(args[0]), 8)


def _recording_client(port: int, monkeypatch: pytest.MonkeyPatch) -> tuple[redis.Redis, Recorder]:
    """A client that never connects (port: to tell two servers apart) and records scripts."""
    client = redis.Redis(host="127.0.0.1", port=port)
    recorder = Recorder()
    monkeypatch.setattr(client, "evalsha", recorder)
    return client, recorder


def _records(broker: redis.Redis, store_client: redis.Redis) -> PendingRecords:
    store = RedisStore(store_client, prefix=PREFIX, options=StoreOptions(ttl_seconds=TTL_SECONDS))
    return PendingRecords(
        broker,
        store,
        store.keys,
        ttl_seconds=TTL_SECONDS,
        clock=SeqClock(lambda: CLOCK_US),
        max_seq_ahead_seconds=MAX_AHEAD_SECONDS,
    )


@pytest.fixture
def apart(monkeypatch: pytest.MonkeyPatch) -> tuple[PendingRecords, Recorder, Recorder]:
    """The Python producer's records with broker and store apart, and what each received."""
    broker, broker_calls = _recording_client(1, monkeypatch)
    store, store_calls = _recording_client(2, monkeypatch)
    return _records(broker, store), broker_calls, store_calls


def _push_call(records: PendingRecords, go: Call, op: str) -> Call:
    """push_call from the Go call's message, session, seq, request id and value (ARGV 1,
    9-13) and the same clock, with the Go call's epoch token (ARGV 3, random in each client)
    and the epoch, mark and token it saw last (ARGV 6-8: its earlier publishes' replies)."""
    message, _, token, _, _, epoch, mark, mark_token, session, seq, _, request_id, value = go.args
    assert session.decode() == SESSION
    write = RecordWrite(SESSION, int(seq), op, request_id.decode(), value)
    keys, args = records.push_call(QUEUE, message, [write], CLOCK_US)
    args[2], args[5], args[6], args[7] = token, epoch, mark, mark_token
    return Call(_sha1("tasks/lua/publish.lua"), [_wire(k) for k in keys], [_wire(a) for a in args])


@pytest.mark.parametrize("op", ["save", "delete"])
def test_a_go_publish_is_the_python_producers_call(
    go_calls: dict[str, Call], apart: tuple[PendingRecords, Recorder, Recorder], op: str
) -> None:
    records, _, _ = apart
    go = go_calls[op]
    # The script is publish.lua, the keys and arguments Python's, byte for byte
    assert go == _push_call(records, go, op)
    # And what the Go output gave: the fixed clock, the per-session stamps (the delete after
    # the save), the op, and a save's value exactly as the store will hold it
    assert go.args[3] == str(CLOCK_US).encode()
    # (the save is the first publish; the delete follows the save's reply, from the recorder)
    # (and the mark's token, the save's own: the first 16 characters of its ARGV[3])
    save_token = go_calls["save"].args[2][:16]
    seen = [b"", b"0", b""] if op == "save" else [b"recorded-epoch", b"1", save_token]
    assert go.args[5:8] == seen
    assert int(go.args[9]) == CLOCK_US + (op == "delete")
    assert go.args[10] == op.encode()
    if op == "save":
        stored = zstandard.ZstdDecompressor().decompress(go.args[12], max_output_size=1 << 20)
        assert stored == serialize_checkpoint(CHECKPOINT)
    else:
        assert go.args[12] == b""


def test_the_go_message_envelope_names_the_request_the_entry_names(
    go_calls: dict[str, Call],
) -> None:
    # The envelope is the one part each client builds its own way; it carries the same request
    for op in ("save", "delete"):
        envelope = json.loads(go_calls[op].args[0])
        assert envelope["headers"]["id"] == go_calls[op].args[11].decode()
        assert envelope["headers"]["task"] == f"checkpoint.{op}"
        assert envelope["properties"]["delivery_info"]["routing_key"] == QUEUE


def test_a_go_load_with_broker_and_store_apart_is_the_python_producers(
    go_calls: dict[str, Call], apart: tuple[PendingRecords, Recorder, Recorder]
) -> None:
    records, broker_calls, store_calls = apart
    # When Python loads the session, broker and store apart
    assert records.load(SESSION) == (None, None)
    # Then it read the broker (read_pending.lua, mode "one"), then the store (load.lua), as Go
    assert broker_calls.calls == [go_calls["load_one"]]
    assert store_calls.calls == [go_calls["load_one_store"]]
    assert go_calls["load_one"].sha1 == _sha1("tasks/lua/read_pending.lua")
    assert go_calls["load_one"].args[0] == b"one"
    assert go_calls["load_one_store"].sha1 == _sha1("store/lua/load.lua")


def test_a_go_load_on_one_redis_is_the_python_producers(
    go_calls: dict[str, Call], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, calls = _recording_client(1, monkeypatch)
    records = _records(client, client)
    assert records.one_redis
    # Given the replies the Go client had to its publishes (the recorder answers mark 1 to
    # each: to the delete, a broker gone back, which leaves the delete's mark and token)
    for op, below in (("save", 1), ("delete", 2)):
        token = go_calls[op].args[2][:16].decode()
        records.epochs.observe(b"recorded-epoch", 1, below=below, token=token)
    # When Python loads the session, broker and store one Redis
    assert records.load(SESSION) == (None, None)
    # Then it made Go's one call: read_pending.lua, mode "store"
    assert calls.calls == [go_calls["load_store"]]
    assert go_calls["load_store"].sha1 == _sha1("tasks/lua/read_pending.lua")
    assert go_calls["load_store"].args[0] == b"store"


def test_a_go_list_reads_the_newest_entries_as_the_python_producer(
    go_calls: dict[str, Call],
    apart: tuple[PendingRecords, Recorder, Recorder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records, broker_calls, _ = apart
    # Given a broker whose pending index names the session (as Go's recorder does)
    broker = records.broker
    monkeypatch.setattr(broker, "time", lambda: (CLOCK_US // 1_000_000, 0))
    monkeypatch.setattr(broker, "zrangebyscore", lambda *_: [SESSION.encode()])
    monkeypatch.setattr(broker, "get", lambda _: None)
    # (and no record missing: a pipelined read of the counts, no script)
    monkeypatch.setattr(records, "counts_commands", lambda _ids: [])
    monkeypatch.setattr(records, "missing", lambda *_args: None)
    # When Python reads the newest entries for a list
    assert records.live_records() == {}
    # Then it made Go's call: read_pending.lua, mode "heads"
    assert broker_calls.calls == [go_calls["heads"]]
    assert go_calls["heads"].args[0] == b"heads"
