"""Issue 44 item 3: ``CHECKPOINTQ_BROKER_DURABILITY=replicated``, against a real broker
primary and its replica (``replicaof``), the replica's link frozen by SIGSTOP.

With ``replicated`` a save returns only once the replica has its message and pending
record; a replica that does not acknowledge in time makes it raise ``ReplicationTimeout``
(the primary has it, a retry is harmless); ``local`` returns as before.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from checkpointq.store import RedisStore
from checkpointq.tasks.errors import ReplicationTimeout
from checkpointq.tasks.producer.aio import AsyncCheckpointClient
from checkpointq.tasks.producer.batching import BatchingClient
from checkpointq.tasks.producer.broker_durability import BrokerDurability
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.outcomes import APPLIED, SUPERSEDED
from checkpointq.worker.ops import health
from checkpointq.worker.ops.health import online_replicas
from checkpointq.worker.settings import Settings
from tests.faults.harness import QUEUE, Deployment
from tests.faults.test_broker_faults import _client as broker_faults_client
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until

pytestmark = pytest.mark.integration

#: The WAIT's timeout where a replica is frozen: the save must raise after about this long.
#: The same clients save with the replica live too, so it leaves a loaded machine room to
#: schedule the replica's acknowledgement (300 ms once did not, in CI).
FROZEN_TIMEOUT_MS = 2000
#: Where the replica is only paused for a moment: far longer than the pause.
PATIENT_TIMEOUT_MS = 10_000


@pytest.fixture
def replica(broker: RedisServer) -> Iterator[RedisServer]:
    """A replica of the fault suite's broker, in sync before the test starts."""
    primary = broker.client()
    primary.config_set("repl-diskless-sync-delay", 0)  # sync at once, not after 5 s
    server = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(broker.port)]).start()
    probe = server.client()
    try:
        wait_until(
            lambda: probe.info("replication")["master_link_status"] == "up",
            message="the replica in sync",
        )
        # The replica says "up" once it loaded the snapshot; the primary counts it online
        # only on its first acknowledgement after that, and health reads the primary's view.
        wait_until(
            lambda: online_replicas(primary.info("replication")) == 1,
            message="the primary sees its replica online",
        )
        yield server
    finally:
        primary.close()
        probe.close()
        server.cleanup()


