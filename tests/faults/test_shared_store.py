"""Two deployments sharing one store Redis under different key prefixes."""

from __future__ import annotations

import random

import pytest

from tests.faults.harness import (
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
from tests.support.servers import RedisServer

#: Deployment B's prefix: beside the default one, with nothing that could nest.
PREFIX_B = "agentorca-session-b"


def test_deployments_sharing_a_store_never_reach_each_others_keys(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a prefix that would nest into the default one's keys: the worker refuses to start
    nested = Deployment(deployment.broker, deployment.store_server)
    nested.settings.update(key_prefix="agentorca-session:b")
    with pytest.raises(RuntimeError, match="may not contain ':'"):
        nested.worker()
    nested.cleanup()
    # Given deployment A (the default prefix) and deployment B (its own prefix and broker),
    # both on one store Redis, B busy with a load
    broker_b = RedisServer(appendonly=True).start()
    b = Deployment(broker_b, deployment.store_server, settings={"key_prefix": PREFIX_B})
    try:
        load = generate_load(scale.sessions, scale.requests, random.Random(19))
        b.worker()
        deployment.worker()
        push(b.broker_client(), (r.envelope() for r in load))
        # When A's producers save and delete sessions whose ids spell B's keys every way a
        # nesting prefix would let them: B's data keys, fences, index and dead letters
        ids = sorted({r.session_id for r in load})[::10]
        spelled = [
            f"{form}{sid}" for sid in ids for form in ("-b:", "-b.cq:fence:", "b:", "b.cq:fence:")
        ] + ["-b.cq:deadlines", "-b.cq:dead-letters", "b.cq:deadlines", "b.cq:dead-letters"]
        base = seq_base() + 10 * len(load)
        hostile = [Request(SAVE, sid, base + i, version=10**9 + i) for i, sid in enumerate(spelled)]
        push(deployment.broker_client(), (r.envelope() for r in hostile))
        # Then B ends exactly as its own load says, and A holds exactly its own sessions
        verdict = b.settle(load, timeout=240)
        mine = deployment.settle(hostile, timeout=120)
        b_dead = b.dead_letters().count()
        finish(
            deployment,
            verdict,
            scenario="19-shared-store-prefixes",
            title=f"two deployments on one store Redis, prefixes agentorca-session and {PREFIX_B}",
            load=describe(scale) + f" in B; {len(hostile)} saves in A",
            faults=f"A's session ids spell B's keys ({len(spelled)} ids: -b:<id>, "
            "-b.cq:fence:<id>, ...); a prefix agentorca-session:b refused at start-up",
            notes=f"A's own sessions exact: {mine.exact}; B's dead letters: {b_dead}; "
            "the nested prefix's worker exited naming the rule",
            passed=mine.exact and b_dead == 0 and judge(b.store(), load).exact,
        )
    finally:
        b.cleanup()
        broker_b.cleanup()
