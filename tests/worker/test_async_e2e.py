"""The asyncio producer end to end: a FastAPI app on ``AsyncCheckpointClient``, driven through
``httpx.AsyncClient`` with many sessions' turns at once in one event loop, and a real Celery
worker applying them to the store (tests/worker/conftest.py: broker and store apart)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from checkpointq import (
    AsyncBatchingClient,
    AsyncCheckpointClient,
    Checkpoint,
    ConversationMessage,
    RedisStore,
)
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration

SESSIONS = 40
TURNS = 5


def _app(deployment: Deployment) -> FastAPI:
    """An agent server's checkpoint handling: each turn loads the session, appends the
    exchange and saves it; the response says which version the load found."""
    state: dict[str, AsyncCheckpointClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with AsyncCheckpointClient.from_settings(deployment.settings) as client:
            state["client"] = client
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/sessions/{session_id}/turns")
    async def turn(session_id: str, text: str) -> dict[str, int | str]:
        client = state["client"]
        checkpoint = await client.load(session_id) or Checkpoint(session_id=session_id)
        loaded = checkpoint.version
        checkpoint.version += 1
        checkpoint.conversation_history.append(ConversationMessage(role="user", content=text))
        handle = await client.save(checkpoint)
        return {"loaded": loaded, "saved": checkpoint.version, "request": handle.request}

    return app


def test_a_fastapi_app_serves_many_sessions_at_once_and_every_turn_reads_the_last(
    deployment: Deployment,
) -> None:
    # Given a FastAPI app on the asyncio client, and a worker applying its saves,
    # When 40 sessions each take 5 turns, every session's turns in order and all sessions
    # at once in one event loop,
    # Then each turn loads the version the turn before saved (no stale load), and once the
    # queue drains the store holds every session's last turn.
    app = _app(deployment)

    async def session(http: httpx.AsyncClient, n: int) -> list[int]:
        loaded = []
        for t in range(TURNS):
            reply = await http.post(f"/sessions/fastapi-{n}/turns", params={"text": f"turn {t}"})
            assert reply.status_code == 200, reply.text
            loaded.append(reply.json()["loaded"])
        return loaded

    async def main() -> list[list[int]]:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://app") as http,
        ):
            return await asyncio.gather(*(session(http, n) for n in range(SESSIONS)))

    loads = asyncio.run(main())
    assert loads == [list(range(TURNS))] * SESSIONS
    deployment.wait_drained()
    store = RedisStore.from_settings(deployment.settings)
    try:
        for n in range(SESSIONS):
            stored = store.load(f"fastapi-{n}")
            assert stored is not None and stored.version == TURNS
            assert [m.content for m in stored.conversation_history] == [
                f"turn {t}" for t in range(TURNS)
            ]
    finally:
        store.close()


def test_wait_durable_awaits_the_workers_outcome(deployment: Deployment) -> None:
    # Given an async save and a delete after it, When each is awaited to durability,
    # Then the save is applied (then the delete), and the store agrees.
    async def main() -> tuple[str, str]:
        async with AsyncCheckpointClient.from_settings(deployment.settings) as client:
            saved = await client.wait_durable(
                await client.save(Checkpoint(session_id="async-durable", version=1)), timeout=30
            )
            deleted = await client.wait_durable(await client.delete("async-durable"), timeout=30)
            return saved.outcome, deleted.outcome

    assert asyncio.run(main()) == ("applied", "applied")
    store = RedisStore.from_settings(deployment.settings)
    try:
        assert store.load("async-durable") is None
        fence = store.fence("async-durable")
        assert fence is not None and fence.deleted
    finally:
        store.close()


def test_batched_async_saves_are_each_applied_by_the_worker(deployment: Deployment) -> None:
    # Given an AsyncBatchingClient, When 30 handlers save at once and await durability,
    # Then they shared messages (fewer task ids than saves) and each was applied.
    async def main() -> tuple[set[str], list[str]]:
        client = AsyncCheckpointClient.from_settings(deployment.settings)
        async with AsyncBatchingClient(client, window_ms=20) as batching:
            handles = await asyncio.gather(
                *(batching.save(Checkpoint(session_id=f"abatch-{n}", version=1)) for n in range(30))
            )
            outcomes = await asyncio.gather(*(batching.wait_durable(h, 30) for h in handles))
            return {h.task_id for h in handles}, [o.outcome for o in outcomes]

    task_ids, outcomes = asyncio.run(main())
    assert len(task_ids) < 30
    assert outcomes == ["applied"] * 30
