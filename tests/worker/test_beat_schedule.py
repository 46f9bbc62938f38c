"""Beat schedules what the store needs: the sweep always, reconciliation only where another
writer (the Go store) may leave values behind the index, a Redis store."""

from __future__ import annotations

from checkpointq.worker.beat import RECONCILE_ENTRY, SWEEP_ENTRY, beat_config
from checkpointq.worker.settings import Settings

BROKER = "redis://127.0.0.1:1/0"


def test_a_redis_store_is_swept_and_reconciled() -> None:
    schedule = beat_config(Settings(broker_url=BROKER))["beat_schedule"]
    assert set(schedule) == {SWEEP_ENTRY, RECONCILE_ENTRY}


def test_a_postgresql_store_is_swept_and_never_reconciled() -> None:
    settings = Settings(broker_url=BROKER, store_url="postgresql://app@127.0.0.1:1/app")
    config = beat_config(settings)
    assert set(config["beat_schedule"]) == {SWEEP_ENTRY}
    # beat still wakes up often enough to keep its lock
    assert config["beat_max_loop_interval"] <= 5.0
