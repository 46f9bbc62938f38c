"""The worker as it was before ``worker/lost_settles.py``, for the fault suite's comparison:
``include`` it in a worker and what a dropped connection cut short waits for the visibility
timeout, as on kombu's stock path."""

from __future__ import annotations

from typing import Any

from checkpointq.worker import lost_settles


def _never(self: lost_settles.LostSettles, channel: Any) -> None:
    """Remember, never retry."""


lost_settles.LostSettles.retry = _never  # type: ignore[method-assign]
