"""Issue 22: no conversation turn is lost while the queue lags.

Two ``CheckpointClient`` instances play two API server replicas, each doing what the
apiserver does per turn: load, append a message, save. A real worker applies the requests,
against real redis-servers. While the worker is stopped or the store refuses writes, every
load sees the newest accepted turn (the pending records on the broker); once the lag ends
every turn is in the store and the records are gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from checkpointq.store import Checkpoint, ConversationMessage, RedisStore
from checkpointq.store.base import StoreOptions
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from tests.faults.harness import QUEUE, Deployment
from tests.support.checkpoints import make_checkpoint
from tests.support.cluster import LocalCluster
from tests.support.servers import command_calls, wait_until

pytestmark = pytest.mark.integration

#: How long each of the issue's two scenarios lags.
LAG_SECONDS = 60.0
SESSION = "conversation"


def _turns(checkpoint: Checkpoint | None) -> list[str]:
    return [] if checkpoint is None else [m.content for m in checkpoint.conversation_history]


def take_turn(client: CheckpointClient, session_id: str, n: int) -> Handle:
    """The apiserver's turn: load, append turn ``n``, save as version ``n``."""
    loaded = client.load(session_id)
    assert loaded is not None, f"turn {n}: {session_id!r} loaded as missing"
    history = [*loaded.conversation_history, ConversationMessage(role="user", content=f"turn {n}")]
    return client.save(loaded.model_copy(update={"version": n, "conversation_history": history}))


def _five_turns(store: RedisStore, session_id: str = SESSION) -> None:
    """The session at version 5, turns 1-5, durable in the store."""
    history = [ConversationMessage(role="user", content=f"turn {n}") for n in range(1, 6)]
    checkpoint = make_checkpoint(session_id, version=5).model_copy(
        update={"conversation_history": history}
    )
    store.save(checkpoint, seq=wall_clock_us() - 1_000_000)