@contextmanager
def frozen(server: RedisServer) -> Iterator[None]:
    """``server`` stopped (SIGSTOP: its link to the primary alive, nothing acknowledged)."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def caught_up(primary: RedisServer) -> None:
    """Wait until every replica of ``primary`` acknowledged all it was sent."""
    client = primary.client()

    def acknowledged() -> bool:
        info = client.info("replication")
        replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        offset = info["master_repl_offset"]
        return bool(replicas) and all(r["offset"] >= offset for r in replicas)

    try:
        wait_until(acknowledged, timeout=30, message="the replica caught up")
    finally:
        client.close()


def _client(deployment: Deployment, durability: BrokerDurability) -> CheckpointClient:
    return broker_faults_client(deployment, durability=durability)


def _pending_requests(server: RedisServer, deployment: Deployment, session_id: str) -> set[str]:
    client = server.client()
    try:
        fields: list[bytes] = client.hkeys(deployment.keys.pending_requests(session_id))  # type: ignore[assignment]
    finally:
        client.close()
    return {f.decode() for f in fields}


def test_a_replicated_save_returns_once_the_replica_has_it(
    deployment: Deployment, replica: RedisServer
) -> None:
    client = _client(deployment, BrokerDurability.replicated(timeout_ms=PATIENT_TIMEOUT_MS))
    resumed = threading.Event()
    try:
        # Given a replica paused for a moment: its acknowledgement comes once it resumes
        assert replica.process is not None
        os.kill(replica.process.pid, signal.SIGSTOP)

        def resume() -> None:
            time.sleep(0.3)  # the fault's length, not a synchronisation
            resumed.set()
            os.kill(replica.process.pid, signal.SIGCONT)  # type: ignore[union-attr]

        thread = threading.Thread(target=resume)
        thread.start()
        try:
            handle = client.save(make_checkpoint("replicated", version=1))
            # Then the save returned only after the replica was back and acknowledged it
            returned_after_resume = resumed.is_set()
        finally:
            thread.join()
            os.kill(replica.process.pid, signal.SIGCONT)
        assert returned_after_resume
        # And the replica holds its message and its pending record
        assert replica.client().llen(QUEUE) == 1
        assert _pending_requests(replica, deployment, "replicated") == {handle.request}
        # And a delete is waited for alike
        deleted = client.delete("replicated")
        assert deleted.request in _pending_requests(replica, deployment, "replicated")
    finally:
        client.close()


def test_a_save_no_replica_acknowledges_raises_and_stays_on_the_primary(
    deployment: Deployment, replica: RedisServer
) -> None:
    deployment.worker()
    client = _client(deployment, BrokerDurability.replicated(timeout_ms=FROZEN_TIMEOUT_MS))
    local = _client(deployment, BrokerDurability())
    try:
        # Given a broker whose only replica is frozen
        with frozen(replica):
            started = time.monotonic()
            with pytest.raises(ReplicationTimeout) as raised:
                client.save(make_checkpoint("frozen", version=1))
            waited = time.monotonic() - started
            # A local save returns as before (the primary has it)
            local.save(make_checkpoint("local", version=1))
        # Then the error says what happened, after the WAIT's timeout, without a retry
        error = raised.value
        assert (error.acked, error.replicas, error.timeout_ms) == (0, 1, FROZEN_TIMEOUT_MS)
        assert f"only 0 of 1 replica(s) acknowledged it within {FROZEN_TIMEOUT_MS} ms" in str(error)
        assert "may still apply" in str(error)
        assert waited >= FROZEN_TIMEOUT_MS / 1000
        assert error.handle is not None and error.handle.session_id == "frozen"
        # And the request is on the primary, served to loads, kept in the recovery window
        assert client.pending_records is not None and len(client.pending_records.recent) == 1
        caught_up(deployment.broker)
        # And a retry, once the replica is back, is harmless: the first applies or is
        # superseded by the retry, and the store ends with the retried turn
        retried = client.save(make_checkpoint("frozen", version=2))
        assert client.wait_durable(retried, timeout=30).outcome == APPLIED
        assert client.wait_durable(error.handle, timeout=30).outcome == SUPERSEDED
        loaded = client.load("frozen")
        assert loaded is not None and loaded.version == 2
    finally:
        client.close()
        local.close()


def test_the_same_request_published_again_after_a_timeout_applies_once(
    deployment: Deployment, replica: RedisServer
) -> None:
    """The retry a caller may make of the very request (its id and seq): fenced."""
    deployment.worker()
    client = _client(deployment, BrokerDurability.replicated(timeout_ms=FROZEN_TIMEOUT_MS))
    try:
        publication = client.requests.save_staged(make_checkpoint("again", version=1), None)
        with frozen(replica), pytest.raises(ReplicationTimeout):
            client.publish(publication)
        caught_up(deployment.broker)
        handle = client.publish(publication)  # the replica back: acknowledged
        assert client.wait_durable(handle, timeout=30).outcome == APPLIED
        loaded = client.load("again")
        assert loaded is not None and loaded.version == 1
        # The second copy found the request applied: nothing changed, nothing refused
        wait_until(lambda: deployment.backlog() == 0, timeout=30, message="the queue drained")
        assert client.wait_durable(handle, timeout=5).outcome == APPLIED
        assert deployment.dead_letters().count() == 0
    finally:
        client.close()


def test_the_asyncio_client_and_the_batching_twin_wait_alike(
    deployment: Deployment, replica: RedisServer
) -> None:
    settings = deployment.all_settings
    durability = BrokerDurability.replicated(timeout_ms=FROZEN_TIMEOUT_MS)

    async def play() -> None:
        client = AsyncCheckpointClient(
            str(settings["broker_url"]),
            RedisStore.from_url(str(settings["store_url"])),
            queue=QUEUE,
            clock=SeqClock(),
            durability=durability,
        )
        try:
            handle = await client.save(make_checkpoint("aio", version=1))
            assert _pending_requests(replica, deployment, "aio") == {handle.request}
            with frozen(replica), pytest.raises(ReplicationTimeout) as raised:
                await client.delete("aio")
            assert raised.value.handle is not None and raised.value.handle.task.endswith("delete")
            assert await client.load("aio") is None  # the primary has the delete
        finally:
            await client.close()

    asyncio.run(play())
    batching = BatchingClient(_client(deployment, durability), window_ms=10_000)
    try:
        with frozen(replica):
            batching.save(make_checkpoint("batched", version=1))
            batching.delete("other")
            with pytest.raises(ReplicationTimeout, match="a batch of 2 requests"):
                batching.flush()
    finally:
        batching.close()


def test_health_says_the_mode_and_whether_the_broker_has_the_replicas(
    deployment: Deployment, replica: RedisServer
) -> None:
    def durability(**settings: object) -> health.Check:
        all_settings = {**deployment.all_settings, **settings}
        report = health.check(Settings(**all_settings))  # type: ignore[arg-type]
        (check,) = [c for c in report.checks if c.name == "broker durability"]
        assert report.as_json()["checks"]["broker durability"]["ok"] == check.ok
        return check

    local = durability()
    assert local.ok and local.detail.startswith("local")
    enough = durability(broker_durability="replicated")
    assert enough.ok and enough.detail.startswith("replicated (1 of 1 replica(s) connected")
    short = durability(broker_durability="replicated", broker_replicas=2)
    assert not short.ok
    assert short.detail.startswith("replicated needs 2 replica(s), the broker has 1 connected")
