"""The private kombu hooks go in only where they are proven (worker/hooks/kombu.py); anywhere
else a real worker runs kombu's stock path, says so in one line, and applies every save."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import connection, entity

from checkpointq.worker.hooks import kombu as kombu_hooks
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import REPO, CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained

# kombu's hints are partial (untyped functions): its classes are used as Any here.
Connection: Any = connection.Connection
Queue: Any = entity.Queue

#: Makes the worker's kombu report a line no hook is proven on, before anything imports it.
UNPROVEN_KOMBU = """
import kombu
kombu.VERSION = kombu.VERSION._replace(minor=99)
kombu.__version__ = "5.99.0"
"""

STOCK_PATH_LINE = "kombu hooks off: kombu 5.99.0 is not a line they are proven on"


@pytest.fixture(autouse=True)
def _fresh_verdict() -> Iterator[None]:
    kombu_hooks.refusal.cache_clear()
    yield
    kombu_hooks.refusal.cache_clear()


def test_the_hooks_are_proven_on_the_installed_kombu() -> None:
    # on the lowest and highest kombu the worker supports (scripts/test-matrix, main suite)
    assert kombu_hooks.refusal() is None


def test_a_changed_kombu_function_keeps_the_hooks_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the installed kombu's reader differs from the copy proven for its line
    import kombu

    line = (int(kombu.VERSION[0]), int(kombu.VERSION[1]))
    changed = {**kombu_hooks.PROVEN[line], "redis.Channel._brpop_read": "0" * 16}
    monkeypatch.setitem(kombu_hooks.PROVEN, line, changed)
    # Then the hooks are refused, naming what changed
    why = kombu_hooks.refusal()
    assert why is not None and "changed redis.Channel._brpop_read" in why


def test_an_unproven_kombu_line_keeps_the_hooks_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import kombu

    monkeypatch.setattr(kombu, "VERSION", kombu.VERSION._replace(minor=99))
    why = kombu_hooks.refusal()
    assert why is not None and "is not a line they are proven on (5.5, 5.6, 5.7)" in why


@pytest.mark.integration
def test_an_unproven_kombu_runs_the_stock_path_and_applies_every_save(
    broker_server: RedisServer, store_server: RedisServer, tmp_path: Path
) -> None:
    # Given a coalescing worker whose kombu is a line the hooks are not proven on
    (tmp_path / "sitecustomize.py").write_text(UNPROVEN_KOMBU)
    values = {
        **TEST_WORKER_SETTINGS,
        "broker_url": broker_server.url,
        "store_url": store_server.url,
    }
    env = checkpointq_env(**values)
    env["PYTHONPATH"] = f"{tmp_path}:{REPO}"
    worker = CeleryProcess("worker", env).start()
    settings = Settings(**values)  # type: ignore[arg-type]
    try:
        assert settings.coalescing
        # When a producer sends saves, one at a time and then a burst
        from checkpointq.tasks.producer.client import CheckpointClient

        with CheckpointClient.from_settings(settings) as client:
            first = client.save(make_checkpoint("stock-0", version=1))
            client.wait_durable(first, timeout=20)
            handles = [client.save(make_checkpoint(f"stock-{i}", version=2)) for i in range(40)]
            # Then every one is applied, and every message acknowledged
            for handle in handles:
                client.wait_durable(handle, timeout=30)
            wait_redis_queue_drained(broker_server.client, timeout=20)
            assert {client.load(f"stock-{i}").version for i in range(40)} == {2}  # type: ignore[union-attr]
        # And the worker is still up, having said once why it reads the stock way
        assert worker.process is not None and worker.process.poll() is None
        assert worker.log().count("kombu hooks off") == 1
        assert STOCK_PATH_LINE in worker.log()
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


def test_a_dead_workers_message_is_handed_out_by_the_sweep(redis_server: RedisServer) -> None:
    # Given a message a worker took from the queue and never acknowledged, held past the
    # visibility timeout (its unacked index entry backdated: the worker died long ago)
    url = f"{redis_server.url.rsplit('/', 1)[0]}/7"
    options = {"visibility_timeout": 10, "unacked_restore_interval": 1}
    broker = Connection(url, transport_options=options)
    with broker:
        channel = broker.channel()
        queue = Queue("sweep-test", channel=channel)
        queue.declare()
        broker.Producer(channel).publish({"n": 1}, routing_key="sweep-test")
        held = queue.get(no_ack=False)
        assert held is not None
        client = channel.client
        (tag,) = client.zrange(channel.unacked_index_key, 0, -1)
        client.zadd(channel.unacked_index_key, {tag: 1})
        assert client.llen("sweep-test") == 0
        # When the sweep runs on a consumer reading from that channel
        consumer = types.SimpleNamespace(task_consumer=types.SimpleNamespace(channel=channel))
        kombu_hooks._sweep(consumer)
        # Then the message is back in its queue and no longer held
        assert client.llen("sweep-test") == 1
        assert client.zcard(channel.unacked_index_key) == 0
        client.flushdb()
        channel.close()


def test_the_sweep_is_added_only_where_kombu_ignores_the_restore_schedule() -> None:
    from checkpointq.worker.app import create_app

    app = create_app(Settings(broker_url="redis://127.0.0.1:1/0"))
    names = {step.__name__ for step in app.steps["consumer"]}
    # kombu 5.7 sweeps every unacked_restore_interval itself; 5.5 and 5.6 every 100 s
    assert ("RestoreSweep" in names) == (not kombu_hooks.sweeps_on_schedule())
