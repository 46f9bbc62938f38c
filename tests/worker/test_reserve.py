"""The reserve script (worker/reserve.py, worker/lua/reserve.lua) on a real redis-server.

Messages are published and consumed with kombu's own Redis transport, the guarded reader
installed as in a worker: one BRPOP takes the first message, one script call the rest of the
prefetch window. What the script records must be what kombu's ``QoS.append`` records, so
that kombu's own restore brings the messages back after a crash.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import connection, entity, messaging
from kombu.utils import encoding as kombu_encoding
from kombu.utils import json as kombu_json

from checkpointq.store import redis_hooks
from checkpointq.store.keys import KeySpace
from checkpointq.store.memory import InMemoryStore
from checkpointq.tasks import runtime
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.runtime import Runtime
from checkpointq.worker import oversize, reserve
from checkpointq.worker.hooks import kombu as kombu_hooks
from tests.support.servers import RedisServer, command_calls, wait_until

# kombu's hints are partial (untyped functions): its classes are used as Any here.
Connection: Any = connection.Connection
Producer: Any = messaging.Producer
Queue: Any = entity.Queue
kombu_loads: Any = kombu_json.loads
bytes_to_str: Any = kombu_encoding.bytes_to_str

QUEUE = "reserve-test"


def _publish(url: str, count: int) -> list[dict[str, Any]]:
    with Connection(url) as conn:
        producer = Producer(conn.channel())
        bodies = [{"n": n, "pad": "x" * 2_000} for n in range(count)]
        for body in bodies:
            producer.publish(body, routing_key=QUEUE, declare=[Queue(QUEUE)])
    return bodies


def _consume(
    url: str,
    prefetch: int,
    on_message: Any = None,
    max_held_bytes: int = 0,
    wake_linger_ms: float = 0,
) -> tuple[Any, Any, list[Any]]:
    """A consuming connection with ``prefetch`` (and a byte budget and a linger, as a
    worker's settings give them); returns it, its channel and the messages delivered so far
    (the caller closes the connection)."""
    options = {
        "visibility_timeout": 3600,
        reserve.MAX_HELD_BYTES_OPTION: max_held_bytes,
        reserve.WAKE_LINGER_OPTION: wake_linger_ms,
    }
    conn = Connection(url, transport_options=options)
    channel = conn.channel()
    channel.basic_qos(0, prefetch, False)
    received: list[Any] = []

    def callback(message: Any) -> None:
        received.append(message)
        if on_message is not None:
            on_message(message)

    channel.basic_consume(QUEUE, no_ack=False, callback=callback, consumer_tag="t")
    return conn, channel, received


def _popped_by_script(client: redis.Redis) -> int:
    """Messages the script took (kombu itself pops with BRPOP only)."""
    return command_calls(client, "rpop")


def _brpops(client: redis.Redis) -> int:
    """BRPOP calls the broker answered: with the guarded reader, none."""
    return command_calls(client, "brpop")


@pytest.fixture
def script_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The limit of each reserve script call the reader sends."""
    calls: list[int] = []
    real = reserve.request

    def counted(channel: Any, queues: list[str], limit: int, *rest: Any) -> Any:
        calls.append(limit)
        return real(channel, queues, limit, *rest)

    monkeypatch.setattr(reserve, "request", counted)
    return calls


def test_one_read_reserves_the_prefetch_window_recorded_as_kombus_qos_records_it(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, script_calls: list[int]
) -> None:
    # Given 20 queued messages and a consumer with room for 8
    bodies = _publish(redis_server.url, 20)
    conn, channel, received = _consume(redis_server.url, prefetch=8)
    try:
        # When it reads (the wait wakes at once; the script reserves)
        before = time.time()
        conn.drain_events(timeout=5)
        after = time.time()
        # Then it holds 8 messages, the first 8 in order, and 12 stay queued
        assert [m.decode()["n"] for m in received] == [b["n"] for b in bodies[:8]]
        assert broker.llen(QUEUE) == 12
        # all 8 taken by one script call, none by BRPOP
        assert script_calls == [8] and _popped_by_script(broker) == 8
        assert _brpops(broker) == 0
        # And each is in kombu's unacked hash and index as kombu's QoS.append writes it:
        # [the message as delivered, exchange, routing key], scored by the worker's clock
        assert broker.hlen(channel.unacked_key) == broker.zcard(channel.unacked_index_key) == 8
        for message in received:
            tag = message.delivery_tag
            stored = json.loads(broker.hget(channel.unacked_key, tag) or b"null")
            info = message.delivery_info
            assert stored == [message._raw, info["exchange"], info["routing_key"]]
            score = broker.zscore(channel.unacked_index_key, tag)
            assert score is not None and before <= score <= after
        # And the consumer's prefetch window is full: nothing more is read
        assert not channel.qos.can_consume()
        # And acking removes them as kombu's own ack does
        for message in received:
            message.ack()
        assert broker.hlen(channel.unacked_key) == broker.zcard(channel.unacked_index_key) == 0
    finally:
        conn.close()


def test_a_small_prefetch_window_is_reserved_by_the_script_too(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, script_calls: list[int]
) -> None:
    # Given a consumer whose window holds two messages (a worker without coalescing)
    _publish(redis_server.url, 5)
    conn, channel, received = _consume(redis_server.url, prefetch=2)
    try:
        # When it reads until its window is full
        wait_until(lambda: conn.drain_events(timeout=1) or not channel.qos.can_consume())
        # Then the script took both, recorded as kombu records them, and no BRPOP took any
        # (a message BRPOP pops is only in its reply until recorded)
        assert script_calls == [2] and _popped_by_script(broker) == 2
        assert _brpops(broker) == 0
        assert len(received) == 2 == broker.hlen(channel.unacked_key)
    finally:
        conn.close()


def test_a_consumer_holding_its_byte_budget_reads_no_more_until_an_ack(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, script_calls: list[int]
) -> None:
    # Given 20 queued messages of ~2 KB and a consumer with room for 16 of them by count,
    # but a byte budget of about 5
    _publish(redis_server.url, 20)
    size = len(json.dumps({"n": 10, "pad": "x" * 2_000}))
    budget = 5 * size + 100
    conn, channel, received = _consume(redis_server.url, prefetch=16, max_held_bytes=budget)
    try:
        # When it reads until a read finds nothing more to take
        _read_until_quiet(conn)
        # Then it holds its budget, passed by at most one message, though its prefetch
        # window has room, and the rest stays queued: the reserve script was sent (its
        # window has room for more than a BRPOP's worth) and took less than its window
        held = sum(len(m.body) for m in received)
        assert budget <= held <= budget + size
        assert channel.qos.can_consume() and broker.llen(QUEUE) == 20 - len(received)
        assert script_calls and all(limit > 1 for limit in script_calls)
        assert broker.hlen(channel.unacked_key) == len(received)
        # When it acknowledges what it holds
        for message in list(received):
            message.ack()
        # Then it reads again
        before = len(received)
        conn.drain_events(timeout=5)
        assert len(received) > before
    finally:
        conn.close()


def _read_until_quiet(conn: Any) -> None:
    """Read until half a second passes with nothing delivered."""
    while True:
        try:
            conn.drain_events(timeout=0.5)
        except TimeoutError:
            return


def test_an_idle_consumer_still_wakes_on_the_first_message(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, script_calls: list[int]
) -> None:
    # Given a consumer waiting on an empty queue
    conn, _, received = _consume(redis_server.url, prefetch=8)
    try:
        Queue(QUEUE, channel=conn.default_channel).declare()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
        # When one message arrives
        _publish(redis_server.url, 1)
        # Then the next read delivers it
        conn.drain_events(timeout=5)
        assert len(received) == 1
        # And once a script read finds the queue empty, the consumer waits again (one
        # script call in all: it does not poll the broker with scripts), taking nothing
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)
        assert script_calls == [8] and _brpops(broker) == 0
        _publish(redis_server.url, 1)
        conn.drain_events(timeout=5)
        assert len(received) == 2
    finally:
        conn.close()


