"""The events stream: one entry per session that left the store other than by a delete.

``<prefix>.cq:events`` (``KeySpace.events``) is a capped stream an API server follows with
``XREAD`` or a consumer group. Each entry has ``type``, ``session_id`` and ``time`` (epoch
seconds); some kinds add a ``reason``:

* ``expired``: the sweep removed a session whose deadline had passed (``tasks/sweep.py``);
* ``dropped``, reason ``key gone``: reconciliation removed the entry of a session whose value
  another writer (a Go ``RedisStore``) deleted directly (``tasks/reconcile.py``).

A session is announced once per removal: the store scripts remove each entry once, whoever
runs them concurrently.
"""

from __future__ import annotations

import time
from typing import Any

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.errors import redis_unavailable

#: A session removed by the sweep: its deadline had passed.
EXPIRED = "expired"
#: A session whose entry reconciliation removed; the event's ``reason`` says why.
DROPPED = "dropped"
#: Reason of a ``dropped`` event: another writer deleted the value directly.
KEY_GONE = "key gone"


def announce(
    client: Any,
    keys: KeySpace,
    kind: str,
    session_ids: list[str],
    maxlen: int,
    reason: str | None = None,
) -> None:
    """XADD one ``kind`` event per session (so a consumer handles each id on its own),
    trimming the stream to about ``maxlen`` entries; one pipelined round trip.

    Raises:
        StoreUnavailable: the store Redis could not be reached.
    """
    if not session_ids:
        return
    now = repr(time.time())
    extra = {} if reason is None else {"reason": reason}
    with redis_unavailable(f"announce {kind} sessions"):
        pipe = client.pipeline(transaction=False)
        for session_id in session_ids:
            pipe.xadd(
                keys.events(),
                {"type": kind, "session_id": session_id, "time": now, **extra},
                maxlen=maxlen,
                approximate=True,
            )
        pipe.execute()
