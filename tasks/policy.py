"""Retry policy for requests whose store is unavailable: exponential backoff, full jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to retry a request whose store is unavailable."""

    #: Retries before the request is dead-lettered (0: dead-letter at the first failure).
    max_retries: int = 8
    #: Ceiling of the first delay, seconds; the ceiling doubles with each retry.
    base_seconds: float = 1.0
    #: Ceiling of any one delay, seconds. Must stay below the broker's visibility timeout: a
    #: retry waits in the worker as an unacknowledged ETA message until then.
    max_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_seconds <= 0 or self.max_seconds <= 0:
            raise ValueError("retry policy values must be positive")

    def ceiling(self, retries: int) -> float:
        """The largest delay before retry number ``retries + 1``."""
        # min() before the power would overflow for absurd retry counts.
        return float(min(self.max_seconds, self.base_seconds * 2 ** min(retries, 62)))

    def countdown(self, retries: int, rng: random.Random | None = None) -> float:
        """Delay before the next attempt: uniform in [0, ceiling] ("full jitter").

        Full jitter spreads the retries of many workers hit by the same outage, so they do not
        all hammer the store again at the same instant when it comes back.
        """
        draw = (rng or _rng).uniform(0.0, self.ceiling(retries))
        return round(draw, 3)

    def exhausted(self, retries: int) -> bool:
        return retries >= self.max_retries


# Not for security: jitter only needs to be spread, not unpredictable.
_rng = random.Random()  # noqa: S311
