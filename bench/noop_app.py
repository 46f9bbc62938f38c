"""The worker's app plus ``checkpoint.noop``: same payload, same task base, no store call.

Benchmark only (``bench/worker_drain.py``); production workers never register it.
"""

from __future__ import annotations

from typing import Any

from checkpointq.tasks.checkpoints import CheckpointTask
from checkpointq.worker.app import create_app

app = create_app()


@app.task(name="checkpoint.noop", base=CheckpointTask)  # type: ignore[untyped-decorator]
def noop(checkpoint: object, seq: int | None = None) -> dict[str, Any]:
    """Accept a save's arguments and do nothing with them."""
    return {"outcome": "noop"}
