"""Connections to the broker dropped again and again must lose nothing, and hold nothing back.

A settle (ack, reject, requeue) or a reservation whose connection is cut leaves its
message in the broker's ``unacked`` hash, where kombu restores it only once the visibility
timeout (300 s by default) has passed. The worker that lost it knows it holds no such message
and hands it back itself (``worker/lost_settles.py``): the load drains within seconds of the
last kill, not minutes.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import redis

from tests.faults.harness import (
    PRODUCTION_RETRIES,
    Deployment,
    Scale,
    SteadyTraffic,
    describe,
    finish,
    generate_load,
    hold,
    push,
)

#: The clients the test keeps for itself; every other client of the broker is killed.
OURS = "faults-"
#: The production visibility timeout: what a lost ack used to wait for.
VISIBILITY_TIMEOUT = int(str(dict(PRODUCTION_RETRIES)["visibility_timeout"]))


class ConnectionKiller:
    """``CLIENT KILL`` every connection but ours, every ``every`` seconds, from a thread."""

    def __init__(self, client: redis.Redis, every: float) -> None:
        self.client = client
        self.every = every
        self.killed = 0
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        # pacing the fault, not synchronising with the system under test
        while not self._stop.wait(self.every):
            for client in self.client.client_list():
                if not str(client.get("name", "")).startswith(OURS):
                    # (one that disconnected by itself meanwhile has nothing left to kill)
                    with contextlib.suppress(redis.ResponseError):
                        self.killed += int(self.client.client_kill_filter(_id=client["id"]))
            self.rounds += 1


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("recovery", [True, False], ids=["lost-settles", "without"])
def test_connections_killed_every_half_second_lose_nothing_and_drain_within_seconds(
    deployment: Deployment, scale: Scale, recovery: bool
) -> None:
    if not recovery and scale.name != "long":
        pytest.skip("the comparison waits out the visibility timeout: long mode (--long)")
    # Given a worker with production's visibility timeout, and producers pushing steadily
    seconds = 60.0
    deployment.settings.update(visibility_timeout=VISIBILITY_TIMEOUT)
    if not recovery:  # the comparison: what was cut short waits for the visibility timeout
        deployment.settings.update(include="tests.faults.without_lost_settles")
    worker = deployment.worker()
    producer = redis.Redis.from_url(deployment.broker.url, client_name=f"{OURS}producer")
    killer_client = redis.Redis.from_url(deployment.broker.url, client_name=f"{OURS}killer")
    deployment._clients += [producer, killer_client]  # closed with the deployment
    load = generate_load(scale.sessions, scale.requests, random.Random(28))
    backlog, steady = load[: scale.sessions], load[scale.sessions :]
    push(producer, (r.envelope() for r in backlog))
    traffic = SteadyTraffic(producer, steady, len(steady) / seconds)
    # When every connection of the worker to the broker is killed every 0.5 s for 60 s
    with ConnectionKiller(killer_client, every=0.5) as killer:
        traffic.start()
        hold(seconds)
    ended = time.monotonic()
    traffic.finish()
    # Then the load drains well before the visibility timeout, and nothing is lost
    deadline = VISIBILITY_TIMEOUT / 2 if recovery else VISIBILITY_TIMEOUT * 2
    verdict = deployment.settle(load, timeout=deadline, require=False)
    drained = time.monotonic() - ended
    stuck = deployment.backlog()
    log = worker.log()
    resettled = log.count("settled again after")
    restored = log.count("handed back")
    assert worker.running(), log[-3000:]
    code = worker.terminate(timeout=60)
    finish(
        deployment,
        verdict,
        scenario="26k-connection-kills" + ("" if recovery else "-without-lost-settles"),
        title="every broker connection of the worker killed every 0.5 s for 60 s"
        + ("" if recovery else "; the worker without its lost-settle retries, for comparison"),
        load=describe(scale) + f", {len(steady) / seconds:.0f}/s steady",
        faults=f"CLIENT KILL of {killer.killed} connections in {killer.rounds} rounds",
        notes=(
            f"drained {drained:.1f} s after the last kill"
            if not stuck
            else f"not drained {drained:.0f} s after the last kill: {stuck} messages still "
            "waiting in unacked (counted as lost: not applied yet)"
        )
        + f" (visibility timeout {VISIBILITY_TIMEOUT} s); lost settles done again "
        f"{resettled}x, lost reservations handed back {restored}x; SIGTERM afterwards exit {code}",
        # (without the retries the row measures what waits, rather than forbid it)
        passed=code == 0 and killer.killed > 0 and (not stuck or not recovery),
        loss_measured=not recovery,
        converged_s=drained,
    )
