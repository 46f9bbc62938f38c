"""The producer rule: every save and delete carries a causal ``seq`` (docs/protocol.md).

A hybrid logical clock: a request for session S is stamped

    max(now µs, the last seq this process stamped + 1, the last fence seen for S + 1, after + 1)

where a fence is "seen" whenever this process reads it (``load``, ``wait_durable``), and
``after`` is a fence a caller carries over from another process. A save that follows a load
therefore sorts after the write it loaded, however far this producer's clock lags the one
that made that write: with wall-clock stamps alone, an apiserver replica 2 s behind another
had every save that followed the other's refused as stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from checkpointq.store.base import MAX_SEQ
from checkpointq.store.errors import InvalidInput

#: Past this many remembered sessions, those whose fence the clock has passed (and which
#: therefore no longer raise a stamp) are forgotten.
_PRUNE_AT = 100_000


def wall_clock_us() -> int:
    """Microseconds since the Unix epoch."""
    return time.time_ns() // 1000


class SeqClock:
    """Causal ``seq`` stamps, strictly increasing within the process; thread-safe."""

    def __init__(self, now_us: Callable[[], int] = wall_clock_us) -> None:
        """``now_us``: the wall clock in µs (tests give producers skewed ones)."""
        self._now_us = now_us
        self._lock = threading.Lock()
        self._last = 0
        self._seen: dict[str, int] = {}

    def observe(self, session_id: str, seq: int) -> None:
        """Remember that ``session_id``'s fence was at ``seq``."""
        with self._lock:
            if seq > self._seen.get(session_id, -1):
                self._seen[session_id] = seq
            if len(self._seen) > _PRUNE_AT:
                now = self._now_us()
                self._seen = {sid: s for sid, s in self._seen.items() if s >= now}

    def next(self, session_id: str | None = None, after: int | None = None) -> int:
        """A fresh ``seq`` for a request on ``session_id`` that must sort after ``after``.

        Raises:
            InvalidInput: the stamp would pass 2**53-1 (a fence or ``after`` that high).
        """
        with self._lock:
            floor = max(self._last, -1 if after is None else after)
            if session_id is not None:
                # Once stamped, this session's fence is covered by _last: forget it.
                floor = max(floor, self._seen.pop(session_id, -1))
            seq = max(self._now_us(), floor + 1)
            if seq > MAX_SEQ:
                raise InvalidInput(f"would be {seq}, past 2**53-1", field="seq")
            self._last = seq
            return seq


#: The process's clock: every client in a process shares it by default.
seq_clock = SeqClock()
