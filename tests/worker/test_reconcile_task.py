"""The reconcile task on a real redis-server: what it drops after a direct (Go) delete is
announced on the events stream, once."""

from __future__ import annotations

from typing import Any

import redis

from checkpointq.store import RedisStore
from checkpointq.tasks.events import DROPPED, EXPIRED, KEY_GONE
from checkpointq.tasks.reconcile import reconcile_slice
from checkpointq.tasks.sweep import sweep
from tests.support.checkpoints import make_checkpoint


def _events(client: redis.Redis, store: RedisStore) -> list[dict[str, str]]:
    entries: Any = client.xrange(store.keys.events())
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


def test_session_go_deleted_is_announced_as_dropped_once(redis_client: redis.Redis) -> None:
    client = redis_client
    # Given two sessions we saved, one of which Go then deletes directly (DEL, no tombstone)
    store = RedisStore(client, prefix="rt")
    assert store.save(make_checkpoint("kept"), seq=1).applied
    assert store.save(make_checkpoint("go-deleted"), seq=1).applied
    client.delete(store.keys.data("go-deleted"))
    # When the reconcile task runs a slice that completes a pass, and then another pass
    first = reconcile_slice(store, 10_000, client, store.keys, 1_000)
    second = reconcile_slice(store, 10_000, client, store.keys, 1_000)
    # Then the deleted one left the list and was announced once, with what happened
    assert first["dropped"] == 1 and first["completed_pass"]
    assert second["dropped"] == 0
    assert store.list() == ["kept"]
    events = _events(client, store)
    assert [(e["type"], e["session_id"], e["reason"]) for e in events] == [
        (DROPPED, "go-deleted", KEY_GONE)
    ]
    assert float(events[0]["time"]) > 0


def test_expired_events_keep_their_shape(redis_client: redis.Redis) -> None:
    client = redis_client
    # Given a session past its deadline
    now = [1_000_000.0]
    store = RedisStore(client, prefix="rt", clock=lambda: now[0])
    assert store.save(make_checkpoint("old"), seq=1).applied
    now[0] += 31 * 24 * 3600
    # When the sweep expires it
    assert sweep(store, client, store.keys).expired == ["old"]
    # Then its event is an 'expired' one, without a reason
    events = _events(client, store)
    assert [(e["type"], e["session_id"]) for e in events] == [(EXPIRED, "old")]
    assert "reason" not in events[0]
