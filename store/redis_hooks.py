"""Every use of redis-py below its client API, in one place: sending packed commands down a
pooled connection and reading their replies by hand.

Nothing else in checkpointq reaches past redis-py's public client API (commands, pipelines,
``Script``); when redis-py changes its connection classes, this module is the one to re-read.
The hand-sent path costs less client CPU per store write than redis-py's own
``pipeline(transaction=False)`` (docs/performance.md), so it is kept, but only on the
redis-py lines it is proven on (``PROVEN``) and when its self-test passes; anywhere else
writes go through the pipeline, and one line says so.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import redis
from redis import exceptions as redis_errors
from redis.connection import AbstractConnection, ConnectionPool

logger = logging.getLogger(__name__)

#: redis-py major versions the hand-sent path is proven on (scripts/test-matrix runs the
#: lowest and highest). Before 5.3 a pool's ``get_connection`` takes a command name; from
#: 5.3 on passing one is deprecated.
PROVEN = (5, 6, 7, 8)
_TAKES_COMMAND_NAME = tuple(int(part) for part in redis.__version__.split(".")[:2]) < (5, 3)


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


def round_trip(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one write down one pooled connection of ``client`` and read every
    reply, an error reply as its exception in its place (so the connection stays in step).

    Connection errors are retried by the client's retry policy, which sends them all again.
    """
    why = refusal()
    if why is not None:
        _announce_pipeline(why)
        return _pipelined(client, commands)
    pool = client.connection_pool
    # A client made with single_connection_client keeps one connection for every command.
    own: Any = getattr(client, "connection", None)
    conn: Any = own or (
        pool.get_connection("PIPELINE") if _TAKES_COMMAND_NAME else pool.get_connection()
    )

    def send() -> list[Any]:
        conn.send_packed_command(conn.pack_commands(commands))
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


@cache
def _announce_pipeline(why: str) -> None:
    logger.warning(
        "store writes go through redis-py's pipeline: the hand-sent path is off (%s)", why
    )
