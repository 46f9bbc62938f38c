"""A settable clock for stores under test."""

from __future__ import annotations

import time


class FakeClock:
    """A clock moved by hand, starting at the real time so seqs look realistic. Given to a
    Redis store, it moves the store's idea of now only: Redis keeps real time (and TTLs)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
