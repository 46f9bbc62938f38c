"""The stock Celery worker consumes what the client's fast path LPUSHes, unchanged."""

from __future__ import annotations

import threading

import pytest

from checkpointq.tasks.producer.client import CheckpointClient
from tests.support.checkpoints import make_checkpoint
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration


def test_fast_path_saves_deletes_and_refreshes_are_applied_by_the_stock_worker(
    live: Deployment,
) -> None:
    # Given a client of a Redis broker: it publishes through the fast path
    with live.checkpoint_client() as client:
        assert client._publisher is not None
        # When it saves two sessions, deletes one and refreshes the other
        kept = client.save(make_checkpoint("fast-kept", version=3, messages=40))
        gone = client.save(make_checkpoint("fast-gone", version=1))
        deleted = client.delete("fast-gone")
        client.refresh("fast-kept")
        # Then the worker applies every request, in the order the seqs say
        client.wait_durable(kept, timeout=15)
        fence = client.wait_durable(deleted, timeout=15)
        assert fence.deleted and gone.seq is not None and fence.seq > gone.seq
        loaded = client.load("fast-kept")
        assert loaded is not None and loaded.version == 3
        assert len(loaded.conversation_history) == 40
        assert client.load("fast-gone") is None
        live.wait_drained()
    # And nothing was refused or dead-lettered on the way
    assert live.dead_letters().count() == 0
    log = live.worker.log()
    assert "Received unregistered task" not in log and "Traceback" not in log


def test_many_fast_path_saves_from_threads_all_arrive(live: Deployment) -> None:
    # Given one client shared by four threads, each saving its own sessions
    with live.checkpoint_client() as client:
        handles = []
        lock = threading.Lock()

        def produce(thread: int) -> None:
            for n in range(25):
                handle = client.save(make_checkpoint(f"fast-t{thread}-{n}", version=n + 1))
                with lock:
                    handles.append(handle)

        threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Then every one of the hundred requests becomes durable
        for handle in handles:
            client.wait_durable(handle, timeout=30)
        assert len(client.list()) == 100


def test_a_client_built_from_settings_publishes_fast(live: Deployment) -> None:
    # Given a client built from the deployment's settings alone
    client = CheckpointClient.from_settings(live.settings)
    try:
        assert client._publisher is not None
        handle = client.save(make_checkpoint("fast-settings"))
        client.wait_durable(handle, timeout=15)
    finally:
        client.close()
    live.wait_drained()


def test_compressed_plain_and_trimmed_saves_are_all_applied(live: Deployment) -> None:
    # Given a client sending zstd bodies (the default), one sending plain JSON, and a save
    # over the history cap (its body goes plain: the record holds the trimmed value)
    cap = live.settings.history_cap
    with live.checkpoint_client() as zstd, live.checkpoint_client() as plain:
        plain.compress_messages = False
        handles = [
            zstd.save(make_checkpoint("body-zstd", version=2, messages=30)),
            plain.save(make_checkpoint("body-plain", version=3, messages=30)),
            zstd.save(make_checkpoint("body-trimmed", version=4, messages=cap + 5)),
        ]
        # Then the worker applies each one, and stores what the pending record served
        for handle, kept in zip(handles, (30, 30, cap), strict=True):
            served = zstd.load(handle.session_id)
            zstd.wait_durable(handle, timeout=15)
            stored = zstd.store.load(handle.session_id)
            assert stored is not None and stored == served
            assert len(stored.conversation_history) == kept
        live.wait_drained()
    assert live.dead_letters().count() == 0
    assert "Traceback" not in live.worker.log()
