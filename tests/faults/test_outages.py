"""Scenarios 4, 5 and 9: the store or the broker Redis goes away and comes back."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from checkpointq.store.urls import redact_url
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.faults.harness import (
    DELETE,
    SAVE,
    Deployment,
    Request,
    Scale,
    describe,
    finish,
    generate_load,
    hold,
    judge,
    push,
    winners,
)
from tests.support.servers import RedisServer, wait_until


def test_store_outage_mid_load_is_retried_until_applied(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker busy with a load
    load = generate_load(scale.sessions, scale.requests, random.Random(4))
    worker = deployment.busy_worker(load, 0.2)
    # When the store Redis is down for a while (its AOF keeps what was written)
    deployment.store_server.stop()
    hold(scale.store_outage)
    deployment.store_server.start()
    # Then every request is retried until it applies; none is dead-lettered
    verdict = deployment.settle(load, timeout=240)
    retried = worker.log().count("retry ")
    finish(
        deployment,
        verdict,
        scenario="4-store-down",
        title="store Redis stopped mid-load, restarted",
        load=describe(scale),
        faults=f"store Redis down {scale.store_outage:.0f} s",
        notes=f"{retried} retries logged (backoff 0.1-1 s, up to 60 retries here)",
        passed=worker.running(),
    )
    assert worker.running()
    assert retried > 0, "the outage did not reach the worker: nothing was proven"


def test_broker_restart_with_aof_loses_nothing_and_worker_resumes(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker busy with a load on a broker with AOF (fsync always)
    load = generate_load(scale.sessions, scale.requests, random.Random(5))
    worker = deployment.busy_worker(load, 0.2)
    # When the broker crashes (kill -9) and is restarted
    deployment.broker.stop(kill=True)
    deployment.broker.start()
    # Then the same worker (never restarted) reconnects and finishes the load, and a request
    # pushed after the restart is applied too
    late = generate_load(10, 20, random.Random(55), prefix="after-restart")
    push(deployment.broker_client(), (r.envelope() for r in late))
    verdict = deployment.settle([*load, *late], timeout=240)
    finish(
        deployment,
        verdict,
        scenario="5a-broker-restart-aof",
        title="broker Redis killed and restarted, AOF on (fsync always)",
        load=describe(scale),
        faults="broker kill -9 mid-load, restart; worker not restarted",
        notes="the worker reconnected by itself",
        passed=worker.running(),
    )
    assert worker.running()


def test_broker_restart_without_persistence_loses_only_what_it_held(
    store_server: RedisServer, scale: Scale
) -> None:
    # Given a broker with no persistence at all (not our recommendation) and a busy worker
    broker = RedisServer(appendonly=False).start()
    deployment = Deployment(broker, store_server)
    try:
        load = generate_load(scale.sessions, scale.requests, random.Random(6))
        worker = deployment.worker()
        push(deployment.broker_client(), (r.envelope() for r in load))
        deployment.wait_progress(len(load), 0.2)
        # When it restarts: the queue and the unacknowledged messages are gone
        client = deployment.broker_client()
        backlog = int(client.llen("checkpoints")) + int(client.hlen("unacked"))
        broker.stop(kill=True)
        broker.start()
        late = generate_load(10, 20, random.Random(66), prefix="after-restart")
        push(deployment.broker_client(), (r.envelope() for r in late))
        # Then the worker resumes (everything pushed after the restart applies) and the loss
        # is bounded by what the broker held at the crash, plus what the worker held
        late_verdict = deployment.settle(late, timeout=120)
        verdict = deployment.settle(load, timeout=30, require=False)
        in_worker = 2 * 2  # prefetch x concurrency, reserved but unacknowledged at most
        lost = len(verdict.lost)
        finish(
            deployment,
            verdict,
            scenario="5b-broker-restart-no-persistence",
            title="broker Redis killed and restarted, persistence OFF (measured loss)",
            load=describe(scale),
            faults=f"broker kill -9 with {backlog} message(s) queued or unacknowledged",
            notes=f"loss window: everything queued at the crash ({backlog} messages); "
            f"{lost} session(s) ended without their final request. Use AOF.",
            passed=late_verdict.exact and lost <= backlog + in_worker,
            loss_measured=True,
        )
        assert worker.running()
        assert late_verdict.exact, late_verdict
        assert not verdict.resurrected and not verdict.regressed, verdict
        assert lost <= backlog + in_worker
    finally:
        deployment.cleanup()
        broker.cleanup()


@dataclass
class Producer:
    """Publishes saves through CheckpointClient from a thread; remembers every outcome."""

    client: CheckpointClient
    sessions: int
    sent: list[Request] = field(default_factory=list)
    refused: list[tuple[str, BrokerUnavailable]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            sid = f"producer-{i % self.sessions:04d}"
            try:
                if i >= self.sessions and i % 7 == 0:
                    handle = self.client.delete(sid)
                    assert handle.seq is not None
                    self.sent.append(Request(DELETE, sid, handle.seq))
                else:
                    handle = self.client.save({"sessionId": sid, "version": i + 1})
                    assert handle.seq is not None
                    self.sent.append(Request(SAVE, sid, handle.seq, version=i + 1))
            except BrokerUnavailable as exc:
                self.refused.append((sid, exc))
            i += 1


def test_producer_during_broker_outage_delivers_or_raises(
    deployment: Deployment, scale: Scale
) -> None:
    # Given a worker and an API server publishing continuously through the client
    deployment.worker()
    settings = Settings(**deployment.all_settings)  # type: ignore[arg-type]
    client = CheckpointClient.from_settings(settings)
    producer = Producer(client, sessions=scale.sessions // 3)
    thread = threading.Thread(target=producer.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(producer.sent) >= 200, timeout=60, message="publishing")
        # When the broker is down for a few seconds (AOF keeps what it acknowledged)
        deployment.broker.stop()
        before = len(producer.sent)
        hold(scale.broker_outage)
        deployment.broker.start()
        wait_until(
            lambda: len(producer.sent) >= before + 200, timeout=60, message="publishing to resume"
        )
    finally:
        producer.stop.set()
        thread.join(timeout=60)
        client.close()
    # Then every publish that returned was applied, and every other one raised a clear error
    verdict = deployment.settle(producer.sent, timeout=180)
    reasons = {str(exc) for _, exc in producer.refused}
    clear = all("could not publish checkpoint." in r for r in reasons)
    finish(
        deployment,
        verdict,
        scenario="9-producer-broker-down",
        title="producer publishing while the broker is down",
        load=describe(scale, len(producer.sent), len(winners(producer.sent))),
        faults=f"broker down {scale.broker_outage:.0f} s during publishing",
        notes=f"{len(producer.refused)} publish(es) raised BrokerUnavailable to the caller "
        "after the retry policy (~3 s); every publish that returned was applied",
        passed=clear,
    )
    assert producer.sent, "nothing was published"
    assert clear, reasons
    assert settings.broker_url is not None
    assert all(redact_url(settings.broker_url) in r for r in reasons), reasons  # says where
    assert judge(deployment.store(), producer.sent).exact
