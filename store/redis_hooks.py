"""Every use of redis-py below its client API, in one place: sending packed commands down a
pooled connection and reading their replies by hand.

Nothing else in checkpointq reaches past redis-py's public client API (commands, pipelines,
``Script``); when redis-py changes its connection classes, this module is the one to re-read.
"""

from __future__ import annotations

from typing import Any

from redis import exceptions as redis_errors


def round_trip(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one write down one pooled connection of ``client`` and read every
    reply, an error reply as its exception in its place (so the connection stays in step).

    Connection errors are retried by the client's retry policy, which sends them all again.
    """
    pool = client.connection_pool
    # A client made with single_connection_client keeps one connection for every command.
    own: Any = getattr(client, "connection", None)
    conn: Any = own or pool.get_connection()

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
