"""Sessions whose database row another client holds, recorded for ``health`` and ``top``.

A session whose row is locked by another client (``SessionBusy``) waits and retries on its
own while the worker applies everything else, so nothing in the worker looks stuck, yet an
operator needs to know who holds the row: restarting the worker would not release it. Each
time a worker meets such a row it writes who holds it into a hash beside the dead letters
(``KeySpace.held_rows``); the hash expires ``TTL_SECONDS`` after the last write, and a
reader shows only entries seen within that time, so a lock released is forgotten by itself.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from checkpointq.store.errors import SessionBusy
from checkpointq.store.keys import KeySpace
from checkpointq.store.model import display_id

logger = logging.getLogger(__name__)

#: Seconds an entry is shown after it was last written: longer than the longest retry
#: countdown (60 s by default), so a row still held is seen again before its entry lapses.
TTL_SECONDS = 120


@dataclass(frozen=True, slots=True)
class HeldRow:
    """A session waiting on a row lock: who holds the row, and when a worker last saw it."""

    session_id: str
    holder: str
    seen_at: float

    def line(self, now: float) -> str:
        ago = max(0.0, now - self.seen_at)
        return (
            f"session {display_id(self.session_id)} waits on a row lock held by {self.holder} "
            f"(seen {ago:.0f}s ago; the worker applies every other session, and restarting "
            "it would not release the row)"
        )


def record(client: Any, keys: KeySpace, busy: SessionBusy) -> None:
    """Note that ``busy``'s session waits on its row (best effort: a broker that refuses
    the write loses only this note). A row another worker's statement held for a moment is
    no news for an operator."""
    if busy.by_worker:
        return
    value = json.dumps({"holder": busy.holder, "seen_at": time.time()})
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hset(keys.held_rows(), busy.session_id, value)
        pipe.expire(keys.held_rows(), TTL_SECONDS)
        pipe.execute()
    except RedisError as exc:
        logger.info("could not note the held row of session %s: %s", busy.session_id, exc)


def read(client: Any, keys: KeySpace, now: float | None = None) -> list[HeldRow]:
    """The rows seen held within ``TTL_SECONDS``, the most recently seen first."""
    now = time.time() if now is None else now
    rows: list[HeldRow] = []
    for field, raw in client.hgetall(keys.held_rows()).items():
        try:
            entry = json.loads(raw)
            row = HeldRow(_text(field), str(entry["holder"]), float(entry["seen_at"]))
        except (ValueError, KeyError, TypeError):
            continue
        if now - row.seen_at <= TTL_SECONDS:
            rows.append(row)
    return sorted(rows, key=lambda row: -row.seen_at)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