@pytest.fixture
def wakes_are_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wake-up after the first counts as soon after the last (``LINGER_HORIZON``),
    on any machine however loaded."""
    monkeypatch.setattr(reserve, "LINGER_HORIZON", 3600.0)


def test_a_consumer_woken_again_lets_requests_gather_for_its_linger_and_reserves_them_at_once(
    guarded: None,
    wakes_are_soon: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    script_calls: list[int],
) -> None:
    # Given a consumer with a linger (long enough for the publishes below to land in it on
    # a loaded machine: the script runs when it ends), waiting on an empty queue
    conn, channel, received = _consume(redis_server.url, prefetch=8, wake_linger_ms=1000)
    try:
        Queue(QUEUE, channel=conn.default_channel).declare()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
        reading = kombu_hooks._reading(channel)
        assert not reading.busy and reading.waiting  # the wait, BLMOVE
        # When a first message arrives, it is reserved at once (no wake-up before it)
        _publish(redis_server.url, 1)
        conn.drain_events(timeout=5)
        assert len(received) == 1 and script_calls == [8]
        assert command_calls(broker, "xread") == 0  # no linger
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
        assert not reading.busy and reading.waiting  # waiting again
        # And when the next arrives, the consumer wakes and lingers: the script call is
        # sent behind the linger, in one write, and runs once it is over (nothing reserved
        # yet)
        script_calls.clear()
        _publish(redis_server.url, 1)

        def lingering() -> bool:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.05)
            return reading.pending is not None and reading.lingered

        wait_until(lingering, timeout=10)
        assert len(received) == 1 and script_calls == [7] and broker.llen(QUEUE) == 1
        # and more arrive meanwhile
        _publish(redis_server.url, 4)
        # Then that one script call reserves them all once the linger is over, nothing lost
        wait_until(lambda: conn.drain_events(timeout=1) or len(received) == 6, timeout=10)
        assert script_calls == [7] and _brpops(broker) == 0
        assert command_calls(broker, "xread") == 1  # the one linger
        assert not reading.lingered
        assert [m.payload["n"] for m in received] == [0, 0, 0, 1, 2, 3]
    finally:
        conn.close()


def test_a_read_cut_short_by_the_byte_budget_reads_again_without_a_wait(
    guarded: None,
    broker: redis.Redis,
    redis_server: RedisServer,
    script_calls: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given ten queued messages of ~2 KB, and reads bounded to ~5 KB each
    monkeypatch.setattr(reserve, "BYTE_BUDGET", 5_000)
    monkeypatch.setattr(reserve, "LINGER_HORIZON", 3600.0)
    _publish(redis_server.url, 10)
    conn, _, received = _consume(redis_server.url, prefetch=0, wake_linger_ms=50)
    try:
        # When a consumer (with a linger) drains them
        wait_until(lambda: conn.drain_events(timeout=1) or len(received) == 10, timeout=10)
        # Then one wait found them, and script calls followed one another with no wait
        # (nor linger) between them: each stopped at the budget, not at an empty queue
        assert len(script_calls) >= 4 and command_calls(broker, "blmove") == 1
        assert command_calls(broker, "xread") == 0
        assert [m.payload["n"] for m in received] == list(range(10))
    finally:
        conn.close()


def test_a_wait_takes_nothing_and_wakes_on_the_first_message(redis_client: redis.Redis) -> None:
    # Given a list of three items
    redis_client.lpush("q", b"a", b"b", b"c")
    # When an idle consumer's wait runs on it
    client: Any = redis_client  # (execute_command is untyped in redis-py's hints)
    seen = client.execute_command(*reserve.wait_command("q", 1))
    # Then it answers with the item next in line and leaves the list as it was
    assert seen == b"a" and redis_client.lrange("q", 0, -1) == [b"c", b"b", b"a"]
    # And on an empty list it blocks until an item arrives, which stays queued
    redis_client.delete("q")
    connection: Any = redis.Connection  # (untyped in redis-py's hints)
    waiting: Any = connection(**redis_client.connection_pool.connection_kwargs)
    waiting.connect()
    try:
        waiting.send_command(*reserve.wait_command("q", 10))
        assert not select.select([waiting._sock], [], [], 0.2)[0]  # blocked
        redis_client.lpush("q", b"d")
        assert select.select([waiting._sock], [], [], 5)[0]
        assert waiting.read_response() == b"d"
        assert redis_client.lrange("q", 0, -1) == [b"d"]
    finally:
        waiting.disconnect()


def test_a_full_broker_refusing_the_wait_still_delivers_everything_by_the_script(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, script_calls: list[int]
) -> None:
    # Given 5 queued messages on a broker that then runs out of memory (noeviction): it
    # refuses BLMOVE, which may grow a list, and kombu's own recording of a BRPOP'd message
    _publish(redis_server.url, 5)
    broker.config_set("maxmemory-policy", "noeviction")
    broker.config_set("maxmemory", 1)
    conn, channel, received = _consume(redis_server.url, prefetch=8)
    try:
        # When the consumer reads
        wait_until(lambda: conn.drain_events(timeout=1) or len(received) == 5, timeout=10)
        # Then the script took all five, recorded, and no BRPOP took one (what it pops is
        # lost if its recording is refused)
        assert _brpops(broker) == 0 and script_calls
        assert broker.hlen(channel.unacked_key) == 5 and broker.llen(QUEUE) == 0
        # And idle on the full broker it sleeps between reads rather than spinning
        calls = len(script_calls)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=2.5)
        assert len(script_calls) - calls <= 4
        assert _brpops(broker) == 0
    finally:
        broker.config_set("maxmemory", 0)
        conn.close()


@pytest.fixture
def no_blmove_server() -> Iterator[RedisServer]:
    """A broker without BLMOVE, as a Redis before 6.2."""
    server = RedisServer(extra_args=["--rename-command", "BLMOVE", ""]).start()
    yield server
    server.cleanup()


@pytest.fixture
def no_blmove_broker(no_blmove_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of that broker, the script loaded (as ``broker`` for the shared server)."""
    client = no_blmove_server.client()
    client.script_load(reserve.source())
    yield client
    client.close()


