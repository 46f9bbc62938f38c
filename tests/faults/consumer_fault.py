"""A bug in the worker's consumer, for the fault suite: ``include`` it in a worker.

The first message the main process receives raises ``RuntimeError`` in the consumer, once
per marker file (``FAULTS_CONSUMER_ERROR_MARKER``, created as it fires): a restarted worker
with the same marker runs clean, as one whose supervisor restarted it after a rare bug.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from checkpointq.worker import timing

MARKER = "FAULTS_CONSUMER_ERROR_MARKER"

_refusal = timing.refusal


def _failing_once(*args: Any, **kwargs: Any) -> Any:
    marker = Path(os.environ[MARKER])
    if not marker.exists():
        marker.touch()
        raise RuntimeError("injected: a bug in the consumer")
    return _refusal(*args, **kwargs)


if os.environ.get(MARKER):
    timing.refusal = _failing_once
