"""The producer rule: every save and delete carries a causal ``seq`` (docs/protocol.md).

A hybrid logical clock, per session: a request for session S is stamped

    max(now µs, the floor of S + 1, after + 1)

where the floor of S is the highest of the fences this process read for S (``load``,
``wait_durable``) and of the stamps it gave S, and ``after`` is a fence a caller carries over
from another process. A save that follows a load therefore sorts after the write it loaded,
however far this producer's clock lags the one that made that write: with wall-clock stamps
alone, an apiserver replica 2 s behind another had every save that followed the other's
refused as stale.

The floor is the session's own, never the process's: a fence read for one session raises no
other session's stamps (issue 31: one fast clock's fence, adopted process-wide, had every
session of a healthy replica stamped an hour ahead and refused). Fences are bounded anyway:
the broker refuses a publish whose producer clock runs ahead of its own (publish.lua), so no
fence is ever further ahead of a server's clock than ``max_seq_ahead``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from checkpointq.store.base import MAX_SEQ
from checkpointq.store.errors import InvalidInput

#: Past this many remembered sessions, those whose floor the clock has passed (and which
#: therefore no longer raise a stamp) are forgotten.
_PRUNE_AT = 100_000


def wall_clock_us() -> int:
    """Microseconds since the Unix epoch."""
    return time.time_ns() // 1000


class SeqClock:
    """Causal ``seq`` stamps, strictly increasing per session; thread-safe."""

    def __init__(self, now_us: Callable[[], int] = wall_clock_us) -> None:
        """``now_us``: the wall clock in µs (tests give producers skewed ones)."""
        self._now_us = now_us
        self._lock = threading.Lock()
        self._floors: dict[str, int] = {}

    def now_us(self) -> int:
        """This producer's wall clock, in µs: what publish.lua compares with the broker's."""
        return self._now_us()

    def observe(self, session_id: str, seq: int) -> None:
        """Remember that ``session_id``'s fence was at ``seq``."""
        with self._lock:
            self._raise(session_id, seq)

    def _raise(self, session_id: str, seq: int) -> None:
        if seq > self._floors.get(session_id, -1):
            self._floors[session_id] = seq
        if len(self._floors) > _PRUNE_AT:
            now = self._now_us()
            self._floors = {sid: s for sid, s in self._floors.items() if s >= now}

    def next(self, session_id: str | None = None, after: int | None = None) -> int:
        """A fresh ``seq`` for a request on ``session_id`` that must sort after ``after``.

        Raises:
            InvalidInput: the stamp would pass 2**53-1 (a fence or ``after`` that high).
        """
        with self._lock:
            floor = -1 if after is None else after
            if session_id is not None:
                floor = max(floor, self._floors.get(session_id, -1))
            seq = max(self._now_us(), floor + 1)
            if seq > MAX_SEQ:
                raise InvalidInput(f"would be {seq}, past 2**53-1", field="seq")
            if session_id is not None:
                self._raise(session_id, seq)
            return seq


#: The process's clock: every client in a process shares it by default.
seq_clock = SeqClock()