def test_a_broker_without_blmove_is_read_by_brpop_when_idle(
    guarded: None,
    no_blmove_server: RedisServer,
    no_blmove_broker: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a broker without BLMOVE, and a consumer idle on it
    conn, _, received = _consume(no_blmove_server.url, prefetch=8)
    try:
        Queue(QUEUE, channel=conn.default_channel).declare()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
        # When messages arrive
        _publish(no_blmove_server.url, 3)
        wait_until(lambda: conn.drain_events(timeout=1) or len(received) == 3, timeout=10)
        # Then they are delivered (the first by BRPOP, as kombu reads), and the operator is
        # told once what that costs
        assert [m.decode()["n"] for m in received] == [0, 1, 2]
        assert _brpops(no_blmove_broker) >= 1
        warned = [r.getMessage() for r in caplog.records if "refused BLMOVE" in r.getMessage()]
        assert len(warned) == 1 and "loses it should the worker die" in warned[0]
    finally:
        conn.close()


def test_an_oversize_item_popped_by_brpop_is_streamed_aside_unread(
    guarded: None,
    no_blmove_server: RedisServer,
    no_blmove_broker: redis.Redis,
    dead_letters: DeadLetters,
) -> None:
    # Given a broker without BLMOVE (so an idle consumer pops with BRPOP) and a 3 MB item
    options = {"visibility_timeout": 3600, **oversize.transport_options("", 1024 * 1024, 16)}
    conn = Connection(no_blmove_server.url, transport_options=options)
    channel = conn.channel()
    channel.basic_qos(0, 8, False)
    received: list[Any] = []
    channel.basic_consume(QUEUE, no_ack=False, callback=received.append, consumer_tag="t")
    try:
        Queue(QUEUE, channel=channel).declare()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
        Producer(conn.channel()).publish(
            {"n": "giant", "pad": "x" * 3_000_000},
            routing_key=QUEUE,
            headers={"task": "checkpoint.save", "id": "giant-id"},
        )
        # When the consumer's BRPOP takes it
        wait_until(lambda: conn.drain_events(timeout=0.5) or dead_letters.count() == 1, timeout=10)
        # Then it was streamed from the reply to the broker, never delivered, and kept whole
        (letter,) = dead_letters.list().entries
        assert "streamed to the broker" in letter.reason and received == []
        assert no_blmove_broker.strlen(letter.headers["raw_key"]) == letter.raw_bytes > 4_000_000
    finally:
        conn.close()


def test_a_broker_that_lost_the_script_gets_it_again_and_nothing_is_lost(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, script_calls: list[int]
) -> None:
    # Given a broker that restarted or was flushed: no script loaded
    bodies = _publish(redis_server.url, 5)
    broker.script_flush()
    conn, channel, received = _consume(redis_server.url, prefetch=8)
    try:
        # When the consumer reads until it has every message
        wait_until(lambda: conn.drain_events(timeout=1) or len(received) == 5, timeout=10)
        # Then the first script call found it missing (NOSCRIPT), loaded it, and the next
        # took the rest, each recorded once
        assert [m.decode()["n"] for m in received] == [b["n"] for b in bodies]
        assert script_calls == [8, 8]
        assert broker.hlen(channel.unacked_key) == 5
    finally:
        conn.close()


def test_a_consumer_that_raises_puts_the_rest_of_its_batch_back_in_order(
    guarded: None, broker: redis.Redis, redis_server: RedisServer
) -> None:
    # Given 10 queued messages and a consumer whose callback fails on the third
    bodies = _publish(redis_server.url, 10)

    def fail_on_third(message: Any) -> None:
        if message.decode()["n"] == 2:
            raise RuntimeError("consumer bug")

    conn, channel, received = _consume(redis_server.url, prefetch=10, on_message=fail_on_third)
    try:
        # When it reads (one script call takes all ten)
        with pytest.raises(RuntimeError):
            conn.drain_events(timeout=5)
        # Then the three it saw are held, and the seven it never saw are queued again, in
        # their order and out of unacked (not left to the visibility timeout)
        assert [m.decode()["n"] for m in received] == [0, 1, 2]
        held = {m.delivery_tag for m in received}
        assert {t.decode() for t in _tags(broker, channel.unacked_key)} == held
        queued = [json.loads(item)["properties"]["delivery_tag"] for item in _queued(broker)]
        assert len(queued) == 7 and not held & set(queued)
        assert _bodies_in_pop_order(broker) == [b["n"] for b in bodies[3:]]
    finally:
        conn.close()


def _tags(client: redis.Redis, key: str) -> list[bytes]:
    tags: list[bytes] = client.hkeys(key)  # type: ignore[assignment]
    return tags


def _queued(client: redis.Redis) -> list[bytes]:
    items: list[bytes] = client.lrange(QUEUE, 0, -1)  # type: ignore[assignment]
    return items[::-1]  # BRPOP takes the right end first


def _bodies_in_pop_order(client: redis.Redis) -> list[int]:
    with Connection("memory://") as conn:
        channel = conn.channel()
        return [
            json.loads(channel.Message(json.loads(item), channel=channel).body)["n"]
            for item in _queued(client)
        ]


#: Held messages, then kill -9 of the process: run as ``python -c`` with the URL argv[1].
VICTIM = """
import os, signal, sys
from kombu import Connection
from checkpointq.worker.hooks import kombu as kombu_hooks
kombu_hooks.install()
conn = Connection(sys.argv[1])
channel = conn.channel()
channel.basic_qos(0, 6, False)
def killed(message):
    if not channel.qos.can_consume():
        os.kill(os.getpid(), signal.SIGKILL)
channel.basic_consume("reserve-test", no_ack=False, callback=killed, consumer_tag="v")
while True:
    conn.drain_events(timeout=10)
"""


def test_kombu_restores_what_a_killed_consumer_reserved(
    broker: redis.Redis, redis_server: RedisServer
) -> None:
    # Given a consumer process that reserved 6 of 10 messages with the script
    bodies = _publish(redis_server.url, 10)
    victim = subprocess.run(
        [sys.executable, "-c", VICTIM, redis_server.url], capture_output=True, timeout=60
    )
    # When it is killed with kill -9 while holding them
    assert victim.returncode == -signal.SIGKILL, victim.stderr.decode()
    assert broker.hlen("unacked") == 6 and broker.llen(QUEUE) == 4
    assert _popped_by_script(broker) == 6 and _brpops(broker) == 0  # all by the script
    # Then kombu's own restore (unpatched), once their visibility timeout is past, puts every
    # one back in the queue, marked redelivered, and empties unacked
    with Connection(redis_server.url, transport_options={"visibility_timeout": 1}) as conn:
        channel = conn.channel()
        wait_until(lambda: time.time() - _oldest_score(broker) > 1.5, timeout=10)
        channel.qos.restore_visible(num=100)
    assert broker.hlen("unacked") == broker.zcard("unacked_index") == 0
    assert sorted(_bodies_in_pop_order(broker)) == [b["n"] for b in bodies]
    redelivered = [json.loads(item)["headers"].get("redelivered") for item in _queued(broker)]
    assert redelivered.count(True) == 6


def _oldest_score(client: redis.Redis) -> float:
    oldest = client.zrange("unacked_index", 0, 0, withscores=True)
    return float(oldest[0][1]) if oldest else 0.0


# -- what the script records, item by item ---------------------------------------------------


def _envelope(**headers: Any) -> dict[str, Any]:
    return {
        "body": "eyJhIjogMX0=",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": "checkpoint.save", "id": "i-1", **headers},
        "properties": {
            "body_encoding": "base64",
            "delivery_tag": "6f1c-tag",
            "delivery_info": {"exchange": "", "routing_key": "checkpoints"},
        },
    }


def _pop_one(client: redis.Redis, item: bytes) -> str | None:
    """Push ``item`` alone, run the script; the tag it was recorded under, if any."""
    client.delete("q", "unacked", "unacked_index")
    client.rpush("q", item)
    script = client.register_script(reserve.source())
    reply = script(
        keys=["unacked", "unacked_index", "aside", "aside_index", "q"],
        args=[10, 1 << 20, time.time(), 0, 0],
    )
    assert reply[:2] == [1, item]
    tag = reply[2].decode()
    assert client.hlen("unacked") == (1 if tag else 0)
    return tag or None


#: Items cjson decodes and kombu's loads refuses (or turns into another type): they would
#: make kombu's restore fail at every pass, so they are never recorded.
NOT_KOMBUS = {
    "hex number": b'"n": 0x10',
    "leading zero": b'"n": 01',
    "plus sign": b'"n": +1',
    "trailing dot": b'"n": 1.',
    "lowercase nan": b'"n": nan',
    "lowercase inf": b'"n": -inf',
    "raw tab in a string": b'"n": "a\tb"',
    "kombu type object": b'"n": {"__type__": "bogus", "__value__": 1}',
    "nested too deep": b'"n": ' + b"[" * 200 + b"]" * 200,
    "kombu type object, escaped": b'"n": {"\\u005f_type__": "bogus", "__value__": 1}',
}


@pytest.mark.parametrize("header", NOT_KOMBUS.values(), ids=NOT_KOMBUS.keys())
def test_items_kombu_would_not_decode_alike_are_never_recorded(
    redis_client: redis.Redis, header: bytes
) -> None:
    opening = b'"headers": {'
    item = json.dumps(_envelope()).encode().replace(opening, opening + header + b", ")
    assert _pop_one(redis_client, item) is None


STANDARD = {
    "kombu's own": {},
    "numbers": {"a": [0, -1, 2.5, -0.5e-3, 1e5, 12345678901234567890]},
    "literals": {"a": [True, False, None]},
    "escapes": {"a": 'say "hi" \\ bye / ok'},
    "unicode escapes": {"a": "caf\u00e9 \u2028 \U0001f600"},
    "long strings": {"a": "y" * 5_000, "b": ["z" * 300]},
}


@pytest.mark.parametrize("headers", STANDARD.values(), ids=STANDARD.keys())
def test_standard_envelopes_are_recorded_as_kombu_reads_them(
    redis_client: redis.Redis, headers: dict[str, Any]
) -> None:
    envelope = _envelope(**headers)
    item = json.dumps(envelope).encode()
    assert _pop_one(redis_client, item) == "6f1c-tag"
    stored = redis_client.hget("unacked", "6f1c-tag")
    assert stored is not None and json.loads(stored) == [envelope, "", "checkpoints"]


# What an envelope's headers may hold: every JSON value Python writes (no surrogates: one
# alone is written raw by ensure_ascii=False and is not UTF-8), strings long and short, and
# placeholders for text written in place of a value or a key (_RAW).
_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12) | st.builds(
    lambda piece, times: piece * times, st.text(min_size=1, max_size=3), st.integers(90, 300)
)
#: Text put where a value or a key goes. True: standard JSON both read alike, which the
#: script must record; False: text cjson and Python's json read apart (or not at all), or
#: past what the script takes (deep nesting, an escaped "__type__"), which it may refuse.
_RAW: list[tuple[bytes, bool]] = [
    (b"1", True),
    (b"-0", True),
    (b"-0.5e-3", True),
    (b"1E+5", True),
    (b"true", True),
    (b"null", True),
    (b'"x"', True),
    (b'"a\\"b\\\\c"', True),
    (b'"\\u00e9\\u2028"', True),
    (b"0x10", False),
    (b"01", False),
    (b"+1", False),
    (b"1.", False),
    (b"1.e5", False),
    (b".5", False),
    (b"nan", False),
    (b"-inf", False),
    (b"NaN", False),
    (b"Infinity", False),
    (b"1e999", False),
    (b'"a\\x41"', False),
    (b'"\\ud800"', False),
    (b'"\t"', False),
    (b'"\\u005f_type__"', False),
    (b'{"__type__": "bogus", "__value__": 1}', False),
    (b'{"\\u005f_type__": "bogus", "__value__": 1}', False),
    (b"[" * 130 + b"]" * 130, False),
    (b'"\xff"', False),
    (b"\xc2\xa01", False),
]
_ALIKE = [f"@raw{n}@" for n, (_, same) in enumerate(_RAW) if same]
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
    | st.sampled_from(_ALIKE),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def _probed(draw: st.DrawFn) -> Any:
    """A header value holding one placeholder of any _RAW text, as a value or (for a
    string) a key, a few lists or objects deep: one text cjson and Python read apart, alone,
    is what must keep an envelope from being recorded."""
    n = draw(st.integers(0, len(_RAW) - 1))
    value: Any = f"@raw{n}@"
    if _RAW[n][0].startswith(b'"') and draw(st.booleans()):
        value = {value: draw(_VALUES)}
    for wrapper in draw(st.lists(st.sampled_from(["list", "object"]), max_size=3)):
        value = [draw(_VALUES), value] if wrapper == "list" else {draw(_TEXT): value}
    return value


