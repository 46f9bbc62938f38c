"""The store contract every checkpoint store fulfils, and the parts they share.

Writes are *fenced* by ``seq``: a causal timestamp in microseconds (docs/protocol.md, the
producer rule). A save applies iff its ``seq`` is above the last applied ``seq`` of the
session (save or delete), or equal to it when it repeats the request that set the fence; a
delete leaves a tombstone carrying its ``seq`` so that an older save arriving late cannot
resurrect the session. At equal ``seq`` a delete wins over a save, so the outcome never
depends on arrival order. Re-applying the same request is harmless.

The fence also keeps the winning request's id, so a producer can tell whether its own
request is the one applied or was superseded (``request_outcome``).
"""

from __future__ import annotations

import abc
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import orjson

from checkpointq.store.codec import DEFAULT_MAX_DECOMPRESSED, ZSTD_MAGIC, CodecError, ValueCodec
from checkpointq.store.encryption import (
    Keyring,
    OpenFailed,
    is_sealed,
    open_without_keys,
    sealed_key_id,
)
from checkpointq.store.errors import (
    CheckpointTooLarge,
    CorruptCheckpoint,
    InvalidCheckpoint,
    InvalidInput,
    SessionBusy,
)
from checkpointq.store.model import Checkpoint, display_id, validate_session_id
from checkpointq.store.ordering import SEQ_TIME_FLOOR, OrderKey, deadline_ms, order_key
from checkpointq.store.reconcile import ReconcileReport
from checkpointq.store.serde import (
    deserialize_checkpoint,
    deserialize_storable,
    serialize_checkpoint,
)

logger = logging.getLogger(__name__)

#: A clock returning seconds since the Unix epoch, like ``time.time``; injectable for tests.
Clock = Callable[[], float]

#: ``seq`` values must stay exact as JSON numbers in every language (IEEE doubles).
MAX_SEQ = 2**53 - 1

DAY = 24 * 60 * 60


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """Policy shared by every store; the worker's settings map onto it."""

    #: Lifetime of a session after its last save or refresh, in seconds (Go: 30 days).
    ttl_seconds: float = 30 * DAY
    #: How long a fence outlives what it guards, in seconds: a save's fence lives until its
    #: value's deadline plus this, a delete's tombstone until every request ordered before
    #: it is past its deadline (seq + TTL) plus this (``ordering``). A margin for clocks,
    #: not for queues: however long a request waits, it lapses at its own deadline.
    tombstone_ttl_seconds: float = 1 * DAY
    #: Most recent messages kept in ``conversationHistory`` (Go: 100).
    history_cap: int = 100
    #: Largest stored value, in bytes after compression; older messages are dropped to fit.
    max_value_bytes: int = 1024 * 1024
    #: zstd level for stored values. Level 1 at every size: on generated conversations it
    #: compresses 20 KB in 55 us of CPU against level 3's 88 us (2 KB: 9 vs 12 us; 200 KB:
    #: 835 vs 1,021 us) for values 2.5-4.6% larger; any level reads the same in Go.
    compression_level: int = 1
    #: Refuse to decompress stored values beyond this many bytes (corrupt or hostile data).
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED
    #: Redis Cluster only: at least this often, in seconds, a sweep reads every slot's index
    #: instead of only those its hint names. This bounds how late a session whose deadline
    #: the hint cannot know (see ``RedisStore.expire_stale``) is expired and announced.
    sweep_full_pass_seconds: float = 300.0
    #: Encryption at rest (store/encryption.py): every value written is sealed under the
    #: keyring's first key, and sealed values of any of its keys load. None: values are
    #: written in clear; sealed ones fail to load with ``MissingEncryptionKey``.
    encryption: Keyring | None = None

    def __post_init__(self) -> None:
        if self.ttl_seconds <= 0 or self.tombstone_ttl_seconds <= 0:
            raise ValueError("ttl_seconds and tombstone_ttl_seconds must be positive")
        if self.sweep_full_pass_seconds <= 0:
            raise ValueError("sweep_full_pass_seconds must be positive")
        if self.history_cap < 1 or self.max_value_bytes < 64:
            raise ValueError("history_cap must be >= 1 and max_value_bytes >= 64")


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What a save did. ``applied`` is False when a newer request had already won."""

    ref: str
    applied: bool
    session_id: str
    version: int
    seq: int
    #: Messages dropped from the history to respect the cap and the byte budget.
    trimmed: int = 0
    #: Size of the stored value in bytes (0 when not applied).
    stored_bytes: int = 0
    #: The save arrived past its deadline (``ordering``): never applied, and older requests
    #: of its session are fenced out as if it had been applied and had expired.
    lapsed: bool = False

    @classmethod
    def of(
        cls, ref: str, checkpoint: Checkpoint, seq: int, encoded: EncodedCheckpoint, applied: bool
    ) -> SaveResult:
        """What saving ``checkpoint`` as ``encoded`` did: the one place every store builds it."""
        if not applied:
            return cls(ref, False, checkpoint.session_id, checkpoint.version, seq)
        return cls(
            ref,
            True,
            checkpoint.session_id,
            checkpoint.version,
            seq,
            encoded.trimmed,
            len(encoded.value),
        )

    @classmethod
    def lapse(cls, ref: str, checkpoint: Checkpoint, seq: int) -> SaveResult:
        """A save that arrived past its deadline: not applied (``CheckpointStore.lapse``)."""
        return cls(ref, False, checkpoint.session_id, checkpoint.version, seq, lapsed=True)


@dataclass(frozen=True, slots=True)
class Page:
    """One page of live session ids; pass ``cursor`` back for the next, None when done."""

    session_ids: list[str] = field(default_factory=list)
    cursor: str | None = None


@dataclass(frozen=True, slots=True)
class SessionCounts:
    """Sessions by state: ``live`` (before their deadline) and ``expired`` (past it, not yet
    removed by a sweep: invisible to ``load`` and ``list`` already)."""

    live: int
    expired: int


@dataclass(frozen=True, slots=True)
class Fence:
    """The last request applied to a session: its ``seq``, whether it was a delete, and its
    request id (``""`` when its producer gave none).

    ``live`` says whether the session's value is known to be there, before its deadline: a
    save's fence is live until the value expires, or until reconciliation finds the value
    deleted behind the store's back (a Go ``RedisStore``'s ``DEL``)."""

    seq: int
    deleted: bool
    request_id: str = ""
    live: bool = False
    #: Set by a save that lapsed (``ordering``): it holds the fence, but never stored a value.
    lapsed: bool = False

    @property
    def key(self) -> OrderKey:
        """The order key of the request that set the fence (``ordering.order_key``)."""
        return order_key(self.seq, self.deleted, self.request_id)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the worker dead-lettered: why, and the dead letter's entry id."""

    kind: str
    reason: str
    entry: str
    #: The refused request's ``seq`` when its message had one: a producer waiting on another
    #: request of the session under the same id (a faulty producer reusing it) is not told
    #: of this refusal.
    seq: int | None = None

    def encode(self) -> bytes:
        """The refusal record as its session's refusals hash keeps it (JSON: Go reads it)."""
        record: dict[str, object] = {"kind": self.kind, "reason": self.reason, "entry": self.entry}
        if self.seq is not None:
            record["seq"] = self.seq
        return orjson.dumps(record)

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Refusal | None:
        """A record as ``encode`` wrote it; None for none (or one that does not parse)."""
        if raw is None:
            return None
        try:
            fields = orjson.loads(raw)
            seq = fields.get("seq")
            return cls(
                str(fields["kind"]),
                str(fields["reason"]),
                str(fields["entry"]),
                seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None

    def names(self, seq: int | None) -> bool:
        """Whether this refusal may be of the request stamped ``seq`` (its id's, in its
        session: one recorded without a seq may be any)."""
        return self.seq is None or seq is None or self.seq == seq


@dataclass(frozen=True, slots=True)
class EncodedCheckpoint:
    """A checkpoint ready to store: compressed bytes and what trimming it took."""

    value: bytes
    trimmed: int


@dataclass(frozen=True, slots=True)
class StagedDecoded:
    """A staged value opened and validated (``CheckpointStore.decode_staged``)."""

    checkpoint: Checkpoint
    #: The value is in this store's format (zstd, sealed under its first key if any).
    own_format: bool
    #: The value's JSON when it held canonical JSON (``SaveOp.document``), else None.
    document: bytes | None = None


@dataclass(frozen=True, slots=True)
class SaveOp:
    """One save of a batch (``CheckpointStore.apply_batch``)."""

    checkpoint: Checkpoint
    seq: int | None = None
    request_id: str = ""
    #: ``checkpoint`` as its producer encoded it (a staged save's value): stored as it is
    #: when it fits this store's cap and budget (``CheckpointStore.encode_op``).
    encoded: EncodedCheckpoint | None = None
    #: ``checkpoint``'s canonical JSON as its producer serialised it (a staged save's
    #: value, validated into ``checkpoint``): compressed as it is unless it needs trimming.
    document: bytes | None = None


@dataclass(frozen=True, slots=True)
class DeleteOp:
    """One delete of a batch (``CheckpointStore.apply_batch``)."""

    session_id: str
    seq: int | None = None
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class LapseOp:
    """A save known to be past its deadline, whose checkpoint need not be read (a staged
    save's value may be gone): ``CheckpointStore.lapse``."""

    session_id: str
    seq: int
    request_id: str = ""


BatchOp = SaveOp | DeleteOp | LapseOp

#: What one item of a batch did: a save's result, a delete's or a lapse's ``applied`` flag,
#: the invalid input that refused it, or ``SessionBusy`` when its session's row is held by
#: another client (it is to be retried later, on its own); the other items still apply.
BatchResult = SaveResult | bool | InvalidInput | SessionBusy


def new_identity(before: float = 0.0) -> str:
    """A fresh store identity (``CheckpointStore.identity``): a random UUID, then when it
    was made (``@`` and ms since the epoch; ``before`` seconds earlier), so that an
    announcement of the store's identity can be told to predate it
    (``checkpointq.tasks.store_identity``)."""
    return f"{uuid.uuid4()}@{int((time.time() - before) * 1000)}"


def identity_created_ms(identity: str) -> int | None:
    """When ``identity`` was made (``new_identity``); None for another form."""
    _, at, created = identity.rpartition("@")
    return int(created) if at and created.isdigit() else None


def validate_seq(seq: object) -> int:
    """Return ``seq`` if it is a valid ordering key, else raise InvalidInput."""
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise InvalidInput(f"must be an integer, got {type(seq).__name__}", field="seq")
    if not 0 <= seq <= MAX_SEQ:
        raise InvalidInput(f"must be between 0 and 2**53-1, got {seq}", field="seq")
    return seq


class CheckpointStore(abc.ABC):
    """Load, save, delete, refresh, list and expire session checkpoints.

    Implementations must make ``save`` and ``delete`` idempotent and order-safe (see the
    module docstring) and must hide expired sessions from ``load`` and ``list`` even before
    ``expire_stale`` removes them.
    """

    ref_scheme: str = "store"
    #: Whether ``request_outcome`` reads the refusals the workers record beside this store
    #: (the Redis store's own Redis). Beside any other store they live on the broker, and
    #: producers read them there (``PendingRecords.refusal``).
    keeps_refusals: bool = False

    def __init__(self, options: StoreOptions | None = None, clock: Clock = time.time) -> None:
        self.options = options or StoreOptions()
        self.clock = clock
        #: The session TTL and the fences' margin in ms (read on every write: computed once).
        self.ttl_ms = max(1, round(self.options.ttl_seconds * 1000))
        self.tombstone_ms = max(1, round(self.options.tombstone_ttl_seconds * 1000))
        self.codec = ValueCodec(
            level=self.options.compression_level,
            max_decompressed=self.options.max_decompressed_bytes,
        )

    # -- the contract -------------------------------------------------------------------

    @abc.abstractmethod
    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
        """Apply a save unless a request with a higher ``seq`` already won, or another one
        (or a delete) with the same ``seq``. ``request_id`` names the request in the fence."""

    @abc.abstractmethod
    def load(self, session_id: str) -> Checkpoint | None:
        """Return the live checkpoint, or None when absent, expired or deleted."""

    @abc.abstractmethod
    def delete(self, session_id: str, seq: int | None = None, request_id: str = "") -> bool:
        """Delete and leave a tombstone; False when a request ordered after it had already
        won (``ordering``)."""

    @abc.abstractmethod
    def lapse(self, session_id: str, seq: int, request_id: str = "") -> bool:
        """Settle a save that arrived past its deadline without storing anything: if it is
        ordered after the fence, the session's value goes (it would have expired by now)
        and the fence records the lapsed save, so older requests stay out; False when a
        request ordered at or after it had already won."""

    @abc.abstractmethod
    def refresh(self, session_id: str) -> bool:
        """Extend a live session's lifetime without rewriting it; False if it is absent."""

    @abc.abstractmethod
    def fence(self, session_id: str) -> Fence | None:
        """The last applied request of a session, while it is remembered (read-your-writes:
        a request with ``seq`` S is durable once ``fence.seq >= S``)."""

    def fences(self, session_ids: Sequence[str]) -> list[Fence | None]:
        """Each session's fence, in order (stores may read them in one round trip)."""
        return [self.fence(session_id) for session_id in session_ids]

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        """The live checkpoint and the session's fence, read together: the fence is never
        older than the checkpoint, so a request stamped after ``fence.seq`` sorts after the
        write that was loaded. Stores override this to read both at once."""
        checkpoint = self.load(session_id)
        return checkpoint, self.fence(session_id)

    def load_at(self, session_id: str) -> tuple[Checkpoint | None, Fence | None, int]:
        """``load_with_fence``, and the store's time at the read (ms): what a producer
        judges a pending save's deadline by when it merges it (``PendingRecords.load``).
        Stores whose server keeps time override this to give the server's."""
        checkpoint, fence = self.load_with_fence(session_id)
        return checkpoint, fence, int(self.clock() * 1000)

    def request_outcome(
        self, session_id: str, request_id: str
    ) -> tuple[Fence | None, Refusal | None]:
        """The session's fence, and the refusal of ``request_id`` if a worker recorded one
        (only the Redis store keeps refusals, beside the dead letters)."""
        return self.fence(session_id), None

    @abc.abstractmethod
    def list_page(self, cursor: str | None = None, count: int = 1000) -> Page:
        """One page of live session ids; iterate until ``cursor`` is None."""

    @abc.abstractmethod
    def expire_stale(self, now: float | None = None, limit: int = 1000) -> list[str]:
        """Remove up to ``limit`` sessions whose deadline has passed; return their ids."""

    @abc.abstractmethod
    def count_sessions(self, now: float | None = None) -> SessionCounts:
        """How many sessions are live and how many expired but not yet swept, at ``now``
        (default: the store's clock)."""

    def apply_batch(self, ops: Sequence[BatchOp]) -> list[BatchResult]:
        """Apply saves and deletes in order, each fenced by its own ``seq`` as if alone.

        An item the store refuses (``InvalidInput``, e.g. ``CheckpointTooLarge``) gets its
        exception as its result and the others still apply. This version applies one item
        after another; stores override it to apply a batch in one round trip.

        Raises:
            StoreUnavailable: the store failed; some items may have applied. Applying the
                whole batch again is safe: every item is fenced.
        """
        results: list[BatchResult] = []
        for op in ops:
            try:
                if isinstance(op, SaveOp):
                    results.append(self.save(op.checkpoint, op.seq, op.request_id))
                elif isinstance(op, LapseOp):
                    results.append(self.lapse(op.session_id, op.seq, op.request_id))
                else:
                    results.append(self.delete(op.session_id, op.seq, op.request_id))
            except InvalidInput as exc:
                results.append(exc)
        return results

    def reconcile(self, budget: int = 10_000) -> ReconcileReport:
        """One slice of reconciling the index with values other writers left (see
        ``RedisStore.reconcile``). A store that only this process writes has nothing to
        reconcile: every slice completes an empty pass."""
        return ReconcileReport(completed_pass=True)

    def identity(self) -> str | None:
        """This store's identity: a random id created once in the store itself by its first
        user (worker or producer) and read back by every other, so that two processes can
        tell whether they share a store whatever URLs they reach it by. None: this kind of
        store has none (producers and workers then cannot compare).

        Raises:
            StoreUnavailable: the store could not be read.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections; the store is unusable afterwards."""

    def write_refusal(self) -> str | None:
        """None when the store accepts a write now; else why not, in one line.

        Asked before a request that keeps failing is given up on: while the store refuses
        every write (down, out of memory, read-only) the request waits in the broker
        instead. A store held in memory always accepts.
        """
        return None

    # -- shared behaviour ---------------------------------------------------------------

    def iter_session_ids(self, batch: int = 1000) -> Iterator[str]:
        """Every live session id, fetched a page at a time (each id once per page)."""
        cursor: str | None = None
        seen: set[str] = set()
        while True:
            page = self.list_page(cursor, batch)
            for session_id in page.session_ids:
                if session_id not in seen:
                    seen.add(session_id)
                    yield session_id
            if page.cursor is None:
                return
            cursor = page.cursor

    def list(self) -> list[str]:
        """Every live session id. Use ``iter_session_ids`` or ``list_page`` for large sets."""
        return list(self.iter_session_ids())

    def ref(self, session_id: str, version: int) -> str:
        return f"{self.ref_scheme}://{session_id}/v{version}"

    def now_seq(self) -> int:
        """The ``seq`` stamped on a request that arrives without one."""
        return int(self.clock() * 1_000_000)

    def resolve_seq(self, seq: int | None) -> int:
        return self.now_seq() if seq is None else validate_seq(seq)

    def lapsed(self, seq: int, now_ms: int) -> bool:
        """Whether a save stamped ``seq`` is past its deadline at ``now_ms`` (``ordering``)."""
        return seq >= SEQ_TIME_FLOOR and seq // 1000 + self.ttl_ms <= now_ms

    def value_deadline_ms(self, seq: int, now_ms: int) -> int:
        """When a save stamped ``seq`` and applied at ``now_ms`` expires: its own deadline
        for a time ``seq`` (so a value never outlives a request ordered after it), else
        TTL from now (a counter)."""
        deadline = deadline_ms(seq, self.ttl_ms)
        return now_ms + self.ttl_ms if deadline is None else deadline

    def tombstone_expiry_ms(self, seq: int, now_ms: int) -> int:
        """When a delete's (or a lapsed save's) fence may be forgotten: once every request
        ordered before it is past its deadline, plus the tombstone margin (workers whose
        clocks lag the store's, a TTL shortened since). A counter's: the margin from now."""
        deadline = deadline_ms(seq, self.ttl_ms)
        return max(now_ms, deadline or 0) + self.tombstone_ms

    @staticmethod
    def check_session_id(session_id: object) -> str:
        return validate_session_id(session_id)

    def encode(self, checkpoint: Checkpoint, document: bytes | None = None) -> EncodedCheckpoint:
        """Serialize and compress, dropping the oldest messages to respect cap and budget.

        ``document``: ``serialize_checkpoint(checkpoint)`` when the caller has it already (a
        producer does, for its message); it is compressed as it is unless trimming is needed.

        Raises:
            CheckpointTooLarge: even the newest message alone exceeds ``max_value_bytes``.
        """
        history = checkpoint.conversation_history
        cap = self.options.history_cap
        keep = min(len(history), cap)
        if len(history) > cap:
            logger.warning(
                "session %s: history has %d messages; keeping the most recent %d",
                display_id(checkpoint.session_id),
                len(history),
                cap,
            )
        if document is not None and keep == len(history):
            value = self.seal(checkpoint.session_id, self.codec.encode(document))
        else:
            value = self._encode_keeping(checkpoint, keep)
        budget = self.options.max_value_bytes
        if len(value) > budget:
            value, keep = self._fit_budget(checkpoint, keep, budget)
            logger.warning(
                "session %s: checkpoint exceeds %d bytes compressed; kept the %d most recent "
                "messages",
                display_id(checkpoint.session_id),
                budget,
                keep,
            )
        return EncodedCheckpoint(value=value, trimmed=len(history) - keep)

    def encode_op(self, op: SaveOp) -> EncodedCheckpoint:
        """``op``'s value: the producer's encoding when it is this store's format within its
        history cap and budget (what ``encode`` would make of it), else ``encode``'s."""
        given = op.encoded
        if (
            given is not None
            and self._is_own_format(op.checkpoint.session_id, given.value)
            and len(given.value) <= self.options.max_value_bytes
            and len(op.checkpoint.conversation_history) <= self.options.history_cap
        ):
            return given
        return self.encode(op.checkpoint, op.document)

    def _is_own_format(self, session_id: str, value: bytes) -> bool:
        """Whether ``value`` is what this store writes: zstd, sealed under the first key when
        encryption is on (a producer seals the JSON itself when it fits: the store then
        compresses and seals it again)."""
        keyring = self.options.encryption
        if keyring is None:
            return value.startswith(ZSTD_MAGIC)
        if sealed_key_id(value) != keyring.primary:
            return False
        try:
            return keyring.open(session_id, value).startswith(ZSTD_MAGIC)
        except OpenFailed:
            return False

    def decode_value(self, session_id: str, stored: bytes) -> Checkpoint:
        """A value in the store's format (``encode``'s, sealed or clear) as a checkpoint.

        Raises:
            CorruptCheckpoint: it does not decode, or is sealed and does not open for this
                session (tampered with, or moved from another session).
            MissingEncryptionKey: it is sealed under a key this store lacks.
        """
        try:
            return deserialize_checkpoint(self.codec.decode(self.unseal(session_id, stored)))
        except (CodecError, InvalidCheckpoint, OpenFailed) as exc:
            raise CorruptCheckpoint(session_id, str(exc)) from None

    def decode_staged(self, session_id: str, value: bytes) -> StagedDecoded:
        """``decode_value``, and whether ``value`` is this store's format already (what
        ``encode_op`` keeps as it is), from one open: a staged value opened here need not
        be opened again to learn that it holds JSON, which the store compresses and seals.
        JSON comes back too when it is canonical (``deserialize_storable``): the store
        compresses it as it is rather than serialise the checkpoint again.

        Raises:
            CorruptCheckpoint, MissingEncryptionKey: as ``decode_value``.
        """
        try:
            plain = self.unseal(session_id, value)
            if plain.startswith(ZSTD_MAGIC):
                checkpoint, document = deserialize_checkpoint(self.codec.decode(plain)), None
            else:
                json_bytes = self.codec.decode(plain)
                checkpoint, canonical = deserialize_storable(json_bytes)
                document = json_bytes if canonical else None
        except (CodecError, InvalidCheckpoint, OpenFailed) as exc:
            raise CorruptCheckpoint(session_id, str(exc)) from None
        keyring = self.options.encryption
        under = None if keyring is None else keyring.primary
        own = plain.startswith(ZSTD_MAGIC) and sealed_key_id(value) == under
        return StagedDecoded(checkpoint, own, document)

    def seal(self, session_id: str, value: bytes) -> bytes:
        """A compressed value as this store writes it: sealed when encryption is on."""
        keyring = self.options.encryption
        return value if keyring is None else keyring.seal(session_id, value)

    def unseal(self, session_id: str, stored: bytes) -> bytes:
        """A stored value's compressed (or JSON) bytes: opened when sealed, else as it is.

        Raises:
            OpenFailed: sealed, and it does not open for this session.
            MissingEncryptionKey: sealed under a key this store lacks.
        """
        if not is_sealed(stored):
            return stored
        keyring = self.options.encryption
        if keyring is None:
            raise open_without_keys(session_id, stored)
        return keyring.open(session_id, stored)

    def _encode_keeping(self, checkpoint: Checkpoint, keep: int) -> bytes:
        history = checkpoint.conversation_history
        if keep != len(history):
            checkpoint = checkpoint.model_copy(
                update={"conversation_history": history[len(history) - keep :]}
            )
        return self.seal(checkpoint.session_id, self.codec.encode(serialize_checkpoint(checkpoint)))

    def _fit_budget(self, checkpoint: Checkpoint, keep: int, budget: int) -> tuple[bytes, int]:
        # Binary search for the most messages that fit: O(log n) compressions, not O(n).
        low, high = 0, keep - 1  # keep itself is known not to fit
        best: bytes | None = None
        while low <= high:
            mid = (low + high) // 2
            value = self._encode_keeping(checkpoint, mid)
            if len(value) <= budget:
                best, low = value, mid + 1
            else:
                high = mid - 1
        if best is None or high < 1:
            raise CheckpointTooLarge(
                f"session {display_id(checkpoint.session_id)}: even the most recent message "
                f"alone does not fit the {budget}-byte stored-size budget",
                field="conversationHistory",
            )
        return best, high
