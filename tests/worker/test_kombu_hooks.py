"""The private kombu hooks go in only where they are proven (worker/hooks/kombu.py); anywhere
else a real worker runs kombu's stock path, says so in one line, and applies every save."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointq.worker.hooks import kombu as kombu_hooks
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import REPO, CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained

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
    # scripts/test-matrix runs this on the lowest and highest kombu the worker supports
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