#: Bytes a mutation puts anywhere in an item, cutting up to two.
_PIECES = [
    b"\\",
    b'"',
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b" ",
    b"\t",
    b"\n",
    b"\x00",
    b"\x7f",
    b"\xff",
    b"\\u0000",
    b"__type__",
    b'"delivery_tag": "tag-2", ',
    b'"exchange": 1, ',
    b'"routing_key": "elsewhere", ',
    b'"properties": {}, ',
    b'"delivery_info": "x", ',
]


def _written(text: str) -> tuple[bytes, bool]:
    """``text`` with each placeholder written as its raw text; and whether the script must
    record the result (every raw text in it is standard)."""
    item, required = text.encode(), True
    for n, (raw, standard) in enumerate(_RAW):
        placeholder = f'"@raw{n}@"'.encode()
        if placeholder in item:
            item, required = item.replace(placeholder, raw), required and standard
    return item, required


def _mutate(item: bytes, draws: list[tuple[int, int, int]]) -> bytes:
    for at, piece, cut in draws:
        at %= len(item) + 1
        item = item[:at] + _PIECES[piece % len(_PIECES)] + item[at + cut % 3 :]
    return item


@settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    headers=st.dictionaries(st.text(max_size=8), _VALUES, max_size=3),
    probe=_probed(),
    ascii_only=st.booleans(),
    compact=st.booleans(),
    draws=st.lists(
        st.tuples(st.integers(0, 1 << 16), st.integers(0, 1 << 8), st.integers(0, 8)), max_size=2
    ),
)
def test_what_the_script_records_kombus_restore_reads_as_the_item_and_its_tag(
    redis_client: redis.Redis,
    headers: dict[str, Any],
    probe: Any,
    ascii_only: bool,
    compact: bool,
    draws: list[tuple[int, int, int]],
) -> None:
    """The envelope check holds for envelopes nobody wrote by hand: whatever the script
    records, kombu's restore reads back as the item, under the tag, exchange and routing
    key kombu reads in it (what cjson takes and kombu's loads refuses or reads as another
    value is never recorded); and every envelope of values both read alike is recorded."""
    envelope = _envelope()
    envelope["headers"].update(headers)
    envelope["headers"]["probe"] = probe
    separators = (",", ":") if compact else (", ", ": ")
    item, required = _written(json.dumps(envelope, ensure_ascii=ascii_only, separators=separators))
    item = _mutate(item, draws)
    tag = _pop_one(redis_client, item)
    if tag is None:
        assert draws or not required, "a standard envelope was left unrecorded"
        return
    stored = redis_client.hget("unacked", tag)
    assert stored is not None
    # kombu's restore: loads(bytes_to_str(record)), then the message pushed back as it reads
    message, exchange, routing_key = kombu_loads(bytes_to_str(stored))
    assert message == kombu_loads(bytes_to_str(item))
    properties = message["properties"]
    assert tag == properties["delivery_tag"]
    assert [exchange, routing_key] == [
        properties["delivery_info"]["exchange"],
        properties["delivery_info"]["routing_key"],
    ]


