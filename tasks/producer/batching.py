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
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.tasks import messages
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.messages import APPLY_BATCH, DELETE, MAX_ITEMS, SAVE
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.outcomes import RequestOutcome
from checkpointq.tasks.producer.pending import DELETE_OP, SAVE_OP, RecordWrite

logger = logging.getLogger(__name__)

#: Bytes of a batch body beyond its items: ``[[`` ... ``]],{},{embed}]`` and the commas.
_FRAMING = 128


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
        """
        if window_ms <= 0 or not 1 <= max_items <= MAX_ITEMS:
            raise ValueError(f"window_ms must be > 0 and max_items within 1..{MAX_ITEMS}")
        self.client = client
        self.window = window_ms / 1000
        self.max_items = max_items
        self.max_bytes = (max_bytes or client.max_message_bytes) - _FRAMING
        self._cond = threading.Condition()
        # The open batch: its encoded items, their total size, its task id and deadline.
        self._items: list[bytes] = []
        # Each item's pending record, without its request id (``<task id>:<index>``).
        self._records: list[tuple[str, int, str, bytes]] = []
        self._size = 0
        self._saves = 0
        self._task_id = ""
        self._deadline = 0.0
        self._error: BrokerUnavailable | None = None
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
        op = SAVE_OP if task == SAVE else DELETE_OP
        self._raise_pending_error()
        item = b""
        seq = 0
        while True:
            handle: Handle | None = None
            with self._cond:
                if self._closed:
                    raise RuntimeError("the batching client is closed")
                if not item:
                    # Stamped under the lock: items join batches in seq order.
                    seq = self.client.clock.next(session_id, after)
                    item = item_of(payload, seq)
                    if len(item) + 1 > self.max_bytes:
                        break
                room = len(self._items) < self.max_items
                if room and self._size + len(item) + 1 <= self.max_bytes:
                    self._append(item, task, (session_id, seq, op, value))
                    # The worker names item i of batch T "T:i" (tasks/batch.py).
                    request_id = f"{self._task_id}:{len(self._items) - 1}"
                    handle = Handle(self._task_id, task, session_id, seq, request_id)
                    if len(self._items) < self.max_items:
                        return handle
            # The open batch is full (with or without this item): publish it now.
            self.flush()
            if handle is not None:
                return handle
        # Alone larger than a batch may be: publish it as the single request it is.
        self.flush()
        body = messages.body(b"[" + payload + b"]", messages.seq_kwargs(seq))
        argsrepr = f"[<{task.removeprefix('checkpoint.')} {session_id!r}>]"
        task_id = str(uuid.uuid4())
        record = RecordWrite(session_id, seq, op, task_id, value)
        kwargsrepr = f"{{'seq': {seq}}}"
        self.client.send_encoded(task, body, argsrepr, kwargsrepr, task_id, [record])
        return Handle(task_id, task, session_id, seq)

    def _append(self, item: bytes, task: str, record: tuple[str, int, str, bytes]) -> None:
        """Add to the open batch (opening one if needed); the caller holds ``_cond``."""
        if not self._items:
            self._task_id = str(uuid.uuid4())
            self._deadline = time.monotonic() + self.window
            self._size = 0
            self._saves = 0
            self._records = []
            self._cond.notify()
        self._items.append(item)
        self._records.append(record)
        self._size += len(item) + 1
        self._saves += task == SAVE

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
                items, task_id, saves = self._items, self._task_id, self._saves
                pending = self._records
                self._items, self._size, self._saves, self._records = [], 0, 0, []
            if not items:
                return
            records = [
                RecordWrite(session_id, seq, op, f"{task_id}:{index}", value)
                for index, (session_id, seq, op, value) in enumerate(pending)
            ]
            body = messages.body(b"[[" + b",".join(items) + b"]]", b"{}")
            argsrepr = f"[<{len(items)} items: {saves} saves, {len(items) - saves} deletes>]"
            self.client.send_encoded(APPLY_BATCH, body, argsrepr, "{}", task_id, records)

    def _run(self) -> None:
        """The flusher: publish each batch when its window has passed."""
        while True:
            with self._cond:
                while not self._closed:
                    if self._items:
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
