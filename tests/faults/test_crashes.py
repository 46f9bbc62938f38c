"""Scenarios 1-3: workers killed or stopped mid-load lose nothing.

Each test pushes a load of saves and deletes, injects its fault while the worker is busy,
and then requires the store to end exactly in the expected state.
"""

from __future__ import annotations

import random

from tests.faults.harness import (
    Deployment,
    Scale,
    describe,
    finish,
    generate_load,
    push,
)


def test_worker_killed_mid_load_loses_nothing_after_restart(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker busy with a load
    load = generate_load(scale.sessions, scale.requests, random.Random(1))
    worker = deployment.busy_worker(load, 0.3)
    # When its main process is killed (kill -9, pool children with it) and a new one starts
    held = int(deployment.broker_client().hlen("unacked"))
    worker.kill()
    deployment.worker()
    # Then, once the visibility timeout hands the unacknowledged messages out again,
    # every request has taken effect
    verdict = deployment.settle(load, timeout=180)
    finish(
        deployment,
        verdict,
        scenario="1-kill-main",
        title="kill -9 the worker (main process and pool), start a new one",
        load=describe(scale),
        faults=f"kill -9 mid-load with {held} message(s) unacknowledged",
        notes="visibility timeout 10 s here (300 s in production); the new worker "
        "redelivers what the dead one held",
    )


def test_pool_child_killed_mid_task_has_its_message_redelivered(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker busy with a load of larger checkpoints (so a child is mostly mid-task),
    # one task per message (test_coalescing.py kills a child mid-group)
    deployment.settings.update(coalesce_max_items=0)
    load = generate_load(
        scale.sessions, scale.requests, random.Random(2), messages=20, content_size=2000
    )
    worker = deployment.worker()
    push(deployment.broker_client(), (r.envelope() for r in load))
    # When pool children are killed with kill -9 until some died in the middle of a task
    lost_mid_task = "raised error: WorkerLostError"
    kills = deployment.kill_pool_children_until(
        worker, load, scale, marker=lost_mid_task, times=2, seed=2
    )
    mid_task = worker.log().count(lost_mid_task)
    # Then the worker carried on (no restart) and every request took effect
    verdict = deployment.settle(load, timeout=180)
    finish(
        deployment,
        verdict,
        scenario="2-kill-child",
        title="kill -9 a pool child mid-task",
        load=describe(scale),
        faults=f"{kills} pool children killed with kill -9, {mid_task} of them mid-task",
        notes="task_reject_on_worker_lost requeues the message of a child that died mid-task",
        passed=worker.running() and mid_task >= 1,
    )
    assert worker.running(), "the worker died with its child"
    assert mid_task >= 1, "no child was killed in the middle of a task: nothing was proven"


def test_sigterm_mid_load_requeues_what_was_unacknowledged(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker busy with a load, and a visibility timeout far longer than the test
    # may take: messages must come back by the soft shutdown's requeue, not by timing out
    deployment.settings.update(visibility_timeout=3600, tombstone_ttl_seconds=7200)
    load = generate_load(scale.sessions, scale.requests, random.Random(3))
    worker = deployment.busy_worker(load, 0.3)
    # When it receives SIGTERM (a deploy, `docker stop`)
    code = worker.terminate()
    broker = deployment.broker_client()
    unacked_after = int(broker.hlen("unacked"))
    # Then it exits cleanly leaving nothing unacknowledged, and a new worker finishes the load
    deployment.worker()
    verdict = deployment.settle(load, timeout=180)
    finish(
        deployment,
        verdict,
        scenario="3-sigterm",
        title="SIGTERM mid-load (warm/soft shutdown), start a new worker",
        load=describe(scale),
        faults="SIGTERM mid-load",
        notes=f"exit code {code}; {unacked_after} message(s) left unacknowledged after exit "
        "(visibility timeout 3600 s, so all came back by requeue)",
        passed=code == 0 and unacked_after == 0,
    )
    assert code == 0
    assert unacked_after == 0