def test_a_routing_key_too_long_to_decode_cheaply_is_left_to_kombu(
    redis_client: redis.Redis,
) -> None:
    envelope = _envelope()
    envelope["properties"]["delivery_info"]["routing_key"] = "r" * 400
    assert _pop_one(redis_client, json.dumps(envelope).encode()) is None


def test_an_item_that_cannot_be_recorded_ends_the_batch_and_comes_alone_next(
    redis_client: redis.Redis,
) -> None:
    # Given two good envelopes, one the script cannot record, and another good one
    good = [json.dumps({**_envelope(), "n": n}).encode() for n in range(3)]
    for n, item in enumerate(good):
        good[n] = item.replace(b'"6f1c-tag"', f'"tag-{n}"'.encode())
    bad = b"not json"
    redis_client.rpush("q", *reversed([good[0], good[1], bad, good[2]]))
    script = redis_client.register_script(reserve.source())

    def run() -> list[Any]:
        keys = ["unacked", "unacked_index", "aside", "aside_index", "q"]
        return list(script(keys=keys, args=[10, 1 << 20, time.time(), 0, 0]))

    # When the script runs: the two good ones, recorded; the bad one is back at the front
    assert run() == [1, good[0], b"tag-0", 1, good[1], b"tag-1"]
    # Then next time it comes alone, unrecorded, for kombu's path to judge
    assert run() == [1, bad, b""]
    assert run() == [1, good[2], b"tag-2"]
    assert redis_client.hlen("unacked") == 3


