"""Refusing a request: the one path every refusal takes.

To refuse is to record the request as a dead letter (``DeadLetters.add``: what arrived, why,
and enough to replay it) and then to tell the observers (metrics, heartbeats) that it was
dead-lettered. The tasks (``checkpoints.py``, ``batch.py``), the worker's consumer (messages
it cannot hand to a task) and its queue reader (items that are not Celery messages) all
refuse through ``refuse()``, so a refusal is counted exactly once, and only once it is
recorded.

If the dead letter cannot be written (its stream lives on the store Redis), ``refuse()``
raises ``StoreUnavailable`` and tells nobody: the caller must then keep the message in the
broker (retry, requeue, leave it unacknowledged), never acknowledge it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from checkpointq.tasks import observers, runtime
from checkpointq.tasks.dead_letters import Reason, RefusedRequest


def refuse(
    kind: Reason,
    reason: str,
    *,
    task: str | None,
    task_id: str | None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    raw: bytes | str | None = None,
    headers: dict[str, Any] | None = None,
    retries: int = 0,
    requests: Sequence[RefusedRequest] = (),
    seq: int | None = None,
    raw_bytes: int | None = None,
) -> str:
    """Record the dead letter, then tell the observers; return the entry's id.

    ``task`` is the request's task name as it arrived (None when unknown); ``seq`` the
    ``seq`` its producer stamped, if any. The other arguments are ``DeadLetters.add``'s.

    Raises:
        StoreUnavailable: the dead letter could not be written; nothing was told.
    """
    entry = runtime.current().dead_letters.add(
        kind,
        reason,
        task=task,
        task_id=task_id,
        args=args,
        kwargs=kwargs,
        raw=raw,
        headers=headers,
        retries=retries,
        requests=requests,
        raw_bytes=raw_bytes,
    )
    observers.notify(
        observers.Observation(
            task=observers.task_label(task),
            outcome="dead_lettered",
            task_id=task_id,
            seq=seq,
            kind=kind.value,
        )
    )
    return entry
