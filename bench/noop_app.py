"""Our worker's app with ``checkpoint.save`` replaced by a no-op: same base, consumer, transport.

Draining save messages with it measures what our worker adds per message on top of plain
Celery (``bench/plain_app.py``) before the store does any work. Benchmark only
(``bench/worker_drain.py``); production workers never load it.
"""

from __future__ import annotations

from typing import Any

from checkpointq.tasks.checkpoints import CheckpointTask
from checkpointq.tasks.messages import SAVE
from checkpointq.worker.app import create_app

app = create_app()
app.tasks.unregister(SAVE)


@app.task(name=SAVE, base=CheckpointTask)  # type: ignore[untyped-decorator]
def noop(checkpoint: object, seq: int | None = None) -> dict[str, Any]:
    """Accept a save's arguments and do nothing with them."""
    return {"outcome": "noop"}