def test_an_item_over_the_limit_is_set_aside_whole_and_only_its_sample_comes_back(
    redis_client: redis.Redis,
) -> None:
    # Given a good envelope, one of 3 MB (body first, headers last, as kombu writes it),
    # and another good one
    good = [json.dumps({**_envelope(), "n": n}).encode() for n in range(2)]
    for n, item in enumerate(good):
        good[n] = item.replace(b'"6f1c-tag"', f'"tag-{n}"'.encode())
    giant = json.dumps({**_envelope(), "body": "A" * 3_000_000}).encode()
    redis_client.rpush("q", *reversed([good[0], giant, good[1]]))
    script = redis_client.register_script(reserve.source())
    # When the script runs with a 1 MB limit and 500 bytes of head and of tail
    keys = ["unacked", "unacked_index", "aside-1", "aside_index", "q"]
    reply = script(keys=keys, args=[10, 1 << 30, time.time(), 1_000_000, 500])
    # Then the good one before it is recorded, and the giant ends the batch: only its head
    # and tail come back, with its size, and it waits whole under the key it was given
    assert reply == [1, good[0], b"tag-0", 1, giant[:500] + giant[-500:], f"#{len(giant)}".encode()]
    assert redis_client.get("aside-1") == giant
    assert redis_client.zrange("aside_index", 0, -1) == [b"aside-1"]
    assert redis_client.hkeys("unacked") == [b"tag-0"]
    assert redis_client.lrange("q", 0, -1) == [good[1]]
    # and the worker reads the task and id from that sample without decoding it
    assert oversize.named(reply[4]) == ("checkpoint.save", "i-1")


