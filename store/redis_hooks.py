"""Every use of redis-py below its client API, in one place: sending packed commands down a
pooled connection and reading their replies by hand, and peeking at a pop's reply on the
socket to learn its item's length before anything reads it (``worker/oversize.py``), or to
drop a reply whose item the reader does not need (an idle worker's wake-up).

Nothing else in checkpointq reaches past redis-py's public client API (commands, pipelines,
``Script``) but its asyncio twin (``redis_hooks_aio``); when redis-py changes its connection
classes, these two modules are the ones to re-read.
The hand-sent path costs less client CPU per store write than redis-py's own
``pipeline(transaction=False)`` (docs/performance.md), so it is kept, but only on the
redis-py lines it is proven on (``PROVEN``) and when its self-test passes; anywhere else
writes go through the pipeline, and one line says so.
"""

from __future__ import annotations

import logging
import re
import select
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from time import monotonic
from typing import Any, TypeVar

import hiredis
import redis
from redis import exceptions as redis_errors
from redis.connection import AbstractConnection, ConnectionPool

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: redis-py major versions the hand-sent path is proven on (scripts/test-matrix runs the
#: lowest and highest). Before 5.3 a pool's ``get_connection`` takes a command name; from
#: 5.3 on passing one is deprecated.
PROVEN = (5, 6, 7, 8)
TAKES_COMMAND_NAME = tuple(int(part) for part in redis.__version__.split(".")[:2]) < (5, 3)


def _self_test() -> str | None:
    """Why the connection methods the hand-sent path calls are not there, or None."""
    for owner, names in (
        (ConnectionPool, ("get_connection", "release")),
        (AbstractConnection, ("pack_commands", "send_packed_command", "read_response")),
    ):
        for name in names:
            if not callable(getattr(owner, name, None)):
                return f"{owner.__name__}.{name} is gone"
    return None


@cache
def refusal() -> str | None:
    """Why the hand-sent path must not be used with the installed redis-py, or None."""
    major = redis.__version__.split(".")[0]
    if not major.isdigit() or int(major) not in PROVEN:
        return f"redis-py {redis.__version__} is not a line it is proven on"
    return _self_test()


def packed(conn: Any, commands: Sequence[tuple[Any, ...]]) -> bytes:
    """``commands`` in RESP, one buffer: by hiredis's ``pack_command`` (its public API; a
    third of redis-py's per-argument encoding, ~6 against ~18 us for a staged save's two
    commands), or the connection's own packer for an argument hiredis does not take."""
    try:
        return b"".join([hiredis.pack_command(command) for command in commands])
    except TypeError:
        # One buffer, one send: redis-py sends a large argument as a chunk of its own, and
        # each send can wake the server for a partial read.
        return b"".join(conn.pack_commands(commands))


def round_trip(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one write down one pooled connection of ``client`` and read every
    reply, an error reply as its exception in its place (so the connection stays in step).

    Connection errors are retried by the client's retry policy, which sends them all again.
    A command that must follow one on the same connection (``WAIT`` after a publish) belongs
    in the same call: the next call may take another connection from the pool.
    """
    why = refusal()
    if why is not None:
        _announce_pipeline(why)
        return _pipelined(client, commands)
    # A client made with single_connection_client keeps one connection for every command.
    own: Any = getattr(client, "connection", None)
    return _exchange(client.connection_pool, commands, own)


def _exchange(pool: Any, commands: list[tuple[Any, ...]], own: Any = None) -> list[Any]:
    """``commands`` in one write down ``own`` or a connection of ``pool``, and every reply
    read, an error reply as its exception in its place (the connection stays in step);
    connection errors retried by the connection's retry policy, which sends them all again."""
    conn: Any = own or (
        pool.get_connection("PIPELINE") if TAKES_COMMAND_NAME else pool.get_connection()
    )

    def send() -> list[Any]:
        conn.send_packed_command([packed(conn, commands)])
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis_errors.ResponseError as exc:
                replies.append(exc)
        return replies

    try:
        replies: list[Any] = conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
        return replies
    except BaseException:
        conn.disconnect()
        raise
    finally:
        if own is None:
            pool.release(conn)


def _pipelined(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``round_trip`` through redis-py's public pipeline: the same commands and replies."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    return replies


def transaction(pool: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` between MULTI and EXEC, sent in one write down one connection of
    ``pool``: what redis-py's ``pipeline(transaction=True).execute(raise_on_error=False)``
    returns (EXEC's replies, a command's error as its exception in its place) and raises
    (a command the broker refused to queue, OOM say, as that error; connection errors
    retried by the connection's retry policy, which sends the whole transaction again),
    without making a client and a pipeline for it (``worker/coalesce.py``'s grouped ack).
    Call it only where ``refusal()`` is None."""
    wrapped = [("MULTI",), *commands, ("EXEC",)]
    *queued, reply = _exchange(pool, wrapped)
    # MULTI's OK, then each QUEUED: a refusal there aborted EXEC, and as redis-py the first
    # one is the error
    for number, (answer, command) in enumerate(zip(queued, wrapped, strict=False)):
        if isinstance(answer, redis_errors.ResponseError):
            raise _annotated(answer, number, command)
    if isinstance(reply, Exception):
        raise reply
    if not isinstance(reply, list) or len(reply) != len(commands):
        raise redis_errors.ResponseError("Wrong number of responses from the transaction")
    return reply


def _annotated(exc: redis_errors.ResponseError, number: int, command: tuple[Any, ...]) -> Any:
    """``exc`` as redis-py's pipeline words a command's error: "Command # <n> (<command>) of
    pipeline caused error: <its text>"."""
    text = " ".join(a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in command)
    text = text if len(text) <= 100 else text[:97] + "..."
    message = f"Command # {number} ({text}) of pipeline caused error: {exc.args[0]}"
    exc.args = (message, *exc.args[1:])
    return exc


@cache
def _announce_pipeline(why: str) -> None:
    logger.warning(
        "store writes go through redis-py's pipeline: the hand-sent path is off (%s)", why
    )


# -- reading a pop's reply by hand (worker/oversize.py) -------------------------------------

#: ``*2`` ``$<key length>`` <key> ``$<item length>``: the start of BRPOP's reply, in RESP2 and
#: RESP3 alike.
_POP_REPLY = re.compile(rb"\*2\r\n\$(\d{1,9})\r\n")
_BULK = re.compile(rb"\$(\d{1,10})\r\n")
#: Bytes peeked for a reply's start: room for the longest queue key kombu names.
_PEEK_BYTES = 1024
#: How long a reply's start may take to arrive once its first bytes did, seconds.
_PEEK_PATIENCE = 2.0


def _parser_holds_bytes(connection: Any) -> bool:
    """Whether the connection's parser has read bytes it has not yet parsed (hiredis's
    reader or the Python parser's buffer): the socket then does not start at a reply."""
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if reader is not None:
        return bool(reader.has_data()) if hasattr(reader, "has_data") else True
    buffer = getattr(parser, "_buffer", None)
    if buffer is not None:
        return bool(buffer.unread_bytes())
    return parser is None


def peek_pop_reply(connection: Any) -> tuple[int, bytes, int] | None:
    """The length of the start of the BRPOP reply waiting on ``connection``'s socket, the
    key it names and the length of the item it carries, all left unread; None when that
    cannot be known (no plain socket, TLS, bytes already read by the parser, or no item).
    """
    return _peek(connection, _pop_reply_start, b"*2")


def peek_bulk_reply(connection: Any) -> tuple[int, int] | None:
    """The length of the header of the bulk reply (one item, as BLMOVE answers) waiting on
    ``connection``'s socket and the length of its item, left unread; None when that cannot
    be known (as ``peek_pop_reply``) or the reply carries no item."""
    return _peek(connection, _bulk_reply_start, b"$")


def _peek(connection: Any, parse: Callable[[bytes], _T | None], opening: bytes) -> _T | None:
    """``parse`` of the start of the reply waiting on ``connection``'s socket, read with
    MSG_PEEK (nothing consumed), once it parses or cannot (it does not begin ``opening``)."""
    sock = getattr(connection, "_sock", None)
    if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
        return None
    if refusal() is not None or _parser_holds_bytes(connection):
        return None
    deadline = monotonic() + _PEEK_PATIENCE
    while True:
        try:
            start = sock.recv(_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            start = b""
        except OSError:
            return None  # the parser will meet the same error and report it
        else:
            if not start:
                # Closed by the broker (a killed connection): the socket stays readable, so
                # waiting for a reply would spin the main process until the deadline.
                return None  # the parser meets the end and reports it
        parsed = parse(start)
        # Done once it parses, or once it cannot: too long, or not an item's reply (a null
        # or an error). A bare "*" may yet become "*2": wait for more of it.
        item_reply = start.startswith(opening) or opening.startswith(start)
        if parsed is not None or len(start) >= _PEEK_BYTES or not item_reply:
            return parsed
        if monotonic() > deadline:
            return None
        select.select([sock], [], [], 0.01)


def _bulk_reply_start(start: bytes) -> tuple[int, int] | None:
    bulk = _BULK.match(start)
    return None if bulk is None else (bulk.end(), int(bulk.group(1)))


def _pop_reply_start(start: bytes) -> tuple[int, bytes, int] | None:
    array = _POP_REPLY.match(start)
    if array is None:
        return None
    key_at = array.end()
    key_end = key_at + int(array.group(1))
    if start[key_end : key_end + 2] != b"\r\n":
        return None
    bulk = _BULK.match(start, key_end + 2)
    if bulk is None:
        return None
    return bulk.end(), start[key_at:key_end], int(bulk.group(1))


#: Bytes ``discard`` holds at a time.
_DISCARD_CHUNK = 1024 * 1024


def discard(connection: Any, size: int) -> None:
    """Read and drop exactly ``size`` bytes from ``connection``'s socket, a chunk at a time."""
    for _ in stream(connection, size, _DISCARD_CHUNK):
        pass


def stream(connection: Any, size: int, chunk: int) -> Iterator[bytes]:
    """Read exactly ``size`` bytes from ``connection``'s socket, ``chunk`` at a time (the
    socket's own timeout applies to each read). The connection is closed if this stops
    early: its reply is then cut short."""
    sock: socket.socket = connection._sock
    buffer = bytearray(min(size, chunk))
    view = memoryview(buffer)
    left = size
    try:
        while left:
            filled = 0
            want = min(left, len(buffer))
            while filled < want:
                got = sock.recv_into(view[filled:want])
                if not got:
                    raise redis_errors.ConnectionError("connection closed mid-reply")
                filled += got
            left -= filled
            yield bytes(view[:filled])
    except BaseException:
        connection.disconnect()
        raise
