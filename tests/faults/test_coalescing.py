"""Worker-side coalescing (worker/coalesce.py) under kill -9: nothing is lost, nothing is late.

Single saves and deletes are applied in groups and each message is acknowledged only once
its own item is durable. These scenarios kill a real worker while groups are in flight and
require the store to end exactly as if every request had been applied alone, in order.
"""

from __future__ import annotations

import random

from tests.faults.harness import (
    Deployment,
    Scale,
    conclude,
    describe,
    generate_load,
    push,
)
from tests.support.servers import wait_until

#: The default coalescing (groups of up to 32 that grow while the pool is busy, which the
#: pushed load keeps it), so that a kill lands while messages are grouped.
COALESCE = {"coalesce_max_items": 32, "coalesce_window_ms": 2.0}
GROUP_LOST = "each runs alone"
#: Messages the worker must hold (reserved, in groups or being applied) when it is killed:
#: more than one, so that a group was in the making or in flight.
HELD_AT_KILL = 4


def test_worker_killed_mid_group_loses_nothing_after_restart(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a coalescing worker busy with a load of single saves and deletes
    deployment.settings.update(COALESCE)
    load = generate_load(scale.sessions, scale.requests, random.Random(11))
    worker = deployment.worker()
    push(deployment.broker_client(), (r.envelope() for r in load))
    # When its main process is killed with kill -9 (pool with it) while it holds groups
    broker = deployment.broker_client()
    wait_until(
        lambda: int(broker.hlen("unacked")) >= HELD_AT_KILL,
        timeout=60,
        message=f"the worker to hold {HELD_AT_KILL} messages",
    )
    worker.kill()
    held = int(broker.hlen("unacked"))
    deployment.worker()
    # Then every request takes effect once the visibility timeout hands the held ones out
    verdict = deployment.settle(load, timeout=180)
    row = conclude(
        deployment,
        verdict,
        scenario="20-kill-main-coalescing",
        title="kill -9 a coalescing worker mid-group, start a new one",
        load=describe(scale),
        faults=f"kill -9 with {held} message(s) unacknowledged (groups of up to 32)",
        notes="each message is acknowledged only once its own item is durable",
    )
    # (at least one: acks may land between the wait above and the kill)
    assert held > 0, "nothing was held when the worker died: nothing was proven"
    assert verdict.exact, verdict
    assert row.dead_lettered == 0


def test_pool_child_killed_mid_group_has_the_group_run_alone(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a coalescing worker busy with a load of larger checkpoints
    deployment.settings.update(COALESCE)
    load = generate_load(
        scale.sessions, scale.requests, random.Random(12), messages=20, content_size=2000
    )
    worker = deployment.worker()
    push(deployment.broker_client(), (r.envelope() for r in load))
    # When pool children are killed with kill -9 until one died while applying a group
    kills = deployment.kill_pool_children_until(
        worker, load, scale, marker=GROUP_LOST, times=1, seed=12
    )
    lost_groups = worker.log().count(GROUP_LOST)
    # Then the worker carried on and every request took effect (the lost group's messages
    # ran again as single tasks: fenced, so applying some twice is harmless)
    verdict = deployment.settle(load, timeout=180)
    row = conclude(
        deployment,
        verdict,
        scenario="21-kill-child-coalescing",
        title="kill -9 a pool child while it applies a group",
        load=describe(scale),
        faults=f"{kills} pool children killed with kill -9, {lost_groups} mid-group",
        notes="a group whose process died runs again, message by message, as single tasks",
        passed=worker.running() and lost_groups >= 1,
    )
    assert worker.running(), "the worker died with its child"
    assert lost_groups >= 1, "no child died in the middle of a group: nothing was proven"
    assert verdict.exact, verdict
    assert row.dead_lettered == 0
