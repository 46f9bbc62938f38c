"""Beat's sweep and reconciliation, end to end: two real beats, a real worker, sessions
with a 1 s lifetime, and keys written behind the store's back as a Go RedisStore does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until

pytestmark = pytest.mark.integration

SHORT_LIVED: dict[str, object] = {
    "queue": "checkpoints",
    "concurrency": 2,
    "ttl_seconds": 1,
    "tombstone_ttl_seconds": 60,
    "visibility_timeout": 10,
    "retry_backoff_max_seconds": 1,
    "sweep_interval_seconds": 1,
    "reconcile_interval_seconds": 1,
}


@pytest.fixture(scope="module")
def short_lived(
    broker_server: RedisServer, store_server: RedisServer
) -> Iterator[tuple[Settings, list[CeleryProcess]]]:
    """A worker and TWO beats (the mistake the lock must make harmless), sweeping each second."""
    values = {**SHORT_LIVED, "broker_url": broker_server.url, "store_url": store_server.url}
    env = checkpointq_env(**values)
    processes = [CeleryProcess("worker", env)]
    try:
        processes[0].start()
        processes.append(CeleryProcess("beat", env).start())
        processes.append(CeleryProcess("beat", env).start())
        yield Settings(**values), processes  # type: ignore[arg-type]
    finally:
        for process in reversed(processes):
            code = process.stop()
            print(f"--- {process.role} log (exit {code}) ---\n{process.log()}")


def test_beat_sweep_expires_short_lived_sessions_and_announces_each_once(
    short_lived: tuple[Settings, list[CeleryProcess]],
) -> None:
    settings, (worker, beat_a, beat_b) = short_lived
    ids = [f"short-{i}" for i in range(3)]
    with CheckpointClient.from_settings(settings) as client:
        # Given sessions saved with a one-second lifetime
        for session_id in ids:
            client.wait_durable(client.save(make_checkpoint(session_id)), timeout=15)
        events_key = KeySpace(settings.key_prefix).events()
        redis = client.store.client  # type: ignore[attr-defined]

        def announced() -> list[str]:
            return [
                fields[b"session_id"].decode()
                for _, fields in redis.xrange(events_key)
                if fields[b"type"] == b"expired"
            ]

        # When beat's sweeps run, Then each session is expired and announced on the stream
        wait_until(lambda: sorted(announced()) == ids, timeout=20, message="expiry events")
        assert client.list() == []
        assert all(client.load(session_id) is None for session_id in ids)
        # ... and in the worker's log
        wait_until(lambda: all(i in worker.log() for i in ids), timeout=5, message="sweep log")
        # And with two beats running only one sends sweeps; later sweeps announce nothing new
        sent = [beat.log().count("Sending due task") for beat in (beat_a, beat_b)]
        assert sorted(sent)[0] == 0 and sorted(sent)[1] >= 1, sent
        before = sum(sent)
        wait_until(
            lambda: sum(b.log().count("Sending due task") for b in (beat_a, beat_b)) > before,
            timeout=10,
            message="another sweep",
        )
        assert sorted(announced()) == ids
        # And beat's schedule and lock live under our prefix, not RedBeat's shared default
        prefix = KeySpace(settings.key_prefix).beat_prefix()
        assert redis.exists(f"{prefix}:lock", f"{prefix}:schedule") == 2
        assert list(redis.scan_iter("redbeat*")) == []


def test_beat_reconciliation_adopts_go_written_sessions_and_drops_go_deleted_ones(
    short_lived: tuple[Settings, list[CeleryProcess]],
) -> None:
    settings, _processes = short_lived
    with CheckpointClient.from_settings(settings) as client:
        redis = client.store.client  # type: ignore[attr-defined]
        keys = KeySpace(settings.key_prefix)
        # Given a session a Go RedisStore saved directly (SET EX 30 d, no index entry)
        go_value = b'{"sessionId":"go-only","version":4,"metadata":{}}'
        redis.set(keys.data("go-only"), go_value, ex=30 * 24 * 3600)
        # When beat's reconciliation slices run, Then it is listed
        wait_until(lambda: "go-only" in client.list(), timeout=20, message="adoption")
        loaded = client.load("go-only")
        assert loaded is not None and loaded.version == 4
        # And when Go deletes it directly (DEL), it leaves the list again
        redis.delete(keys.data("go-only"))
        wait_until(lambda: "go-only" not in client.list(), timeout=20, message="drop")

        # And the drop is announced on the events stream, saying what happened
        def dropped() -> list[tuple[bytes, bytes]]:
            return [
                (fields[b"session_id"], fields[b"reason"])
                for _, fields in redis.xrange(keys.events())
                if fields[b"type"] == b"dropped"
            ]

        wait_until(lambda: dropped() != [], timeout=10, message="dropped event")
        assert dropped() == [(b"go-only", b"key gone")]
