"""A checkpoint store in PostgreSQL: the durable system of record behind the queue.

One row per session, keyed by ``session_key(session_id)`` (any id fits), holds the value (the Go
store's bytes) and the fence; every write is one call of ``{schema}.apply``
(``store/sql/``), fenced by its order key and judged by the database's clock.
``apply_batch`` sends a whole group as one statement over arrays (one round trip, one
commit), waiting at most ``lock_timeout_ms`` on a row another client holds; a group that
meets one (or the database's refusal of one item) runs again item by item, so the others
apply and the held session is ``SessionBusy``, naming its holder. With durability
``replicated`` a write returns only once a standby flushed it (``postgres_replication``).

Connections are one per thread, made on first use and again after a failure, never carried
across a fork, and prepare nothing on the server unless told it is safe (PgBouncer in
transaction mode loses prepared statements between calls). Errors are classified by SQLSTATE
(``postgres_errors``); ``write_refusal`` says in plain words why the database refuses this
code's writes (down, read-only, full, a schema it does not speak, no standby), so that the
worker waits with its messages on the broker instead of dead-lettering them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import psycopg

from checkpointq.store import postgres_replication, postgres_schema
from checkpointq.store.base import (
    BatchOp,
    BatchResult,
    CheckpointStore,
    DeleteOp,
    Fence,
    LapseOp,
    Page,
    SaveOp,
    SaveResult,
    SessionCounts,
    StoreOptions,
    new_identity,
)
from checkpointq.store.errors import (
    InvalidInput,
    NotDurableYet,
    RefusedByStore,
    SessionBusy,
    StoreNotConfigured,
    StoreUnavailable,
)
from checkpointq.store.factory import PostgresSettings
from checkpointq.store.model import Checkpoint
from checkpointq.store.postgres_errors import (
    TERMINATED,
    Kind,
    classify,
    describe,
    refusal,
    reusable_after,
    sqlstate,
)

__all__ = ["PostgresSettings", "PostgresStore", "describe", "session_key"]
from checkpointq.store.urls import redact_url

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The ``application_name`` of the store's connections (``pg_stat_activity``).
APPLICATION_NAME = "checkpointq"

#: Seconds to wait for a connection before the store is called unavailable.
CONNECT_TIMEOUT = 5

#: How long a refused write keeps ``write_refusal`` answering after a probe write went
#: through (a full disk refuses a table's growth while a one-row probe still fits).
REFUSAL_MEMORY_SECONDS = 60.0

#: Milliseconds a group waits on any one row lock before it runs item by item
#: (``CHECKPOINTQ_PG_LOCK_TIMEOUT_MS``).
LOCK_TIMEOUT_MS = 1000
#: Milliseconds each item waits on a lock once a group runs item by item: long enough for
#: another worker's group to commit, short enough that a held row costs little.
ITEM_LOCK_TIMEOUT_MS = 100
#: Seconds a process remembers a session it found held (``apply_batch``); each attempt
#: that finds it held again renews it.
HELD_MEMORY_SECONDS = 10.0
#: Seconds a write waits for a standby to flush it (``CHECKPOINTQ_PG_REPLICATION_TIMEOUT_SECONDS``)
#: and, once one did not, what the next writes wait until one does again.
REPLICATION_TIMEOUT = 10.0
_REPLICATION_RETRY = 0.5
#: Seconds a producer's outcome read waits for a standby to flush the fence it read.
_OUTCOME_REPLICATION_WAIT = 0.2

#: Sessions a write probe tries while the server ends each one it is given: a sweep of
#: ``pg_terminate_backend`` is no refusal; five ended back to back is one.
_PROBE_ATTEMPTS = 5

_SAVE, _DELETE, _LAPSE = "s", "d", "l"

#: The arguments of one ``{schema}.apply`` call.
_Args = tuple[Any, ...]
_APPLIED, _LAPSED, _BUSY, _REFUSED = 1, 2, 3, 4
#: What one item of ``_apply_all`` came to: ``apply``'s code, or (code, SQLSTATE, message)
#: for an item held by a lock (3) or refused by the database (4).
_Code = int | tuple[int, str, str]


def _reusable(conn: psycopg.Connection[Any], exc: BaseException) -> bool:
    """Whether a connection a call just failed on may serve the next one: open, idle, and
    failed by an error its statement raised and ended (``postgres_errors.reusable_after``;
    a schema that moved makes the next call connect again, and check it). A call cut short
    can leave a command in progress on it (every later call then fails with "another
    command is already in progress") or a transaction open; behind a pooler a prepared
    statement can be gone or a message cut: such a connection is closed, and the next call
    makes a new one."""
    if conn.broken or conn.closed:
        return False
    if isinstance(exc, psycopg.Error) and (not reusable_after(exc) or classify(exc) is Kind.SCHEMA):
        return False
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def _sid(session_id: str) -> bytes:
    return session_id.encode("utf-8")


#: Longest id, in UTF-8 bytes, that is its own row key; longer ones are keyed by a digest.
KEY_MAX_ID_BYTES = 256
#: First byte of a digest key: no UTF-8 text starts with it, so no id's key is a digest's.
DIGEST_KEY_MARK = b"\xff"


def session_key(session_id: str) -> bytes:
    """The row's key, as ``{schema}.session_key`` computes it: the id's UTF-8 bytes when at
    most KEY_MAX_ID_BYTES (ids that sort together share index pages), else the mark and
    their sha256 (any id fits under the btree's entry limit)."""
    return _key(_sid(session_id))


def _key(sid: bytes) -> bytes:
    if len(sid) <= KEY_MAX_ID_BYTES and not sid.startswith(DIGEST_KEY_MARK):
        return sid
    return DIGEST_KEY_MARK + hashlib.sha256(sid).digest()


def _rid(request_id: str) -> bytes:
    return request_id.encode("utf-8", "surrogatepass")


def _text(raw: bytes | memoryview | None) -> str:
    return bytes(raw).decode("utf-8", "surrogatepass") if raw is not None else ""


class PostgresStore(CheckpointStore):
    """Sessions in PostgreSQL tables under ``schema``; see the module docstring."""

    ref_scheme = "session"

    def __init__(
        self,
        url: str,
        *,
        schema: str = postgres_schema.DEFAULT_SCHEMA,
        options: StoreOptions | None = None,
        auto_upgrade: bool = True,
        connect_timeout: float = CONNECT_TIMEOUT,
        prepared_statements: bool = False,
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
        durability: str = postgres_replication.REPLICATED,
        replication_timeout: float = REPLICATION_TIMEOUT,
    ) -> None:
        super().__init__(options)
        if durability not in postgres_replication.MODES:
            raise ValueError(
                f"durability must be one of {postgres_replication.MODES}, got {durability!r}"
            )
        self.url = url
        self.schema = postgres_schema.check_schema_name(schema)
        self.auto_upgrade = auto_upgrade
        self.connect_timeout = max(1, round(connect_timeout))
        #: Server-side prepared statements (psycopg prepares a statement at its fifth use):
        #: off unless the deployment says they are safe (a direct connection, or PgBouncer
        #: 1.21+ with ``max_prepared_statements``).
        self.prepared_statements = prepared_statements
        self.lock_timeout_ms = max(0, int(lock_timeout_ms))
        self.durability = durability
        self.replication_timeout = replication_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[psycopg.Connection[Any]] = []
        self._schema_checked = False
        self._closed = False
        #: The last write the database refused, and when (``write_refusal``).
        self._refused: tuple[float, str] | None = None
        #: Sessions found held by another client: id -> (when, who holds it).
        self._held: dict[bytes, tuple[float, str]] = {}
        #: When a write last found no standby to flush it in time (``replicated``).
        self._unreplicated_at = -REFUSAL_MEMORY_SECONDS
        self._replication = postgres_replication.Waiter()
        s = self.schema
        # Parameters go in binary (%b): a value in text would be sent as hex and parsed back,
        # which cost a 32-save group more than its round trip and its commit together.
        arrays = (
            "%b, %b, %b, %b::text[], %b::bytea[], %b::bigint[], %b::bytea[], %b::bytea[], "
            "%b::bigint[], %b::text[], %b::jsonb[]"
        )
        self._group_sql = f"SELECT * FROM {s}.apply_group({arrays})"
        self._each_sql = f"SELECT * FROM {s}.apply_each({arrays})"
        #: The database's clock, read once per statement: ``now_ms()`` is volatile, so
        #: compared as it is it would be called per row and keep an index from bounding
        #: the scan (a sweep with nothing due would read every row: docs/performance.md).
        self._now = f"(SELECT {s}.now_ms())"
        self._read_sql = (
            f"SELECT {s}.now_ms(), t.value, t.value_deadline_ms, t.fence_seq, "
            "t.fence_deleted, t.fence_request_id, t.fence_lapsed, t.fence_expires_ms "
            f"FROM (SELECT 1) AS one LEFT JOIN {s}.sessions AS t ON t.session_key = %s"
        )

    @classmethod
    def from_settings(cls, settings: PostgresSettings) -> PostgresStore:
        """The store a deployment's settings describe (``CHECKPOINTQ_STORE_URL``)."""
        url = settings.resolved_store_url
        if not url:
            raise StoreNotConfigured("no store URL: set CHECKPOINTQ_STORE_URL")
        return cls(
            url,
            schema=settings.pg_schema,
            options=settings.store_options(),
            auto_upgrade=settings.pg_auto_upgrade,
            prepared_statements=settings.pg_prepared_statements,
            lock_timeout_ms=settings.pg_lock_timeout_ms,
            durability=settings.pg_durability,
            replication_timeout=settings.pg_replication_timeout_seconds,
        )

    def __repr__(self) -> str:
        return f"PostgresStore({redact_url(self.url)}, schema={self.schema})"

    # -- connections --------------------------------------------------------------------

    def _connect(self, write: bool) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=self.connect_timeout,
            application_name=APPLICATION_NAME,
            # None: never prepared on the server (psycopg's default prepares at the 5th use).
            prepare_threshold=5 if self.prepared_statements else None,
        )
        if not self._schema_checked:
            try:
                self._check_schema(conn, write)
            except BaseException:
                conn.close()
                raise
        with self._lock:
            self._connections.append(conn)
        return conn

    def _check_schema(self, conn: psycopg.Connection[Any], write: bool) -> None:
        """Check (and upgrade, if allowed) the schema. A newer one still serves reads (its
        readers' columns are kept across versions: producers keep loading during a rolling
        upgrade); a write on it raises ``SchemaMismatch`` until it is one this code speaks."""
        try:
            postgres_schema.check(conn, self.schema, auto_upgrade=self.auto_upgrade)
        except postgres_schema.SchemaMismatch as exc:
            if write or not exc.newer:
                raise
            return  # checked again by the next write
        self._schema_checked = True

    @contextmanager
    def _connection(self, action: str, *, write: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """This thread's connection; database errors become ``StoreUnavailable``."""
        if self._closed:
            raise StoreUnavailable(f"{action}: the store is closed")
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is not None and (getattr(self._local, "pid", None) != os.getpid() or conn.closed):
            # Made before a fork (the parent's session: never close it from here), or lost.
            conn = None
        try:
            if conn is None:
                conn = self._connect(write)
                self._local.conn, self._local.pid = conn, os.getpid()
                self._local.sessions = getattr(self._local, "sessions", 0) + 1
            elif write and not self._schema_checked:
                self._check_schema(conn, write)  # a read connected while it was newer
            yield conn
        except BaseException as exc:
            if conn is not None and not _reusable(conn, exc):
                self._forget(conn)
            if not isinstance(exc, psycopg.Error):
                raise
            if classify(exc) is Kind.SCHEMA:
                self._schema_checked = False  # the next connection checks it again
            error = StoreUnavailable(f"{action}: PostgreSQL {describe(exc)}")
            error.refusal = refusal(exc)
            if write and error.refusal is not None:
                self._refused = (time.monotonic(), error.refusal)
            raise error from exc
        else:
            if write:
                self._refused = None

    def _forget(self, conn: psycopg.Connection[Any]) -> None:
        self._local.conn = None
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        conn.close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    # -- writes -------------------------------------------------------------------------

    def _args(self, op: str, session_id: str, seq: int, request_id: str, **save: Any) -> _Args:
        return (
            op,
            _sid(session_id),
            seq,
            _rid(request_id),
            save.get("value"),
            save.get("version"),
            save.get("last_run_ref"),
            save.get("metadata"),
            self.ttl_ms,
            self.tombstone_ms,
        )

    def _save_args(self, op: SaveOp) -> tuple[_Args, Any]:
        checkpoint = op.checkpoint
        seq = self.resolve_seq(op.seq)
        encoded = self.encode_op(op)
        last_run_ref: str | None = None
        metadata_text: str | None = None
        # Encrypted, the queryable copies would hold the conversation's metadata and run
        # names in clear: they stay NULL, the version alone is copied (docs/security.md).
        if self.options.encryption is None:
            metadata = orjson.dumps(checkpoint.metadata.model_dump(mode="json", by_alias=True))
            if b"\\u0000" in metadata:  # jsonb holds no NUL; the value keeps it, the copy cannot
                metadata = metadata.replace(b"\\u0000", b"")
            metadata_text = metadata.decode()
            last_run_ref = checkpoint.last_run_ref.replace("\x00", "")
        args = self._args(
            _SAVE,
            checkpoint.session_id,
            seq,
            op.request_id,
            value=encoded.value,
            version=checkpoint.version,
            last_run_ref=last_run_ref,
            metadata=metadata_text,
        )
        return args, (seq, encoded)

    def apply_batch(self, ops: Sequence[BatchOp]) -> list[BatchResult]:
        """Every item in one statement, so one transaction (one round trip, one commit).

        Items are sent ordered by session id (each session's own in their order), so that
        two workers' groups lock rows in the same order and never deadlock. In a group of
        several, the items of a session this process found held by another client in the
        last ``HELD_MEMORY_SECONDS`` are not sent: they are ``SessionBusy`` at once, and
        each tries alone, waiting ``ITEM_LOCK_TIMEOUT_MS`` at most, so that a held row
        costs its own requests little and the others nothing.

        Raises:
            StoreUnavailable: the transaction failed: nothing of the group applied, and
                applying it again is safe.
        """
        results: list[BatchResult | None] = [None] * len(ops)
        sent: list[tuple[bytes, int, _Args, Any]] = []
        for index, op in enumerate(ops):
            try:
                if isinstance(op, SaveOp):
                    args, extra = self._save_args(op)
                    sent.append((args[1], index, args, extra))
                elif isinstance(op, LapseOp):
                    self.check_session_id(op.session_id)
                    seq = validate_seq_or_raise(self, op.seq)
                    args = self._args(_LAPSE, op.session_id, seq, op.request_id)
                    sent.append((args[1], index, args, None))
                else:
                    self.check_session_id(op.session_id)
                    seq = self.resolve_seq(op.seq)
                    args = self._args(_DELETE, op.session_id, seq, op.request_id)
                    sent.append((args[1], index, args, None))
            except InvalidInput as exc:
                results[index] = exc
        held = self._still_held()
        if len(ops) > 1 and held:
            for sid, index, _, _ in sent:
                if sid in held:
                    results[index] = SessionBusy(_text(sid), held[sid][1])
            sent = [item for item in sent if item[0] not in held]
        if sent:
            sent.sort(key=lambda item: item[0])  # stable: a session's items keep their order
            short = len(sent) == 1 and sent[0][0] in held
            codes = self._apply_all(
                [args for _, _, args, _ in sent],
                ITEM_LOCK_TIMEOUT_MS if short else self.lock_timeout_ms,
            )
            for (sid, index, _, extra), code in zip(sent, codes, strict=True):
                holder = codes.holders.get(sid)
                results[index] = self._result(ops[index], code, extra, holder)
                if holder is not None and not holder.by_worker:
                    self._held[sid] = (time.monotonic(), holder.text)
                elif sid in held:
                    self._held.pop(sid, None)
        return [result for result in results if result is not None]

    def _still_held(self) -> dict[bytes, tuple[float, str]]:
        """The sessions this process found held in the last ``HELD_MEMORY_SECONDS``."""
        now = time.monotonic()
        for sid, (at, _) in list(self._held.items()):
            if now - at > HELD_MEMORY_SECONDS:
                self._held.pop(sid, None)
        return dict(self._held)

    def _result(self, op: BatchOp, code: _Code, extra: Any, holder: _Holder | None) -> BatchResult:
        """What ``op`` came to, from its code (``_apply_all``)."""
        session_id = op.checkpoint.session_id if isinstance(op, SaveOp) else op.session_id
        if isinstance(code, tuple):
            number, state, message = code
            if number == _BUSY:
                if holder is None:
                    return SessionBusy(session_id, f"another transaction ({message})")
                return SessionBusy(session_id, holder.text, by_worker=holder.by_worker)
            return RefusedByStore(f"PostgreSQL refused it (SQLSTATE {state}): {message}")
        if isinstance(op, SaveOp):
            seq, encoded = extra
            ref = self.ref(op.checkpoint.session_id, op.checkpoint.version)
            if code == _LAPSED:
                return SaveResult.lapse(ref, op.checkpoint, seq)
            return SaveResult.of(ref, op.checkpoint, seq, encoded, applied=code == _APPLIED)
        return code == _APPLIED

    def _apply_all(self, params: list[_Args], lock_timeout_ms: int) -> _Codes:
        """Apply ``params`` in one statement (one round trip, its own transaction, one
        commit), each call seeing the ones before it; wait for a standby to flush it with
        durability ``replicated``.

        A statement that met a held row or the database's refusal of one item (each
        ``Kind.BUSY`` or ``Kind.ITEM``) runs again item by item (``apply_each``): the others
        apply, and the codes name the held and refused ones (the holders of held rows in
        ``holders``, by session id).
        """
        action = "apply" if len(params) == 1 else f"apply a group of {len(params)}"
        with self._connection(action, write=True) as conn:
            try:
                rows = conn.execute(self._group_sql, self._arrays(params, lock_timeout_ms))
                codes = _Codes(int(row[0]) for row in rows.fetchall())
            except psycopg.Error as exc:
                if classify(exc) not in (Kind.BUSY, Kind.ITEM) or not _reusable(conn, exc):
                    raise
                codes = self._apply_each(conn, params, exc)
            busy = [params[i][1] for i, code in enumerate(codes) if _is_busy(code)]
            if busy:
                codes.holders = self._holders(conn, busy)
            if self.durability == postgres_replication.REPLICATED:
                self._wait_replicated(conn, action)
        return codes

    def _arrays(self, params: list[_Args], lock_timeout_ms: int) -> tuple[Any, ...]:
        columns = [list(column) for column in zip(*params, strict=True)]
        ttl, margin = params[0][-2], params[0][-1]
        return (lock_timeout_ms, ttl, margin, *columns[:-2])

    def _apply_each(self, conn: Any, params: list[_Args], exc: psycopg.Error) -> _Codes:
        """The group again, each item on its own (``apply_each``); for one item, ``exc``
        says what it came to."""
        if len(params) == 1:
            state = exc.sqlstate or ""
            number = _BUSY if classify(exc) is Kind.BUSY else _REFUSED
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else state
            return _Codes([(number, state, message)])
        rows = conn.execute(self._each_sql, self._arrays(params, ITEM_LOCK_TIMEOUT_MS))
        return _Codes(
            int(code) if code < _BUSY else (int(code), str(state), str(message))
            for code, state, message in rows.fetchall()
        )

    def _holders(self, conn: Any, session_ids: list[bytes]) -> dict[bytes, _Holder]:
        """Who holds each of these sessions' rows, as far as this role may see: the
        transaction whose id locks the row (its ``xmax``), in ``pg_stat_activity``."""
        rows = conn.execute(
            "SELECT t.session_id, a.pid, a.usename, a.application_name, a.state, "
            "extract(epoch FROM clock_timestamp() - a.xact_start), left(a.query, 160) "
            f"FROM {self.schema}.sessions AS t "
            "JOIN pg_stat_activity AS a ON a.backend_xid = t.xmax "
            "WHERE t.session_key = ANY(%s)",
            ([_key(sid) for sid in session_ids],),
        ).fetchall()
        found: dict[bytes, _Holder] = {}
        for sid, pid, user, application, state, seconds, query in rows:
            since = "" if seconds is None else f" for {float(seconds):.0f}s"
            where = f", application {application!r}" if application else ""
            query_text = " ".join(str(query or "").split())
            text = f"pid {pid} (user {user}{where}, {state}{since}: {query_text})"
            found[bytes(sid)] = _Holder(text, application == APPLICATION_NAME)
        hidden = _Holder(
            "another transaction (its pid and query are hidden from this role: GRANT "
            "pg_read_all_stats to name it)"
        )
        return {sid: found.get(sid, hidden) for sid in session_ids}

    def _wait_replicated(self, conn: Any, action: str) -> None:
        """Return once a standby flushed what this connection committed (or there is no
        standby); else raise, the writes applied but not durable yet."""
        recent = time.monotonic() - self._unreplicated_at < REFUSAL_MEMORY_SECONDS
        timeout = (
            min(_REPLICATION_RETRY, self.replication_timeout)
            if recent
            else (self.replication_timeout)
        )
        why = self._replication.wait(conn, timeout)
        if why is None:
            self._unreplicated_at = -REFUSAL_MEMORY_SECONDS
            return
        self._unreplicated_at = time.monotonic()
        # A refusal for the worker's gate; not remembered as one (``write_refusal``): the
        # probe judges the standbys itself, and a standby back must resume the worker.
        refused = f"not durable yet (CHECKPOINTQ_PG_DURABILITY=replicated): {why}"
        error = NotDurableYet(f"{action}: PostgreSQL applied it, {refused}")
        error.refusal = refused
        raise error

    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
        result = self.apply_batch([SaveOp(checkpoint, seq, request_id)])[0]
        if isinstance(result, (InvalidInput, SessionBusy)):
            raise result
        assert isinstance(result, SaveResult)
        return result

    def delete(self, session_id: str, seq: int | None = None, request_id: str = "") -> bool:
        result = self.apply_batch([DeleteOp(session_id, seq, request_id)])[0]
        if isinstance(result, (InvalidInput, SessionBusy)):
            raise result
        return bool(result)

    def lapse(self, session_id: str, seq: int, request_id: str = "") -> bool:
        result = self.apply_batch([LapseOp(session_id, seq, request_id)])[0]
        if isinstance(result, (InvalidInput, SessionBusy)):
            raise result
        return bool(result)

    def refresh(self, session_id: str) -> bool:
        self.check_session_id(session_id)
        s, now = self.schema, self._now
        with self._connection("refresh", write=True) as conn:
            row = conn.execute(
                f"UPDATE {s}.sessions SET value_deadline_ms = {now} + %(ttl)s, "
                f"fence_expires_ms = greatest(fence_expires_ms, {now} + %(ttl)s "
                "+ %(margin)s), updated_at = clock_timestamp() "
                f"WHERE session_key = %(key)s AND value IS NOT NULL "
                f"AND value_deadline_ms > {now} RETURNING true",
                {"key": session_key(session_id), "ttl": self.ttl_ms, "margin": self.tombstone_ms},
            ).fetchone()
        return row is not None

    # -- reads --------------------------------------------------------------------------

    def _read_once_more(self, read: Callable[[], _T]) -> _T:
        """``read()``, and once more on a new connection if it lost this thread's (a
        failover, ``pg_terminate_backend``, an idle timeout since): a read is idempotent, and
        the first call after a failover should not fail for the old primary's sake."""
        earlier = getattr(self._local, "conn", None) is not None
        try:
            return read()
        except StoreUnavailable as exc:
            if not earlier or exc.refusal or getattr(self._local, "conn", None) is not None:
                raise
            return read()

    def _read(self, session_id: str) -> tuple[Any, ...]:
        self.check_session_id(session_id)

        def read() -> tuple[Any, ...]:
            with self._connection("load") as conn:
                row = conn.execute(self._read_sql, (session_key(session_id),)).fetchone()
            assert row is not None
            return tuple(row)

        return self._read_once_more(read)

    @staticmethod
    def _fence_of(row: Sequence[Any]) -> Fence | None:
        now, value, deadline, seq, deleted, request_id, lapsed, expires = row
        if seq is None or expires <= now:
            return None
        live = not deleted and value is not None and deadline is not None and deadline > now
        return Fence(int(seq), bool(deleted), _text(request_id), live, bool(lapsed))

    def load_at(self, session_id: str) -> tuple[Checkpoint | None, Fence | None, int]:
        row = self._read(session_id)
        now, value, deadline = row[0], row[1], row[2]
        fence = self._fence_of(row)
        if value is None or deadline is None or deadline <= now:
            return None, fence, int(now)
        return self.decode_value(session_id, bytes(value)), fence, int(now)

    def load_with_fence(self, session_id: str) -> tuple[Checkpoint | None, Fence | None]:
        checkpoint, fence, _ = self.load_at(session_id)
        return checkpoint, fence

    def load(self, session_id: str) -> Checkpoint | None:
        return self.load_at(session_id)[0]

    def fence(self, session_id: str) -> Fence | None:
        return self._fence_of(self._read(session_id))

    def fences(self, session_ids: Sequence[str]) -> list[Fence | None]:
        for session_id in session_ids:
            self.check_session_id(session_id)
        if not session_ids:
            return []
        s = self.schema

        def read() -> list[Any]:
            with self._connection("read fences") as conn:
                return conn.execute(
                    f"SELECT {self._now}, t.session_id, NULL::bytea, t.value_deadline_ms, "
                    "t.fence_seq, t.fence_deleted, t.fence_request_id, t.fence_lapsed, "
                    f"t.fence_expires_ms, t.value IS NOT NULL FROM {s}.sessions AS t "
                    "WHERE t.session_key = ANY(%s)",
                    ([session_key(i) for i in session_ids],),
                ).fetchall()

        rows = self._read_once_more(read)
        found: dict[bytes, Fence | None] = {}
        for row in rows:
            now, sid, _, deadline, seq, deleted, rid, lapsed, expires, has_value = row
            value = b"" if has_value else None
            found[bytes(sid)] = self._fence_of(
                (now, value, deadline, seq, deleted, rid, lapsed, expires)
            )
        return [found.get(_sid(i)) for i in session_ids]

    def list_page(self, cursor: str | None = None, count: int = 1000) -> Page:
        try:
            after = bytes.fromhex(cursor) if cursor else b""
        except ValueError:
            raise InvalidInput(f"not a cursor this store returned: {cursor!r}") from None
        s = self.schema

        def read() -> list[Any]:
            with self._connection("list sessions") as conn:
                # By key, which the primary key orders (the ids' order would need an index
                # on the ids, which a long one does not fit).
                return conn.execute(
                    f"SELECT session_key, session_id FROM {s}.sessions WHERE session_key > %s "
                    f"AND value IS NOT NULL AND value_deadline_ms > {self._now} "
                    "ORDER BY session_key LIMIT %s",
                    (after, count + 1),
                ).fetchall()

        rows = self._read_once_more(read)
        page = rows[:count]
        next_cursor = bytes(page[-1][0]).hex() if len(rows) > count else None
        return Page([bytes(row[1]).decode("utf-8") for row in page], next_cursor)

    def count_sessions(self, now: float | None = None) -> SessionCounts:
        s = self.schema
        at = self._now if now is None else "%(now)s"
        with self._connection("count sessions") as conn:
            row = conn.execute(
                f"SELECT count(*) FILTER (WHERE value_deadline_ms > {at}), "
                f"count(*) FILTER (WHERE value_deadline_ms <= {at}) "
                f"FROM {s}.sessions WHERE value IS NOT NULL",
                {"now": None if now is None else int(now * 1000)},
            ).fetchone()
        assert row is not None
        return SessionCounts(int(row[0]), int(row[1]))

    # -- upkeep -------------------------------------------------------------------------

    def expire_stale(self, now: float | None = None, limit: int = 1000) -> list[str]:
        """Remove up to ``limit`` values past their deadline (their fences stay until
        they may be forgotten), and forget up to ``limit`` fences past their own lifetime.
        Both walk partial indexes from their oldest entry: a sweep with nothing due reads
        an index page or two, whatever the number of sessions."""
        s = self.schema
        at = self._now if now is None else "%(now)s"
        with self._connection("expire stale sessions", write=True) as conn:
            rows = conn.execute(
                f"WITH forgotten AS ("
                f" DELETE FROM {s}.sessions WHERE session_key IN ("
                f"  SELECT session_key FROM {s}.sessions WHERE value IS NULL"
                f"  AND fence_expires_ms <= {at} ORDER BY fence_expires_ms LIMIT %(limit)s"
                "  FOR UPDATE SKIP LOCKED)"
                f" AND value IS NULL AND fence_expires_ms <= {at}),"
                " due AS ("
                f" SELECT session_key, value_deadline_ms FROM {s}.sessions"
                f" WHERE value IS NOT NULL AND value_deadline_ms <= {at}"
                "  ORDER BY value_deadline_ms LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
                f" UPDATE {s}.sessions AS t SET value = NULL, value_deadline_ms = NULL,"
                " version = NULL, last_run_ref = NULL, metadata = NULL,"
                " updated_at = clock_timestamp()"
                " FROM due WHERE t.session_key = due.session_key"
                " RETURNING t.session_id, due.value_deadline_ms",
                {"now": None if now is None else int(now * 1000), "limit": limit},
            ).fetchall()
        rows.sort(key=lambda row: (row[1], bytes(row[0])))
        return [bytes(row[0]).decode("utf-8") for row in rows]

    def ping(self) -> None:
        """Raise StoreUnavailable unless the database answers."""
        with self._connection("ping") as conn:
            conn.execute("SELECT 1")

    def identity(self) -> str | None:
        """A row of ``{schema}.store_identity``, created with its table by the first user
        that may create tables in the schema (as auto-upgrade needs), under an advisory lock
        so that two first users agree. None for a role that may not read it, or create it
        when it is not there yet: nothing to compare, rather than a failed request."""
        try:
            return self._identity()
        except StoreUnavailable as exc:
            if isinstance(exc.__cause__, psycopg.errors.InsufficientPrivilege):
                return None
            raise

    def _identity(self) -> str:
        s = self.schema
        with self._connection("read the store's identity") as conn:
            exists = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (f"{s}.store_identity",)
            ).fetchone()
            if not (exists and exists[0]):
                with conn.transaction():
                    lock = f"checkpointq-identity:{s}"
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (lock,))
                    conn.execute(
                        f"CREATE TABLE IF NOT EXISTS {s}.store_identity (id text NOT NULL, "
                        "one boolean PRIMARY KEY DEFAULT true CHECK (one))"
                    )
                    conn.execute(
                        f"INSERT INTO {s}.store_identity (id) VALUES (%s) "
                        "ON CONFLICT (one) DO NOTHING",
                        (new_identity(),),
                    )
            row = conn.execute(f"SELECT id FROM {s}.store_identity").fetchone()
        if row is None:
            raise StoreUnavailable(f"read the store's identity: {s}.store_identity is empty")
        return str(row[0])

    def _probe_write(self) -> str | None:
        """Write the probe row; why the database cannot take this code's writes even so
        (a schema version it does not speak; with ``replicated``, no standby to flush
        them), or None."""
        s = self.schema
        with self._connection("probe write") as conn:
            row = conn.execute(
                f"WITH probe AS (INSERT INTO {s}.write_probe VALUES (1, clock_timestamp()) "
                "ON CONFLICT (id) DO UPDATE SET written_at = excluded.written_at RETURNING 1) "
                f"SELECT (SELECT max(version) FROM {s}.schema_version) FROM probe"
            ).fetchone()
            found = int(row[0] or 0) if row else 0
            if found != postgres_schema.SCHEMA_VERSION:
                # A rolling upgrade moved it: the next connection checks it (and upgrades
                # an older one when allowed); meanwhile writes wait.
                self._schema_checked = False
                self._forget(conn)
                return (
                    postgres_schema.mismatch(found, s, auto_upgrade=self.auto_upgrade)
                    or f"schema {s} is at version {found}: upgraded on the next connection"
                )
            if self.durability == postgres_replication.REPLICATED:
                return postgres_replication.standby_refusal(conn)
        return None

    def write_refusal(self) -> str | None:
        """None when the database took a probe write (and no real write was refused in
        the last minute); else why not.

        A probe whose session the server ended (``pg_terminate_backend``, an idle timeout,
        a restart since), that lost its new session before it answered, or that fails on a
        connection made earlier, tries again on a new one, up to ``_PROBE_ATTEMPTS`` times:
        an ended session says nothing of whether the database takes writes now, and a
        stopping server refuses the next connection."""
        try:
            why = self._probe_until_answered()
        except postgres_schema.SchemaMismatch as exc:
            return str(exc)
        except StoreUnavailable as exc:
            cause = exc.__cause__
            return describe(cause) if cause is not None else str(exc)
        if why is not None:
            return why
        refused = self._refused
        if refused is not None and time.monotonic() - refused[0] < REFUSAL_MEMORY_SECONDS:
            return f"{refused[1]} (a write was refused {time.monotonic() - refused[0]:.0f}s ago)"
        return None

    def _probe_until_answered(self) -> str | None:
        for attempt in range(1, _PROBE_ATTEMPTS + 1):
            earlier = getattr(self._local, "conn", None) is not None
            sessions = getattr(self._local, "sessions", 0)
            try:
                return self._probe_write()
            except postgres_schema.SchemaMismatch:
                raise
            except StoreUnavailable as exc:
                lost = getattr(self._local, "conn", None) is None
                ended = exc.__cause__ is not None and sqlstate(exc.__cause__) == TERMINATED
                # (a session made for this attempt and lost before it answered: ended by
                # the server, its message lost with the socket, "server closed the
                # connection unexpectedly"; only a refused connection judges the server)
                made = getattr(self._local, "sessions", 0) != sessions
                if attempt == _PROBE_ATTEMPTS or not lost or not (earlier or ended or made):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def request_outcome(self, session_id: str, request_id: str) -> tuple[Fence | None, None]:
        """The session's fence; with ``replicated``, only once a standby has flushed it (a
        producer's ``wait_durable`` reports a request durable by it), else None for now."""
        fence = self.fence(session_id)
        if fence is None or self.durability != postgres_replication.REPLICATED:
            return fence, None
        with self._connection("read an outcome") as conn:
            why = self._replication.wait(conn, _OUTCOME_REPLICATION_WAIT)
        return (fence if why is None else None), None


@dataclass(frozen=True, slots=True)
class _Holder:
    """Who holds a session's row: in words, and whether it is one of our workers."""

    text: str
    by_worker: bool = False


class _Codes(list[_Code]):
    """``_apply_all``'s codes, with who holds each held session's row."""

    holders: dict[bytes, _Holder]

    def __init__(self, codes: Any = ()) -> None:
        super().__init__(codes)
        self.holders = {}


def _is_busy(code: _Code) -> bool:
    return isinstance(code, tuple) and code[0] == _BUSY


def validate_seq_or_raise(store: CheckpointStore, seq: int) -> int:
    """A lapse's ``seq``, checked as every store checks one."""
    return store.resolve_seq(seq)
