"""Scenarios 6-8: duplicated, reordered and late deliveries; two workers and two beats."""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Any

from tests.faults.harness import (
    DELETE,
    SAVE,
    Deployment,
    Request,
    Scale,
    describe,
    finish,
    generate_load,
    judge,
    push,
    seq_base,
)
from tests.support.servers import wait_until


def test_every_message_delivered_twice_in_shuffled_order_ends_exact(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a load in which every message is pushed twice, the whole lot shuffled
    load = generate_load(scale.sessions, scale.requests // 2, random.Random(6))
    deliveries = [*load, *load]
    random.Random(60).shuffle(deliveries)
    # When two workers apply them
    deployment.worker()
    deployment.worker()
    push(deployment.broker_client(), (r.envelope() for r in deliveries))
    # Then the store is exactly what applying each request once, in seq order, gives
    verdict = deployment.settle(load, timeout=240)
    finish(
        deployment,
        verdict,
        scenario="6-duplicates-shuffled",
        title="every message delivered twice, shuffled, two workers",
        load=f"{len(deliveries)} deliveries of {len(load)} requests / {scale.sessions} sessions",
        faults="each message duplicated; order shuffled",
        notes="duplicates applied are re-applications of the same seq (idempotent) or "
        "refused as stale",
    )


def test_late_older_save_never_resurrects_a_deleted_session(
    deployment: Deployment, scale: Scale
) -> None:
    deployment.worker()
    base = seq_base()
    sessions = [f"late-{i:05d}" for i in range(scale.sessions)]
    first = [Request(SAVE, s, base + 10 * i, version=10 * i + 1) for i, s in enumerate(sessions)]
    deletes = [Request(DELETE, s, base + 10 * i + 5) for i, s in enumerate(sessions)]
    late = [Request(SAVE, s, base + 10 * i + 3, version=10 * i + 4) for i, s in enumerate(sessions)]
    # Given sessions saved, then deleted
    push(deployment.broker_client(), (r.envelope() for r in [*first, *deletes]))
    deployment.settle([*first, *deletes], timeout=120)
    # When a save older than the delete arrives late
    push(deployment.broker_client(), (r.envelope() for r in late))
    after_late = deployment.settle([*first, *deletes, *late], timeout=120, require=False)
    # Then every session stays deleted; and a newer save recreates half of them
    newer = [
        Request(SAVE, s, base + 10 * i + 7, version=10 * i + 8)
        for i, s in enumerate(sessions)
        if i % 2 == 0
    ]
    push(deployment.broker_client(), (r.envelope() for r in newer))
    everything = [*first, *deletes, *late, *newer]
    verdict = deployment.settle(everything, timeout=120)
    recreated = sum(1 for r in newer if deployment.store().load(r.session_id) is not None)
    finish(
        deployment,
        verdict,
        scenario="7-delete-then-late-save",
        title="delete, then a late older save; then a newer save",
        load=describe(scale, len(everything)),
        faults=f"{len(late)} late saves older than their session's delete",
        notes=f"after the late saves {len(after_late.resurrected)} resurrected; "
        f"{recreated}/{len(newer)} sessions recreated by a newer save",
        passed=after_late.exact and recreated == len(newer),
    )
    assert after_late.exact, after_late
    assert recreated == len(newer)


_EXPIRED = re.compile(r"sweep expired \d+ session\(s\): (.*)$")


def test_two_workers_and_two_beats_expire_each_stale_session_once(
    deployment: Deployment, scale: Scale
) -> None:
    # Given short lifetimes and a sweep every second, two workers and two beats
    ttl = 4.0
    deployment.settings.update(ttl_seconds=ttl, sweep_interval_seconds=1, tombstone_ttl_seconds=600)
    workers = [deployment.worker(), deployment.worker()]
    beats = [deployment.beat(), deployment.beat()]
    store = deployment.store()
    stale_count = scale.sessions
    stale = generate_load(stale_count, stale_count, random.Random(8), prefix="stale")
    live_ids = [f"live-{i:03d}" for i in range(20)]
    push(deployment.broker_client(), (r.envelope() for r in stale))
    # When the live sessions keep being saved while the stale ones age past their TTL
    live_saves: list[Request] = []
    rounds = 0

    def all_stale_expired() -> bool:
        nonlocal rounds
        base = seq_base()
        batch = [
            Request(SAVE, s, base + i, version=rounds * 100 + i + 1) for i, s in enumerate(live_ids)
        ]
        live_saves.extend(batch)
        push(deployment.broker_client(), (r.envelope() for r in batch))
        rounds += 1
        client = deployment.store_client()
        return client.zcard(deployment.keys.index()) == len(live_ids) and all(
            store.load(r.session_id) is None for r in stale
        )

    wait_until(all_stale_expired, timeout=120, interval=0.5, message="the stale sessions to expire")
    deployment.settle(live_saves, timeout=60)
    # Then each stale session was expired and announced once, no live one was
    events: list[Any] = deployment.store_client().xrange(deployment.keys.events()) or []
    announced = Counter(
        fields[b"session_id"].decode() for _, fields in events if fields[b"type"] == b"expired"
    )
    twice = [s for s, n in announced.items() if n > 1]
    live_expired = [s for s in live_ids if s in announced]
    missing = [r.session_id for r in stale if r.session_id not in announced]
    errors = [
        line
        for proc in [*workers, *beats]
        for line in proc.log().splitlines()
        if "ERROR" in line or "CRITICAL" in line
    ]
    alive = all(p.running() for p in [*workers, *beats])
    live_verdict = judge(store, live_saves)
    print("errors logged:", *errors[:5], sep="\n")  # (shown should finish() fail)
    finish(
        deployment,
        live_verdict,
        scenario="8-two-workers-two-beats",
        title="two workers and two beats, sweep every 1 s, TTL 4 s",
        load=f"{stale_count} stale + {len(live_ids)} live sessions ({len(live_saves)} saves)",
        faults=f"duplicate beat and worker processes over {rounds // 2}+ sweep intervals",
        notes=f"{len(announced)} sessions expired; expired twice: {len(twice)}; "
        f"live expired: {len(live_expired)}; errors logged: {len(errors)}",
        passed=not (twice or live_expired or missing or errors) and alive,
    )
    assert alive
    assert not errors, errors[:5]
    assert not twice, twice
    assert not live_expired, live_expired
    assert not missing, missing
    assert live_verdict.exact, live_verdict
