"""``redis_hooks.round_trip`` for ``redis.asyncio``: commands packed once, sent in one write
down a connection this module keeps, their replies read by hand, with no pipeline object,
no pool checkout and no per-read timeout task. Like its sync twin, the one place the asyncio
client reaches below redis-py's client API (to the connection's ``pack_commands``,
``send_packed_command``, ``read_response`` and ``disconnect``, and the pool's
``get_connection``), and only on a redis-py line it is proven on whose self-test passes
(``refusal``); anywhere else the same commands go through ``pipeline(transaction=False)``
and one line says so.

Why: the asyncio pipeline costs a publish ~90 us more than the sync client's hand-sent round
trip (docs/performance.md, "The asyncio client"): a task for the write's timeout
(``asyncio.wait_for``), a timeout context per reply, the pool's lock and its readiness
check, the pipeline's own bookkeeping. Here one watchdog bounds every exchange
(``RoundTrips``), and a connection goes back to this object's idle list only after an
exchange read every reply; any error, timeout or cancellation part-way closes it (its socket
may hold a reply nobody will read), and it reconnects on its next use.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from functools import cache
from typing import Any

import redis.asyncio
from redis import exceptions as redis_errors
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from checkpointq.store import redis_hooks

logger = logging.getLogger(__name__)


def _self_test() -> str | None:
    """Why the asyncio connection methods the hand-sent path calls are not there as
    coroutines (or ``pack_commands`` as a function), or None."""
    for owner, names in (
        (ConnectionPool, ("get_connection", "release")),
        (AbstractConnection, ("send_packed_command", "read_response", "disconnect")),
    ):
        for name in names:
            if not inspect.iscoroutinefunction(getattr(owner, name, None)):
                return f"redis.asyncio {owner.__name__}.{name} is not a coroutine function"
    if not callable(getattr(AbstractConnection, "pack_commands", None)):
        return "redis.asyncio AbstractConnection.pack_commands is gone"
    return None


@cache
def refusal() -> str | None:
    """Why the asyncio hand-sent path must not be used with the installed redis-py, or
    None (its sync twin's verdict on the line first)."""
    return redis_hooks.refusal() or _self_test()


@cache
def _announce_pipeline(why: str) -> None:
    logger.warning(
        "asyncio publishes go through redis-py's pipeline: the hand-sent path is off (%s)", why
    )


class RoundTrips:
    """One write and its replies per call on connections of ``client`` (a
    ``redis.asyncio.Redis`` made without a socket timeout), at most ``timeout`` seconds each
    (a quarter more at worst); its connections are the client's (``client.aclose()`` closes
    them).

    Each call's commands go down one connection in one write, and the next call may take
    another: a command that must follow one on the same connection (a ``WAIT`` for the
    replicas to have a publish) belongs in the same call, never in a call of its own or
    through the client's pool (whose connections are not these).

    The bound is one watchdog per object, not a timer per call: ``asyncio.timeout`` costs a
    round trip ~5 us (a timer handle made, pushed on the loop's heap and cancelled), a third
    of a PING's; the watchdog runs every quarter ``timeout`` while calls are in flight and
    cancels those past their deadline, which then raise ``redis.TimeoutError``.
    """

    def __init__(self, client: redis.asyncio.Redis, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        #: Why the hand-sent path is off, or None (read once, at start-up).
        self.refusal = refusal()
        if self.refusal is not None:
            _announce_pipeline(self.refusal)
        self._idle: list[Any] = []
        #: Calls in flight: their task and deadline (loop time), by a token of their own.
        self._flying: dict[object, tuple[asyncio.Task[Any], float]] = {}
        self._expired: set[object] = set()
        self._watch: asyncio.TimerHandle | None = None

    async def __call__(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Every reply of ``commands`` (sent in one write), an error reply as its exception
        in its place.

        Raises:
            redis.TimeoutError: no complete answer within ``timeout`` seconds.
            redis.ConnectionError: as redis-py raises it.
        """
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:  # not in a task: nothing for the watchdog to cancel
            try:
                async with asyncio.timeout(self.timeout):
                    return await self._exchange(commands)
            except TimeoutError as exc:
                raise self._timed_out() from exc
        token = object()
        self._flying[token] = (task, loop.time() + self.timeout)
        if self._watch is None:
            self._watch = loop.call_later(self.timeout / 4, self._check, loop)
        try:
            return await self._exchange(commands)
        except asyncio.CancelledError:
            if token in self._expired and task.uncancel() == 0:
                raise self._timed_out() from None
            raise
        finally:
            del self._flying[token]
            self._expired.discard(token)

    def _timed_out(self) -> redis_errors.TimeoutError:
        return redis_errors.TimeoutError(f"no answer within {self.timeout:.1f} s")

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        """The watchdog: cancel the calls past their deadline; look again while any fly."""
        now = loop.time()
        for token, (task, deadline) in self._flying.items():
            if deadline <= now and token not in self._expired:
                self._expired.add(token)
                task.cancel()
        self._watch = loop.call_later(self.timeout / 4, self._check, loop) if self._flying else None

    async def _exchange(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        if self.refusal is not None:
            return await self._pipelined(commands)
        conn = self._idle.pop() if self._idle else await self._connection()
        try:
            await conn.send_packed_command([redis_hooks.packed(conn, commands)], check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except redis_errors.ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            # Cancelled, timed out or failed part-way: the socket may hold replies.
            await conn.disconnect(nowait=True)
            self._idle.append(conn)  # reconnects on its next send
            raise
        self._idle.append(conn)
        return replies

    async def _connection(self) -> Any:
        # Taken from the client's pool for good: kept here between round trips.
        pool: Any = self.client.connection_pool
        if redis_hooks.TAKES_COMMAND_NAME:
            return await pool.get_connection("PIPELINE")
        return await pool.get_connection()

    async def _pipelined(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies
