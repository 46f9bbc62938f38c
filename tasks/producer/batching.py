"""Opt-in producer batching: coalesce saves and deletes for a few ms into one message.

A worker's throughput is bounded by Celery's per-message cost, not by Redis, and one
``checkpoint.apply_batch`` message of many requests is applied in one pipelined round trip
(``tasks/batch.py``). ``BatchingClient`` wraps a ``CheckpointClient``: a background thread
publishes a batch at the latest ``window_ms`` after its first request, a full batch
(``max_items``, ``max_bytes``) goes at once, each item keeps its own ``seq``, outcome
(request ``T:i``) and pending record, and a publish that failed in the background is raised
by the next call. Create it after forking (its thread does not survive a fork); share it
between threads. docs/design.md lists its guarantees; docs/api.md has an example.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from checkpointq.store.base import Fence
from checkpointq.store.encryption import EncryptionError
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.tasks import messages
from checkpointq.tasks.errors import BrokerUnavailable, ReplicationTimeout
from checkpointq.tasks.messages import APPLY_BATCH, DELETE, MAX_ITEMS, SAVE
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.core import ProducerCore
from checkpointq.tasks.producer.outcomes import RequestOutcome
from checkpointq.tasks.producer.pending import DELETE_OP, SAVE_OP, RecordWrite
from checkpointq.tasks.producer.requests import Handle, Publication

logger = logging.getLogger(__name__)

#: Bytes of a batch body beyond its items: ``[[`` ... ``]],{},{embed}]`` and the commas.
_FRAMING = 128


class OpenBatch:
    """The batch being filled, without I/O or locks (both batching clients hold one): its
    encoded items, their pending records and the message they make."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.items: list[bytes] = []
        # Each item's pending record, without its request id (``<task id>:<index>``).
        self.records: list[tuple[str, int, str, bytes]] = []
        self.size = 0
        self.saves = 0
        self.task_id = ""

    def too_large(self, item: bytes) -> bool:
        """Whether ``item`` alone is larger than a batch may be (it goes as a request)."""
        return len(item) + 1 > self.max_bytes

    def fits(self, item: bytes) -> bool:
        return len(self.items) < self.max_items and self.size + len(item) + 1 <= self.max_bytes

    @property
    def full(self) -> bool:
        return len(self.items) >= self.max_items

    def add(self, item: bytes, task: str, session_id: str, seq: int, value: bytes) -> Handle:
        """Add ``item`` (it ``fits``), opening the batch if empty; the request's handle."""
        if not self.items:
            self.task_id = str(uuid.uuid4())
        op = SAVE_OP if task == SAVE else DELETE_OP
        self.items.append(item)
        self.records.append((session_id, seq, op, value))
        self.size += len(item) + 1
        self.saves += task == SAVE
        # The worker names item i of batch T "T:i" (tasks/batch.py).
        return Handle(self.task_id, task, session_id, seq, f"{self.task_id}:{len(self.items) - 1}")

    def take(self) -> Publication | None:
        """The batch's ``checkpoint.apply_batch`` message (None if empty); empties it."""
        items, task_id, saves, pending = self.items, self.task_id, self.saves, self.records
        self.items, self.size, self.saves, self.records = [], 0, 0, []
        if not items:
            return None
        records = tuple(
            RecordWrite(session_id, seq, op, f"{task_id}:{index}", value)
            for index, (session_id, seq, op, value) in enumerate(pending)
        )
        body = messages.body(b"[[" + b",".join(items) + b"]]", b"{}")
        argsrepr = f"[<{len(items)} items: {saves} saves, {len(items) - saves} deletes>]"
        handle = Handle(task_id, APPLY_BATCH, "", None)
        return Publication(APPLY_BATCH, body, argsrepr, "{}", task_id, records, handle)


def single_request(
    task: str, session_id: str, payload: bytes, seq: int, value: bytes
) -> Publication:
    """An item too large for a batch, as the single request it is."""
    body = messages.body(b"[" + payload + b"]", messages.seq_kwargs(seq))
    argsrepr = f"[<{task.removeprefix('checkpoint.')} {session_id!r}>]"
    task_id = str(uuid.uuid4())
    op = SAVE_OP if task == SAVE else DELETE_OP
    record = RecordWrite(session_id, seq, op, task_id, value)
    handle = Handle(task_id, task, session_id, seq)
    return Publication(task, body, argsrepr, f"{{'seq': {seq}}}", task_id, (record,), handle)


def window_seconds(
    client: ProducerCore, window_ms: float, max_items: int, batching: str, plain: str
) -> float:
    """Check a batching client's options (both clients'); its window in seconds.

    Refuses to batch an encrypting client's saves: an apply_batch item carries its
    checkpoint's JSON, so it would reach the broker in clear. Encrypted saves are staged,
    one message each (docs/security.md).

    Raises:
        ValueError: ``window_ms`` or ``max_items`` out of range.
        EncryptionError: ``client`` encrypts (``batching`` names the batching client,
            ``plain`` the one to use instead).
    """
    if window_ms <= 0 or not 1 <= max_items <= MAX_ITEMS:
        raise ValueError(f"window_ms must be > 0 and max_items within 1..{MAX_ITEMS}")
    if client.encrypted:
        raise EncryptionError(
            f"{batching} sends checkpoints inside its messages, in clear: with encryption "
            f"at rest on, use {plain} (its saves are staged, sealed)"
        )
    return window_ms / 1000


class BatchingClient:
    """A ``CheckpointClient`` whose saves and deletes travel in ``apply_batch`` messages."""

    def __init__(
        self,
        client: CheckpointClient,
        *,
        window_ms: float = 5.0,
        max_items: int = 100,
        max_bytes: int | None = None,
    ) -> None:
        """Batch ``client``'s saves and deletes; the batching client owns (and closes) it.

        Args:
            window_ms: longest a request waits for others before its batch is published.
            max_items: most requests per message (at most ``checkpointq.tasks.messages.MAX_ITEMS``).
            max_bytes: largest message body; default the client's ``max_message_bytes``
                (the worker dead-letters larger ones).

        Raises:
            EncryptionError: ``client`` encrypts (a batch would carry checkpoints in clear).
        """
        self.window = window_seconds(
            client, window_ms, max_items, "BatchingClient", "CheckpointClient"
        )
        self.client = client
        self.max_items = max_items
        self.max_bytes = (max_bytes or client.max_message_bytes) - _FRAMING
        self._cond = threading.Condition()
        # The open batch, and when it is due.
        self._batch = OpenBatch(max_items, self.max_bytes)
        self._deadline = 0.0
        self._error: BrokerUnavailable | ReplicationTimeout | None = None
        self._closed = False
        # Held while a batch is taken and published, so that batches leave in order.
        self._publishing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpointq-batcher", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"BatchingClient({self.client!r}, window_ms={self.window * 1000:g})"

    # -- enqueue ------------------------------------------------------------------------

    def save(self, checkpoint: Checkpoint | dict[str, Any], *, after: int | None = None) -> Handle:
        """Add a save to the open batch; return at once (see the module docstring).
        ``after`` as for ``CheckpointClient.save``.

        Raises:
            InvalidCheckpoint: not a valid checkpoint (nothing was queued).
            InvalidInput: the checkpoint exceeds ``max_message_bytes``.
            BrokerUnavailable: an earlier batch could not be published, or this one.
            ReplicationTimeout: an earlier batch, or this one, is queued on the broker's
                primary but not on enough replicas (``CHECKPOINTQ_BROKER_DURABILITY``).
        """
        cp, document, stored = self.client.prepare_save(checkpoint)
        return self._add(SAVE, cp.session_id, messages.save_item, document, after, stored.value)

    def delete(self, session_id: str, *, after: int | None = None) -> Handle:
        """Add a delete to the open batch; return at once."""
        validate_session_id(session_id)
        sid = orjson.dumps(session_id)
        return self._add(DELETE, session_id, messages.delete_item, sid, after, b"")

    def refresh(self, session_id: str) -> Handle:
        """Refreshes carry no ``seq`` and are not batched: published at once."""
        return self.client.refresh(session_id)

    def _add(
        self,
        task: str,
        session_id: str,
        item_of: Callable[[bytes, int], bytes],
        payload: bytes,
        after: int | None,
        value: bytes,
    ) -> Handle:
        self._raise_pending_error()
        item = b""
        seq = 0
        batch = self._batch
        while True:
            handle: Handle | None = None
            with self._cond:
                if self._closed:
                    raise RuntimeError("the batching client is closed")
                if not item:
                    # Stamped under the lock: items join batches in seq order.
                    seq = self.client.clock.next(session_id, after)
                    item = item_of(payload, seq)
                    if batch.too_large(item):
                        break
                if batch.fits(item):
                    if not batch.items:
                        self._deadline = time.monotonic() + self.window
                        self._cond.notify()
                    handle = batch.add(item, task, session_id, seq, value)
                    if not batch.full:
                        return handle
            # The open batch is full (with or without this item): publish it now.
            self.flush()
            if handle is not None:
                return handle
        # Alone larger than a batch may be: publish it as the single request it is.
        self.flush()
        return self.client.publish(single_request(task, session_id, payload, seq, value))

    # -- publishing -----------------------------------------------------------------------

    def flush(self) -> None:
        """Publish the open batch now, in the caller's thread.

        Raises:
            BrokerUnavailable: this batch, or one published in the background since the last
                call, could not be published.
        """
        self._raise_pending_error()
        self._publish_open_batch()

    def _publish_open_batch(self) -> None:
        with self._publishing:
            with self._cond:
                publication = self._batch.take()
            if publication is not None:
                self.client.publish(publication)

    def _run(self) -> None:
        """The flusher: publish each batch when its window has passed."""
        while True:
            with self._cond:
                while not self._closed:
                    if self._batch.items:
                        wait = self._deadline - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                if self._closed:
                    return
            try:
                self._publish_open_batch()
            except ReplicationTimeout as exc:  # queued on the primary: raised all the same
                logger.error("a batch of checkpoint requests is not on enough replicas: %s", exc)
                with self._cond:
                    self._error = exc
            except BrokerUnavailable as exc:
                logger.error("a batch of checkpoint requests was not published: %s", exc)
                with self._cond:
                    self._error = exc
            except Exception:  # a bug: keep the thread alive, and say so on the next call
                logger.exception("the checkpoint batcher failed")
                with self._cond:
                    self._error = BrokerUnavailable("the checkpoint batcher failed; see the log")

    def _raise_pending_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    # -- everything else is the wrapped client's ----------------------------------------

    def wait_durable(
        self, handle: Handle, timeout: float = 10.0, interval: float = 0.01
    ) -> RequestOutcome:
        """As ``CheckpointClient.wait_durable`` (the request may still be in its window)."""
        return self.client.wait_durable(handle, timeout, interval)

    def load(self, session_id: str) -> Checkpoint | None:
        return self.client.load(session_id)

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        return self.client.load_with_fence(session_id)

    def list(self) -> list[str]:
        return self.client.list()

    def close(self) -> None:
        """Publish what is pending, stop the flusher and close the wrapped client.

        Raises:
            BrokerUnavailable: the last batch (or an earlier one) could not be published.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        try:
            self.flush()
        finally:
            self.client.close()

    def __enter__(self) -> BatchingClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