@pytest.mark.parametrize(
    ("start", "parsed"),
    [
        (b'*2\r\n$11\r\ncheckpoints\r\n$209715200\r\n{"body', (34, b"checkpoints", 209715200)),
        (b"*2\r\n$4\r\nq\x06\x163\r\n$5\r\nhello\r\n", (18, b"q\x06\x163", 5)),
        (b"*2\r\n$11\r\ncheckpoints\r\n$2097", None),  # not all arrived yet
        (b"*-1\r\n", None),  # BRPOP timed out
        (b"-ERR wrong type\r\n", None),
    ],
)
def test_the_length_of_a_pops_item_is_read_from_the_start_of_its_reply(
    start: bytes, parsed: tuple[int, bytes, int] | None
) -> None:
    assert redis_hooks._pop_reply_start(start) == parsed


@pytest.fixture
def dead_letters(redis_client: redis.Redis) -> Iterator[DeadLetters]:
    """Dead letters recorded on the private server, as the worker's runtime records them."""
    letters = DeadLetters(redis_client, KeySpace())
    runtime.install(Runtime(InMemoryStore(), redis_client, KeySpace(), letters))
    yield letters
    runtime.reset()


def test_a_batch_meeting_an_oversize_item_delivers_those_before_and_sets_it_aside(
    guarded: None, broker: redis.Redis, redis_server: RedisServer, dead_letters: DeadLetters
) -> None:
    # Given two messages, a 3 MB one, and two more, queued for a consumer whose limit
    # (oversize.transport_options) a 3 MB item is over
    _publish(redis_server.url, 2)
    with Connection(redis_server.url) as conn:
        Producer(conn.channel()).publish(
            {"n": "giant", "pad": "x" * 3_000_000},
            routing_key=QUEUE,
            declare=[Queue(QUEUE)],
            headers={"task": "checkpoint.save", "id": "giant-id"},
        )
    _publish(redis_server.url, 2)
    options = {"visibility_timeout": 3600, **oversize.transport_options("", 1024 * 1024, 16)}
    conn = Connection(redis_server.url, transport_options=options)
    channel = conn.channel()
    channel.basic_qos(0, 8, False)
    received: list[Any] = []
    channel.basic_consume(QUEUE, no_ack=False, callback=received.append, consumer_tag="t")
    try:
        # When it reads (a wait that wakes at once, then the script)
        conn.drain_events(timeout=5)
        # Then the ones before the giant are delivered, the giant is not, and the batch ends
        # there: the two after it stay queued
        assert [m.decode()["n"] for m in received] == [0, 1]
        assert broker.llen(QUEUE) == 2
        # and the giant waits whole on the broker, named by its dead letter
        (letter,) = dead_letters.list().entries
        assert (letter.kind, letter.task, letter.task_id) == (
            "oversize",
            "checkpoint.save",
            "giant-id",
        )
        assert "set aside by the reserve script" in letter.reason
        kept = broker.get(letter.headers["raw_key"]) or b""
        assert len(kept) == letter.raw_bytes > 4_000_000
        assert json.loads(kept)["headers"]["id"] == "giant-id"
        assert broker.zrange(KeySpace().oversize_index(), 0, -1) == [
            letter.headers["raw_key"].encode()
        ]
        assert broker.hlen(channel.unacked_key) == 2
    finally:
        conn.close()


