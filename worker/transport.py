"""Keep one malformed queue item from stopping a worker: dead-letter it instead.

kombu's Redis transport pops each item with BRPOP and decodes it (JSON envelope, then the
base64 body) inside the worker's event loop, before any Celery hook can see it. An item
that is not JSON, a JSON value that is not an envelope, or an envelope whose body is not
valid base64 raised there, and the worker exited ("Unrecoverable error"): anyone able to
LPUSH to the queue could stop the fleet, one worker per item, and the item itself was gone
(popped, never in the ``unacked`` hash). The reader installed here decodes the item the way
kombu will, and refuses what would not decode: it records the raw item as a dead letter and
carries on with the next one.

Why patch kombu's Redis ``Channel`` rather than select a transport subclass: kombu ignores
an explicit transport for ``redis+socket://`` URLs (the embedded Redis), and Sentinel's
channel derives from the same class, so one replacement of its BRPOP reader covers every
Redis spelling. It is installed only in worker processes (``install()`` is called by the
worker's consumer), and the body mirrors kombu 5.7's ``Channel._brpop_read``, which
``pyproject.toml`` pins; ``tests/faults/test_abuse.py`` fails if an upgrade changes it.

Why this reader and not a smaller hook (looked at again for the one-home-per-contract work):
the decoding that raises runs inside kombu's reader, so a hook must sit there or below it.
Wrapping the ``loads`` that kombu's Redis module calls would also change how it restores
unacknowledged messages (the same name decodes them), and a ``Message`` subclass is built
only after the raw item is gone, so it could not record what arrived. Replacing the one
method keeps the change to the one place where a raw item and its queue are both in hand.
"""

from __future__ import annotations

import logging
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import loads as kombu_loads

from checkpointq.store.errors import StoreUnavailable
from checkpointq.tasks.dead_letters import Reason
from checkpointq.tasks.refusals import refuse
from checkpointq.worker import backpressure

logger = logging.getLogger(__name__)

#: kombu's own reader, kept to tell whether ours is installed.
_KOMBU_BRPOP_READ = kombu_redis.Channel._brpop_read


def _text(value: bytes | str) -> str:
    """kombu's ``bytes_to_str``: UTF-8 with replacement characters."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


#: A task name or id longer than this, read from a malformed envelope, is not trusted.
_MAX_NAME = 256


def _named(payload: Any) -> tuple[str | None, str | None]:
    """The task name and id an envelope's headers give, when the envelope itself decoded.

    An envelope whose body is bad (not base64, say) still names its request, and a
    producer may be waiting on that id: with it, the dead letter gets a refusal record and
    ``wait_durable`` is told at once instead of timing out. Anything not a short string is
    ignored: the raw item is recorded whole either way.
    """
    headers = payload.get("headers") if isinstance(payload, dict) else None
    if not isinstance(headers, dict):
        return None, None
    task, task_id = headers.get("task"), headers.get("id")
    return (
        task if isinstance(task, str) and 0 < len(task) <= _MAX_NAME else None,
        task_id if isinstance(task_id, str) and 0 < len(task_id) <= _MAX_NAME else None,
    )


def _refuse(
    channel: Any,
    key: bytes | str,
    item: bytes,
    queue: str,
    exc: BaseException,
    payload: Any = None,
) -> None:
    """Record an undecodable item; if the store is down, put the item back in the queue.

    ``payload`` is the item's JSON when it parsed (None otherwise).
    """
    reason = f"queue item is not a Celery message ({type(exc).__name__}: {exc})"
    task, task_id = _named(payload)
    try:
        refuse(
            Reason.UNDECODABLE,
            reason,
            task=task,
            task_id=task_id,
            raw=item,
            headers={"queue": queue},
        )
    except StoreUnavailable as down:
        # Popped, never in the ``unacked`` hash: back at the far end of the list it goes, and
        # the worker stops consuming until the store takes writes (it comes round again then).
        # Should the broker refuse that too, DeadLetters.add has logged the whole item.
        logger.error("could not dead-letter a malformed item from %s; put it back", queue)
        with channel.conn_or_acquire() as client:  # as kombu's own _put: not the BRPOP one
            client.lpush(key, item)
        backpressure.trip(str(down))


def _guarded_brpop_read(self: Any, **options: Any) -> bool:
    """kombu's ``Channel._brpop_read`` with the decoding of the item guarded."""
    try:
        try:
            dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
        except self.connection_errors:
            # As kombu: disconnect so that the next iteration reconnects.
            self.client.connection.disconnect()
            raise
        if not dest__item:
            raise Empty()
        key, item = dest__item
        dest = _text(key).rsplit(self.sep, 1)[0]
        self._queue_cycle.rotate(dest)
        payload: Any = None
        try:
            payload = kombu_loads(_text(item))  # type: ignore[no-untyped-call]
            # Build the message as the consumer callback will (envelope fields, base64 body),
            # so that whatever would raise there raises here, where it can be refused.
            self.Message(payload, channel=self)
        except Exception as exc:  # any decoding failure means "not a Celery message"
            _refuse(self, key, item, dest, exc, payload)
            return True
        self.connection._deliver(payload, dest)
        return True
    finally:
        self._in_poll = None
        self._flush_brpop_reauth()


def install() -> None:
    """Use the guarded reader in this process's Redis channels (idempotent)."""
    kombu_redis.Channel._brpop_read = _guarded_brpop_read  # type: ignore[method-assign]


def installed() -> bool:
    return kombu_redis.Channel._brpop_read is _guarded_brpop_read
