"""The eta/expires policy at receipt (worker/timing.py), without processes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from checkpointq.tasks.dead_letters import Reason
from checkpointq.tasks.messages import EXPIRE_STALE, SAVE
from checkpointq.worker.timing import forget_expiry, refusal

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def _at(delta: timedelta) -> str:
    return (NOW + delta).isoformat()


def _save(**headers: object) -> dict[str, object]:
    return {"task": SAVE, **headers}


def test_an_eta_within_the_visibility_timeout_is_accepted() -> None:
    assert refusal(_save(eta=_at(timedelta(seconds=250))), NOW, 300) is None
    assert refusal(_save(eta=None, expires=None), NOW, 300) is None
    assert refusal(_save(), NOW, 300) is None


def test_an_eta_beyond_the_visibility_timeout_is_refused_with_the_reason() -> None:
    refused = refusal(_save(eta=_at(timedelta(days=1))), NOW, 300)
    assert refused is not None
    kind, reason = refused
    assert kind is Reason.INVALID_INPUT
    assert "86400s ahead" in reason and "every 300s" in reason


def test_a_past_expires_is_refused_as_expired_and_a_future_one_is_forgotten() -> None:
    refused = refusal(_save(expires=_at(timedelta(minutes=-5))), NOW, 300)
    assert refused is not None and refused[0] is Reason.EXPIRED
    assert "300s before receipt" in refused[1]
    # A message not yet expired runs, however late: Celery must not discard it later
    headers = _save(expires=_at(timedelta(minutes=5)))
    assert refusal(headers, NOW, 300) is None
    forget_expiry(headers)
    assert headers["expires"] is None


def test_a_naive_time_is_utc_and_an_unreadable_one_is_invalid_input() -> None:
    naive = (NOW - timedelta(seconds=1)).replace(tzinfo=None).isoformat()
    refused = refusal(_save(expires=naive), NOW, 300)
    assert refused is not None and refused[0] is Reason.EXPIRED
    garbage = refusal(_save(eta="tomorrow-ish"), NOW, 300)
    assert garbage is not None and garbage[0] is Reason.INVALID_INPUT
    assert "unreadable eta/expires header" in garbage[1]


def test_beats_housekeeping_keeps_its_lapsing_expiry() -> None:
    # A sweep still queued when the next is due is redundant: Celery lets it lapse, as beat
    # asks, instead of a dead letter per missed interval
    headers = {"task": EXPIRE_STALE, "expires": _at(timedelta(seconds=-1))}
    assert refusal(headers, NOW, 300) is None
    forget_expiry(headers)
    assert headers["expires"] is not None