def test_peeking_at_a_pops_reply_reads_the_items_length_and_leaves_the_reply_unread(
    redis_client: redis.Redis,
) -> None:
    # Given a BRPOP whose reply, carrying a 2 MB item, waits on a connection's socket
    item = b"x" * 2_000_000
    redis_client.lpush("q", item)
    # (a connection of its own: a pool's get_connection needs a command name before
    # redis-py 5.3 and warns of one from 5.3 on)
    connection: Any = redis.Connection  # (untyped in redis-py's hints)
    conn: Any = connection(**redis_client.connection_pool.connection_kwargs)
    conn.connect()
    try:
        conn.send_command("BRPOP", "q", 1)
        # (polled as kombu polls it: redis-py 5's can_read would read it into hiredis)
        assert select.select([conn._sock], [], [], 5)[0]
        # When the reader peeks at it
        peeked = redis_hooks.peek_pop_reply(conn)
        # Then it learns the key and the item's length, and the reply is still whole
        assert peeked == (len(b"*2\r\n$1\r\nq\r\n$2000000\r\n"), b"q", len(item))
        assert conn.read_response() == [b"q", item]
    finally:
        conn.disconnect()


def test_peeking_at_a_killed_connection_gives_up_at_once_and_the_parser_reports_it(
    redis_client: redis.Redis,
) -> None:
    # Given an idle channel's wait (BLMOVE) on a connection the broker then kills
    connection: Any = redis.Connection  # (untyped in redis-py's hints)
    conn: Any = connection(**redis_client.connection_pool.connection_kwargs)
    conn.connect()
    try:
        conn.send_command("CLIENT", "ID")
        client_id = conn.read_response()
        conn.send_command(*reserve.wait_command("q", 30))
        assert redis_client.client_kill_filter(_id=client_id) == 1
        # (polled as kombu polls it: the closed socket is readable)
        assert select.select([conn._sock], [], [], 5)[0]
        # When the reader peeks at the wait's reply
        started = time.monotonic()
        peeked = redis_hooks.peek_bulk_reply(conn)
        took = time.monotonic() - started
        # Then it returns at once (a socket at its end stays readable: waiting for a reply
        # there spun the main process for the whole patience, 2 s per killed connection),
        # and reading the reply reports the lost connection
        assert peeked is None
        assert took < redis_hooks._PEEK_PATIENCE / 4, took
        with pytest.raises(redis.ConnectionError):
            conn.read_response()
    finally:
        conn.disconnect()


def test_past_the_items_kept_the_oldest_oversize_items_are_deleted(
    redis_client: redis.Redis,
) -> None:
    # Given three items set aside, oldest first, and a guard keeping two
    keys = KeySpace()
    guard = oversize.Guard(keys, max_item_bytes=1024, kept=2)
    aside = [keys.oversize_body(f"t{n}") for n in range(3)]
    for n, key in enumerate(aside):
        redis_client.set(key, b"x" * 2048)
        redis_client.zadd(keys.oversize_index(), {key: 1000.0 + n})
    # When the worker trims them
    oversize.forget_oldest(redis_client, guard)
    # Then the two newest are kept, indexed, and the oldest is gone
    assert redis_client.zrange(keys.oversize_index(), 0, -1) == [k.encode() for k in aside[1:]]
    assert [redis_client.exists(key) for key in aside] == [0, 1, 1]
