"""Opt-in producer batching for asyncio: the saves and deletes of concurrent handlers, made
within a few ms of each other, travel in one ``checkpoint.apply_batch`` message.

``AsyncBatchingClient`` wraps an ``AsyncCheckpointClient`` and fills the same batch as the
sync ``BatchingClient`` (``batching.OpenBatch``: each item its own ``seq``, request id
``T:i`` and pending record). Unlike the sync one, a ``save`` returns once its batch is
published (the broker holds it, as the plain client's does): the wait is the window, at most
``window_ms``, shared by every request in it. A cancelled ``save`` stays in its batch, which is
published whole or not at all; batches leave in the order they were opened.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from checkpointq.store.base import Fence
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.tasks import messages
from checkpointq.tasks.messages import DELETE, SAVE
from checkpointq.tasks.producer.aio import AsyncCheckpointClient
from checkpointq.tasks.producer.batching import (
    _FRAMING,
    OpenBatch,
    single_request,
    window_seconds,
)
from checkpointq.tasks.producer.outcomes import RequestOutcome
from checkpointq.tasks.producer.requests import Handle, Publication


class AsyncBatchingClient:
    """An ``AsyncCheckpointClient`` whose saves and deletes travel in ``apply_batch``
    messages; one per event loop, as the client it wraps."""

    def __init__(
        self,
        client: AsyncCheckpointClient,
        *,
        window_ms: float = 5.0,
        max_items: int = 100,
        max_bytes: int | None = None,
    ) -> None:
        """Batch ``client``'s saves and deletes; the batching client owns (and closes) it.
        The options are ``BatchingClient``'s.

        Raises:
            EncryptionError: ``client`` encrypts (a batch would carry checkpoints in clear).
        """
        self.window = window_seconds(
            client, window_ms, max_items, "AsyncBatchingClient", "AsyncCheckpointClient"
        )
        self.client = client
        self._batch = OpenBatch(max_items, (max_bytes or client.max_message_bytes) - _FRAMING)
        # Resolved once the open batch is published (its error, if it could not be).
        self._published: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Publishes wait for this in the order they began: batches leave in order.
        self._order = asyncio.Lock()
        self._publishing: set[asyncio.Task[None]] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"AsyncBatchingClient({self.client!r}, window_ms={self.window * 1000:g})"

    async def save(
        self, checkpoint: Checkpoint | dict[str, Any], *, after: int | None = None
    ) -> Handle:
        """Add a save to the open batch; return once the batch is published.

        Raises:
            InvalidCheckpoint, InvalidInput, CheckpointTooLarge: nothing was queued.
            BrokerUnavailable, SeqRefused: the batch could not be published.
        """
        cp, document, stored = self.client.requests.prepare_save(checkpoint)
        return await self._add(SAVE, cp.session_id, document, after, stored.value)

    async def delete(self, session_id: str, *, after: int | None = None) -> Handle:
        """Add a delete to the open batch; return once the batch is published."""
        validate_session_id(session_id)
        return await self._add(DELETE, session_id, orjson.dumps(session_id), after, b"")

    async def _add(
        self, task: str, session_id: str, payload: bytes, after: int | None, value: bytes
    ) -> Handle:
        if self._closed:
            raise RuntimeError("the batching client is closed")
        batch = self._batch
        seq = self.client.clock.next(session_id, after)
        item = (messages.save_item if task == SAVE else messages.delete_item)(payload, seq)
        if batch.too_large(item):  # alone larger than a batch may be: the request it is
            await self.flush()
            return await self.client.publish(single_request(task, session_id, payload, seq, value))
        if not batch.fits(item):
            self._publish_open_batch()
        if not batch.items:
            loop = asyncio.get_running_loop()
            self._published = loop.create_future()
            self._timer = loop.call_later(self.window, self._publish_open_batch)
        published = self._published
        if published is None:  # opened with the batch, above
            raise RuntimeError("the open batch has no publish to wait for")
        handle = batch.add(item, task, session_id, seq, value)
        if batch.full:
            self._publish_open_batch()
        # Shielded: a cancelled caller leaves its request in the batch, published or not
        # with the rest.
        await asyncio.shield(published)
        return handle

    def _publish_open_batch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        publication, published = self._batch.take(), self._published
        self._published = None
        if publication is None or published is None:
            return
        task = asyncio.get_running_loop().create_task(self._publish(publication, published))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, publication: Publication, published: asyncio.Future[None]) -> None:
        async with self._order:
            try:
                await self.client.publish(publication)
            except Exception as exc:
                published.set_exception(exc)
                published.exception()  # raised to every waiter; none left is no leak
            else:
                published.set_result(None)

    async def flush(self) -> None:
        """Publish the open batch now, and wait for every batch on its way.

        Raises:
            BrokerUnavailable: the open batch could not be published.
        """
        published = self._published
        self._publish_open_batch()
        if self._publishing:
            await asyncio.gather(*self._publishing, return_exceptions=True)
        if published is not None:
            await published

    # -- everything else is the wrapped client's ----------------------------------------

    async def wait_durable(
        self, handle: Handle, timeout: float = 10.0, interval: float = 0.01
    ) -> RequestOutcome:
        return await self.client.wait_durable(handle, timeout, interval)

    async def load(self, session_id: str) -> Checkpoint | None:
        return await self.client.load(session_id)

    async def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        return await self.client.load_with_fence(session_id)

    async def list(self) -> list[str]:
        return await self.client.list()

    async def close(self) -> None:
        """Publish what is open, then close the wrapped client.

        Raises:
            BrokerUnavailable: the last batch could not be published.
        """
        if self._closed:
            return
        self._closed = True
        try:
            await self.flush()
        finally:
            await self.client.close()

    async def __aenter__(self) -> AsyncBatchingClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
