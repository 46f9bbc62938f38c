"""The producer's requests, built and judged without I/O: the one place for envelopes'
bodies, causal ``seq`` stamps, pending records and outcomes, shared by the sync client
(``client.CheckpointClient``) and the asyncio one (``aio.AsyncCheckpointClient``).

A client asks ``Requests`` for a ``Publication`` (what to push, with its records and the
``Handle`` to return), pushes it with its own I/O, and hands what it reads back to
``Requests.judge`` (``wait_durable``'s one decision per poll).
"""

from __future__ import annotations

import reprlib
import time
from dataclasses import dataclass, replace
from typing import Any

from checkpointq.store.base import CheckpointStore, EncodedCheckpoint, Fence, Refusal
from checkpointq.store.codec import zstd_bound
from checkpointq.store.encryption import MAX_OVERHEAD, EncryptionError
from checkpointq.store.errors import InvalidInput
from checkpointq.store.model import Checkpoint, validate_session_id
from checkpointq.store.serde import checkpoint_from_wire, dumps_go, serialize_checkpoint
from checkpointq.tasks import messages
from checkpointq.tasks.errors import RequestRefused
from checkpointq.tasks.messages import DELETE, SAVE, SAVE_STAGED
from checkpointq.tasks.producer import compressed_body
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.fast_publish import new_id
from checkpointq.tasks.producer.outcomes import APPLIED, LOST, RequestOutcome, Trimmed, decide
from checkpointq.tasks.producer.pending import DELETE_OP, SAVE_OP, RecordWrite

#: wait_durable's pauses between polls: from ``interval``, doubling, to this at most.
MAX_POLL_INTERVAL = 0.25

# Celery puts a repr of the arguments (up to 1 KB, built by walking all of them) in every
# message's headers for logs and Flower; a few dozen characters say as much.
brief = reprlib.Repr()
brief.maxlevel, brief.maxdict, brief.maxlist, brief.maxstring = 2, 4, 4, 40


@dataclass(frozen=True, slots=True)
class Handle:
    """A request on its way: pass it to ``wait_durable``. ``seq`` is None for refreshes.

    ``task_id`` is the message's id; ``request_id`` names the request itself: the same for a
    single request, ``"<batch task id>:<index>"`` for an item of a batch (empty: the task id).
    """

    task_id: str
    task: str
    session_id: str
    seq: int | None
    request_id: str = ""
    #: A save whose history the store will trim (as this producer encoded it): how and why.
    trimmed: Trimmed | None = None

    @property
    def request(self) -> str:
        """The id the fence and the refusal records know this request by."""
        return self.request_id or self.task_id


@dataclass(frozen=True, slots=True)
class Publication:
    """One message to push: its task, protocol 2 body (``body``: JSON; ``zstd_body``: the
    same as one zstd frame, or None), log reprs, id, the pending records it carries, and the
    handle its caller gets once the push is done."""

    task: str
    body: bytes
    argsrepr: str
    kwargsrepr: str
    task_id: str
    records: tuple[RecordWrite, ...]
    handle: Handle
    zstd_body: bytes | None = None


class Requests:
    """Builds a producer's saves and deletes for ``store`` (its options: history cap, size
    budget, TTL), stamped by ``clock``."""

    def __init__(
        self,
        store: CheckpointStore,
        clock: SeqClock,
        *,
        max_message_bytes: int,
        compress_messages: bool = True,
    ) -> None:
        self.store = store
        self.clock = clock
        #: Encryption at rest (``store.options.encryption``): saves must be staged, their
        #: values sealed here, so that a checkpoint reaches the broker only encrypted.
        self.encrypted = store.options.encryption is not None
        self.max_message_bytes = max_message_bytes
        self.compress_messages = compress_messages

    # -- encoding -------------------------------------------------------------------------

    def encode(self, checkpoint: Checkpoint | dict[str, Any]) -> tuple[Checkpoint, bytes]:
        """Validate ``checkpoint`` (a ``Checkpoint``, or a dict of its Go JSON fields) and
        serialise it once: the Go JSON that both the size check and the message carry.

        Raises:
            InvalidCheckpoint: not a valid checkpoint.
            InvalidInput: its JSON exceeds ``max_message_bytes``.
        """
        cp = checkpoint if isinstance(checkpoint, Checkpoint) else checkpoint_from_wire(checkpoint)
        document = serialize_checkpoint(cp)
        # Sealed, the staged value is the JSON and the envelope: the worker reads it whole
        # only within the same limit, so the envelope counts against it here too.
        limit = self.max_message_bytes - (MAX_OVERHEAD if self.encrypted else 0)
        if len(document) > limit:
            raise InvalidInput(
                f"checkpoint is {len(document)} bytes as JSON; the limit is {limit}",
                field="checkpoint",
            )
        return cp, document

    def prepare_save(
        self, checkpoint: Checkpoint | dict[str, Any]
    ) -> tuple[Checkpoint, bytes, EncodedCheckpoint]:
        """``encode``, and the value the store will hold (the store's own ``encode``: the
        history trimmed to the cap and the stored-size budget, compressed).

        Raises:
            InvalidCheckpoint, InvalidInput: as ``encode``.
            CheckpointTooLarge: it cannot fit the stored-size budget.
        """
        cp, document = self.encode(checkpoint)
        return cp, document, self.store.encode(cp, document)

    def staged_value(
        self, checkpoint: Checkpoint | dict[str, Any]
    ) -> tuple[Checkpoint, bytes, int]:
        """The value a staged save puts on the broker, and how many messages it trimmed: the
        checkpoint's JSON as it is, when it is within the history cap and could not exceed
        the stored-size budget however it compresses (the worker compresses it, as it
        would a message's checkpoint), sealed with encryption on; else the store's own
        ``encode`` (trimmed, zstd, and sealed with encryption on).

        Raises:
            InvalidCheckpoint, InvalidInput, CheckpointTooLarge: as ``prepare_save``.
        """
        cp, document = self.encode(checkpoint)
        options = self.store.options
        if (
            len(cp.conversation_history) <= options.history_cap
            and zstd_bound(len(document)) + (MAX_OVERHEAD if self.encrypted else 0)
            <= options.max_value_bytes
        ):
            # Encrypted, the JSON is sealed as it is: the worker compresses it, as in clear.
            return cp, self.store.seal(cp.session_id, document), 0
        stored = self.store.encode(cp, document)
        return cp, stored.value, stored.trimmed

    def trimmed(self, checkpoint: Checkpoint, trimmed: int) -> Trimmed | None:
        history_cap = self.store.options.history_cap
        return Trimmed.of(len(checkpoint.conversation_history), trimmed, history_cap)

    # -- requests -------------------------------------------------------------------------

    def save(
        self, checkpoint: Checkpoint | dict[str, Any], after: int | None, *, fast: bool
    ) -> Publication:
        """A ``checkpoint.save`` stamped with a fresh causal ``seq`` (after ``after`` and
        every fence this process read for the session). ``fast``: for a Redis broker that
        takes the message as written here (its JSON body as one zstd frame when
        ``compress_messages``); else for Celery, which encodes the message itself.

        Raises:
            InvalidCheckpoint, InvalidInput, CheckpointTooLarge: as ``prepare_save``.
            EncryptionError: encryption is on (the message would carry the checkpoint in
                clear: encrypted saves are staged, ``save_staged``).
        """
        if self.encrypted:
            raise EncryptionError(
                "with encryption at rest on, saves are staged (sealed): a save message "
                "would carry the checkpoint in clear"
            )
        cp, document, stored = self.prepare_save(checkpoint)
        seq = self.clock.next(cp.session_id, after)
        argsrepr = f"[<checkpoint {cp.session_id!r} v{cp.version}, {len(document)} bytes>]"
        task_id = new_id()
        record = RecordWrite(cp.session_id, seq, SAVE_OP, task_id, stored.value)
        prefix, suffix = messages.save_body_framing(seq)
        # The record's value is the zstd frame of ``document`` unless the store trimmed it.
        zstd_body = (
            compressed_body.enclose(stored.value, prefix, suffix)
            if fast and self.compress_messages and not stored.trimmed
            else None
        )
        handle = Handle(task_id, SAVE, cp.session_id, seq, trimmed=self.trimmed(cp, stored.trimmed))
        body = b"".join((prefix, document, suffix))
        return Publication(
            SAVE, body, argsrepr, _seq_repr(seq), task_id, (record,), handle, zstd_body
        )

    def save_staged(
        self, checkpoint: Checkpoint | dict[str, Any], after: int | None
    ) -> Publication:
        """A ``checkpoint.save_staged``: the value goes to the broker once, under the
        request's id, and the message names it (docs/protocol.md, "Staged saves"). Only with
        pending records (a Redis broker): the record's script call writes the value.

        Raises:
            InvalidCheckpoint, InvalidInput, CheckpointTooLarge: as ``prepare_save``.
        """
        cp, value, trimmed = self.staged_value(checkpoint)
        seq = self.clock.next(cp.session_id, after)
        task_id = new_id()
        body = messages.save_staged_body(dumps_go(cp.session_id), seq, trimmed)
        argsrepr = f"[<checkpoint {cp.session_id!r} v{cp.version}, staged {len(value)} bytes>]"
        record = RecordWrite(cp.session_id, seq, SAVE_OP, task_id, value, staged=True)
        handle = Handle(task_id, SAVE_STAGED, cp.session_id, seq, trimmed=self.trimmed(cp, trimmed))
        return Publication(SAVE_STAGED, body, argsrepr, _seq_repr(seq), task_id, (record,), handle)

    def delete(self, session_id: str, after: int | None) -> Publication:
        """A ``checkpoint.delete`` stamped with a fresh causal ``seq``.

        Raises:
            InvalidSessionId: not a session id.
        """
        validate_session_id(session_id)
        seq = self.clock.next(session_id, after)
        body = messages.body(dumps_go([session_id]), messages.seq_kwargs(seq))
        task_id = new_id()
        record = RecordWrite(session_id, seq, DELETE_OP, task_id)
        handle = Handle(task_id, DELETE, session_id, seq)
        argsrepr = brief.repr([session_id])
        return Publication(DELETE, body, argsrepr, _seq_repr(seq), task_id, (record,), handle)

    def send_sealed(self, session_id: str, seq: int, value: bytes) -> Publication:
        """A staged save of an already sealed value under ``seq`` (the replay of an
        encrypted staged save's dead letter): staged again under a new request id, as
        ``save_staged`` stages it; the worker opens and checks it as any staged value.

        Raises:
            InvalidSessionId: not a session id.
        """
        validate_session_id(session_id)
        task_id = new_id()
        body = messages.save_staged_body(dumps_go(session_id), seq)
        argsrepr = f"[<checkpoint {session_id!r}, staged {len(value)} bytes sealed>]"
        record = RecordWrite(session_id, seq, SAVE_OP, task_id, value, staged=True)
        handle = Handle(task_id, SAVE_STAGED, session_id, seq)
        return Publication(SAVE_STAGED, body, argsrepr, _seq_repr(seq), task_id, (record,), handle)

    # -- outcomes -------------------------------------------------------------------------

    def judge(
        self, handle: Handle, fence: Fence | None, refusal: Refusal | None
    ) -> RequestOutcome | None:
        """``handle``'s outcome from the session's fence and the request's refusal record as
        just read, or None while it is still on its way (``outcomes``). The fence is
        observed by the clock, so that the next request sorts after it.

        Raises:
            ValueError: the handle has no ``seq`` (a refresh).
            RequestRefused: a worker dead-lettered the request (kind, reason, entry id).
        """
        if handle.seq is None:
            raise ValueError(f"{handle.task} requests carry no seq to wait for")
        request = handle.request
        if fence is not None:
            self.clock.observe(handle.session_id, fence.seq)
        # The fence first: it is the session's own, while a refusal names a request id.
        outcome = decide(handle.task, request, handle.seq, fence, self.lapsed(handle.seq))
        if outcome is not None:
            if outcome.outcome == APPLIED and handle.trimmed is not None:
                return replace(outcome, trimmed=handle.trimmed)
            return outcome
        if refusal is not None and refusal.names(handle.seq) and refusal.kind == LOST:
            # Its message was gone while its record stayed (a purge): never applied.
            winner = "" if fence is None else fence.request_id
            seq = 0 if fence is None else fence.seq
            return RequestOutcome(LOST, seq, fence is not None and fence.deleted, winner)
        if refusal is not None and refusal.names(handle.seq):
            description = f"{handle.task} {request} for session {handle.session_id!r}"
            raise RequestRefused(description, refusal.kind, refusal.reason, refusal.entry)
        return None

    def poll(self, handle: Handle, timeout: float, interval: float) -> Poll:
        """``wait_durable``'s schedule for ``handle``, started now (``Poll``)."""
        return Poll(self, handle, timeout, interval)

    def lapsed(self, seq: int) -> bool:
        """Whether a request stamped ``seq`` is certainly past its deadline (by this
        producer's clock, less the store's tombstone margin for clocks that disagree)."""
        store = self.store
        return store.lapsed(seq, self.clock.now_us() // 1000 - store.tombstone_ms)


class Poll:
    """One ``wait_durable``: judge each read (``Requests.judge``), and say how long to pause
    before the next, from ``interval`` doubling to ``MAX_POLL_INTERVAL``, until ``timeout``."""

    def __init__(self, requests: Requests, handle: Handle, timeout: float, interval: float):
        self.requests = requests
        self.handle = handle
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.delay = interval

    def judge(self, fence: Fence | None, refusal: Refusal | None) -> RequestOutcome | None:
        """As ``Requests.judge``."""
        return self.requests.judge(self.handle, fence, refusal)

    def pause(self, fence: Fence | None) -> float:
        """Seconds to wait before the next read.

        Raises:
            TimeoutError: the deadline has passed (saying what the fence was).
        """
        if time.monotonic() >= self.deadline:
            handle = self.handle
            at = "no fence" if fence is None else f"fence at seq {fence.seq}"
            raise TimeoutError(
                f"{handle.task} {handle.request} for session {handle.session_id!r} (seq "
                f"{handle.seq}) not applied within {self.timeout}s ({at})"
            )
        delay, self.delay = self.delay, min(self.delay * 2, MAX_POLL_INTERVAL)
        return delay


def _seq_repr(seq: int) -> str:
    return f"{{'seq': {seq}}}"
