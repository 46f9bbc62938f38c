"""The ``eta`` and ``expires`` headers a producer may set: decided once, at receipt.

Celery honours both in ways that would break two promises, that nothing vanishes and that
the worker's memory stays bounded, so the worker decides first (``refusal``):

* an ``eta`` further ahead than the visibility timeout is dead-lettered (``invalid_input``):
  on Redis a message held that long is handed out again, and held again, every timeout.
  We do not clamp it: running a request earlier than its producer asked is a person's call,
  and the dead letter shows what arrived (``dlq replay`` resends it without the ``eta``);
* a request already expired is dead-lettered (``expired``), where Celery would drop it with
  one log line; one not yet expired runs, however late, with the header dropped
  (``forget_expiry``): a late request is harmless, since writes are fenced by ``seq``.

Only producers' requests are judged (protocol 2 headers; docs/protocol.md). Beat's sweep and
reconciliation keep their one-interval ``expires``: a lapsed one is redundant.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from checkpointq.tasks.dead_letters import Reason
from checkpointq.tasks.messages import APPLY_BATCH, DELETE, REFRESH, SAVE

#: The tasks producers send: what the policy here applies to.
REQUESTS = frozenset({SAVE, DELETE, REFRESH, APPLY_BATCH})


def _instant(value: object) -> datetime | None:
    """An ISO 8601 header as an aware datetime (UTC when it names no zone); None if unset."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, UTC)
    if not isinstance(value, str):
        raise ValueError(f"not a time: {value!r}")
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def refusal(
    headers: dict[str, Any], now: datetime, max_eta_ahead: float
) -> tuple[Reason, str] | None:
    """Why a request's ``eta``/``expires`` headers make it a dead letter, or None (also for
    anything that is not a producer's request).

    Args:
        headers: the message's protocol 2 headers.
        now: the worker's clock (aware).
        max_eta_ahead: seconds an ``eta`` may be ahead of ``now`` (the visibility timeout).
    """
    if headers.get("task") not in REQUESTS:
        return None
    try:
        eta = _instant(headers.get("eta"))
        expires = _instant(headers.get("expires"))
    except (ValueError, OverflowError, OSError) as exc:
        return Reason.INVALID_INPUT, f"unreadable eta/expires header: {exc}"
    if expires is not None and expires <= now:
        late = (now - expires).total_seconds()
        return Reason.EXPIRED, f"expired at {expires.isoformat()} ({late:.0f}s before receipt)"
    if eta is not None and (eta - now).total_seconds() > max_eta_ahead:
        ahead = (eta - now).total_seconds()
        return Reason.INVALID_INPUT, (
            f"eta {eta.isoformat()} is {ahead:.0f}s ahead; the broker would hand the message "
            f"out again every {max_eta_ahead:.0f}s (its visibility timeout) while it waits"
        )
    return None


def forget_expiry(headers: dict[str, Any]) -> None:
    """Drop ``expires`` from a request accepted at receipt, so that Celery never discards
    it later with only a log line (see the module docstring)."""
    if headers.get("task") in REQUESTS and headers.get("expires") is not None:
        headers["expires"] = None