class Replicas:
    """Two API server replicas of one deployment (and what they were built from)."""

    def __init__(self, deployment: Deployment, **options: object) -> None:
        self.deployment = deployment
        settings = deployment.all_settings
        store_options = StoreOptions(**options)  # type: ignore[arg-type]
        self.clients = [
            CheckpointClient(
                str(settings["broker_url"]),
                RedisStore.from_url(str(settings["store_url"]), options=store_options),
                queue=QUEUE,
                clock=SeqClock(),  # a clock per replica, as in two processes
            )
            for _ in range(2)
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def every_load_sees(self, turns: list[str], seconds: float) -> int:
        """Both replicas load the session again and again for ``seconds``: each load must
        hold exactly ``turns``. Returns how many loads were checked."""
        deadline, checked = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            for client in self.clients:
                assert _turns(client.load(SESSION)) == turns
                assert SESSION in client.list()
                checked += 1
            time.sleep(0.5)  # the lag's pace, not a synchronisation
        return checked


@pytest.fixture
def replicas(deployment: Deployment) -> Iterator[Replicas]:
    pair = Replicas(deployment)
    yield pair
    pair.close()


def _records(deployment: Deployment) -> int:
    return int(deployment.broker_client().zcard(deployment.keys.pending_index()))


def _lands(deployment: Deployment, turns: list[str], timeout: float = 90.0) -> None:
    """Until the store holds ``turns`` and no pending record is left."""
    store = deployment.store()
    wait_until(
        lambda: _turns(store.load(SESSION)) == turns and _records(deployment) == 0,
        timeout=timeout,
        interval=0.2,
        message=f"the store to hold {len(turns)} turns and the records to be settled",
    )


def test_a_stopped_worker_loses_no_turn_and_loads_see_the_newest(
    deployment: Deployment, replicas: Replicas
) -> None:
    a, b = replicas.clients
    # Given a durable session at version 5 and no worker running (a deploy, a crash)
    _five_turns(deployment.store())
    # When replica A takes turn 6, then replica B takes turn 7 from its own load
    take_turn(a, SESSION, 6)
    assert _turns(b.load(SESSION))[-1] == "turn 6"
    take_turn(b, SESSION, 7)
    # Then through a 60 s lag every load of either replica sees turns 1-7
    every = [f"turn {n}" for n in range(1, 8)]
    assert replicas.every_load_sees(every, LAG_SECONDS) > 100
    assert _turns(deployment.store().load(SESSION)) == every[:5]  # nothing applied yet
    # And once a worker runs, every turn lands and the records are settled
    deployment.worker()
    _lands(deployment, every)
    assert deployment.dead_letters().count() == 0


def test_a_store_refusing_writes_loses_no_turn_and_loads_see_the_newest(
    deployment: Deployment, replicas: Replicas
) -> None:
    a, b = replicas.clients
    deployment.worker()
    _five_turns(deployment.store())
    # Given a store that refuses writes (maxmemory, noeviction), reads still fine
    client = deployment.store_client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1024 * 1024, used // 2))
    try:
        # When A takes turn 6 and B turn 7 while the worker cannot write
        take_turn(a, SESSION, 6)
        take_turn(b, SESSION, 7)
        every = [f"turn {n}" for n in range(1, 8)]
        # Then every load through the 60 s outage sees turns 1-7
        assert replicas.every_load_sees(every, LAG_SECONDS) > 100
        assert _turns(deployment.store().load(SESSION)) == every[:5]
    finally:
        client.config_set("maxmemory", 0)
    # And once the store accepts writes every turn lands
    _lands(deployment, every)
    assert deployment.dead_letters().count() == 0


def test_a_redis_cluster_store_behind_a_single_redis_broker_keeps_every_turn(
    deployment: Deployment,
) -> None:
    cluster = LocalCluster(masters=3).start()
    try:
        deployment.settings["store_url"] = cluster.url
        pair = Replicas(deployment)
        try:
            a, b = pair.clients
            assert a.pending_records is not None and not a.pending_records.one_redis
            store = RedisStore.from_url(cluster.url)
            _five_turns(store)
            take_turn(a, SESSION, 6)
            take_turn(b, SESSION, 7)
            every = [f"turn {n}" for n in range(1, 8)]
            assert pair.every_load_sees(every, 5.0) > 0
            deployment.worker()
            wait_until(
                lambda: _turns(store.load(SESSION)) == every and _records(deployment) == 0,
                timeout=90,
                interval=0.2,
                message="every turn in the cluster store",
            )
            store.close()
        finally:
            pair.close()
    finally:
        cluster.cleanup()


def test_a_pending_request_later_dead_lettered_no_longer_answers_loads(
    deployment: Deployment, replicas: Replicas
) -> None:
    _, b = replicas.clients
    _five_turns(deployment.store())
    # Given a replica whose clock runs 6.5 minutes ahead, told a limit above the workers' 5
    # (so the broker accepts what the worker refuses, CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS)
    skewed = CheckpointClient(
        str(deployment.all_settings["broker_url"]),
        RedisStore.from_url(str(deployment.all_settings["store_url"])),
        queue=QUEUE,
        clock=SeqClock(lambda: wall_clock_us() + 390 * 1_000_000),
        max_seq_ahead_seconds=1200,
    )
    try:
        take_turn(skewed, SESSION, 6)
        assert _turns(b.load(SESSION))[-1] == "turn 6"  # pending, accepted
        # When a worker dead-letters it
        deployment.worker()
        deployment.wait_dead_letters(1)
        # Then its entry is settled and loads fall back to the store
        wait_until(lambda: _records(deployment) == 0, timeout=30, message="the record settled")
        assert _turns(b.load(SESSION)) == [f"turn {n}" for n in range(1, 6)]
        assert not deployment.broker_client().exists(deployment.keys.pending_requests(SESSION))
    finally:
        skewed.close()


def test_the_record_of_a_lost_message_expires_and_loads_fall_back(
    deployment: Deployment,
) -> None:
    # Given replicas whose records live 3 s (CHECKPOINTQ_TTL_SECONDS, scaled down)
    pair = Replicas(deployment, ttl_seconds=3)
    try:
        a, b = pair.clients
        _five_turns(deployment.store())
        take_turn(a, SESSION, 6)
        a.save(make_checkpoint("brand-new"))
        assert _turns(b.load(SESSION))[-1] == "turn 6" and "brand-new" in b.list()
        # When the queue loses the messages (a broker losing data without the records)
        deployment.broker_client().delete(QUEUE)
        # Then once the records expire, loads and lists fall back to the store
        wait_until(
            lambda: len(_turns(b.load(SESSION))) == 5 and b.list() == [SESSION],
            timeout=20,
            message="the records to expire",
        )
        # And the next settled request drops their index entries
        deployment.worker()
        handle = a.save(make_checkpoint("another"))
        a.wait_durable(handle, timeout=30)
        wait_until(lambda: _records(deployment) == 0, timeout=30, message="the index emptied")
    finally:
        pair.close()


def test_kill_9_of_the_worker_mid_group_loses_no_turn(
    deployment: Deployment, replicas: Replicas
) -> None:
    a, b = replicas.clients
    store = deployment.store()
    sessions = [f"killed-{n}" for n in range(1000)]
    for session_id in sessions:
        store.save(make_checkpoint(session_id, version=1), seq=wall_clock_us() - 10_000_000)
    # Given a turn queued for every session, and a worker draining them in groups
    for session_id in sessions:
        take_turn(a, session_id, 2)
    assert _records(deployment) == len(sessions)
    worker = deployment.worker()
    wait_until(
        lambda: _records(deployment) < len(sessions), timeout=60, interval=0.01, message="a group"
    )
    # When the worker is killed (-9) mid-drain
    worker.kill()
    assert _records(deployment) > 0, "the worker drained everything before the kill"
    # Then every replica's load sees every turn, applied or pending
    for session_id in sessions:
        loaded = b.load(session_id)
        assert loaded is not None and loaded.version == 2, session_id
    # And after a restart (redelivery after the visibility timeout) everything lands
    deployment.worker()
    wait_until(
        lambda: _records(deployment) == 0 and deployment.backlog() == 0,
        timeout=120,
        interval=0.2,
        message="every request applied and settled",
    )
    assert all(store.load(s).version == 2 for s in sessions)  # type: ignore[union-attr]
    # (no message left the queue by BRPOP, which the kill could have caught between its
    # reply and the worker recording the message: every one was taken by the reserve script)
    assert command_calls(deployment.broker_client(), "brpop") == 0


def test_a_broker_restart_during_the_lag_keeps_the_records(
    deployment: Deployment, replicas: Replicas
) -> None:
    a, b = replicas.clients
    _five_turns(deployment.store())
    take_turn(a, SESSION, 6)
    assert _turns(b.load(SESSION))[-1] == "turn 6"
    # When the broker restarts (AOF on, as recommended) while nothing consumes
    deployment.broker.stop()
    deployment.broker.start()
    # Then the queue and the records survived: B sees turn 6, no epoch change, turn 7 follows
    take_turn(b, SESSION, 7)
    every = [f"turn {n}" for n in range(1, 8)]
    assert _turns(a.load(SESSION)) == every
    assert a.epoch_changes == b.epoch_changes == 0
    deployment.worker()
    _lands(deployment, every)


def test_a_broker_restarted_without_its_data_is_counted(
    deployment: Deployment, replicas: Replicas
) -> None:
    a, b = replicas.clients
    _five_turns(deployment.store())
    take_turn(a, SESSION, 6)
    assert _turns(b.load(SESSION))[-1] == "turn 6"
    # When the broker comes back empty (no persistence): records and queue are lost
    deployment.broker_client().flushall()
    # Then loads fall back to the store and the loss is counted
    assert len(_turns(b.load(SESSION))) == 5
    assert b.epoch_changes == 1
