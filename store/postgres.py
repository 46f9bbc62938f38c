"""A checkpoint store in PostgreSQL: the durable system of record behind the queue.

One row per session holds the value (the Go store's bytes) and the fence; every write is
one call of ``{schema}.apply`` (``store/sql/v1.sql``), which fences it by its order key in
one statement, judging deadlines by the database's clock. ``apply_batch`` sends a whole
group as one statement calling it over arrays: one round trip and one commit (one WAL
flush) for the group, which is what makes a write-behind worker faster than a loop of
upserts.

Connections are one per thread, made on first use and made again after a failure; none is
carried across a fork. Every failure of the database reaches callers as
``StoreUnavailable`` (retry later), and ``write_refusal`` says in plain words when the
database refuses writes (down, a read-only standby, out of connections, disk full), so the
worker waits with its messages on the broker instead of dead-lettering them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import orjson
import psycopg

from checkpointq.store import postgres_schema
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
)
from checkpointq.store.errors import InvalidInput, StoreNotConfigured, StoreUnavailable
from checkpointq.store.model import Checkpoint
from checkpointq.store.urls import redact_url, redact_urls

logger = logging.getLogger(__name__)

#: Seconds to wait for a connection before the store is called unavailable.
CONNECT_TIMEOUT = 5

#: SQLSTATE codes (and classes) that mean "the database refuses writes now", in plain words.
_REFUSALS = {
    "25006": "read-only (a standby, not the primary)",
    "53100": "disk full",
    "53200": "out of memory",
    "53300": "too many connections",
    "57P01": "shutting down (admin shutdown)",
    "57P02": "restarting after a crash",
    "57P03": "not accepting connections (starting up, recovering or shutting down)",
    "57014": "statement cancelled (statement_timeout)",
}

#: A session the server ended: ``pg_terminate_backend`` as well as a shutdown. No refusal
#: to remember or to report beyond the call: the next call connects again, and a stopping
#: server is what the worker's own probe sees.
_TERMINATED = "57P01"

#: How long a refused write keeps ``write_refusal`` answering after a probe write went
#: through (a full disk refuses a table's growth while a one-row probe still fits).
REFUSAL_MEMORY_SECONDS = 60.0

_SAVE, _DELETE, _LAPSE = "s", "d", "l"

#: The arguments of one ``{schema}.apply`` call.
_Args = tuple[Any, ...]
_APPLIED, _LAPSED = 1, 2


class PostgresSettings(Protocol):
    """What ``PostgresStore.from_settings`` reads (``checkpointq.worker.settings.Settings``)."""

    pg_schema: str
    pg_auto_upgrade: bool

    @property
    def resolved_store_url(self) -> str | None: ...

    def store_options(self) -> StoreOptions: ...


#: What the server says when it refuses a new connection: libpq reports no SQLSTATE for a
#: connection that failed, so psycopg's error has none, only the server's words.
_CONNECT_REFUSALS = (
    ("too many clients already", "53300"),
    ("remaining connection slots are reserved", "53300"),
    ("the database system is shutting down", "57P03"),
    ("the database system is starting up", "57P03"),
    ("the database system is in recovery mode", "57P03"),
    ("the database system is not yet accepting connections", "57P03"),
)


def _sqlstate(exc: BaseException) -> str | None:
    code: str | None = getattr(exc, "sqlstate", None)
    if code is None and isinstance(exc, psycopg.OperationalError):
        text = str(exc)
        code = next((c for words, c in _CONNECT_REFUSALS if words in text), None)
    return code


def describe(exc: BaseException) -> str:
    """Why a database call failed, in one line an operator can act on (no password)."""
    text = redact_urls(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    code = _sqlstate(exc)
    if code in _REFUSALS:
        return f"{_REFUSALS[code]}: {text}"
    if (code and code.startswith("08")) or isinstance(exc, psycopg.OperationalError):
        return f"unreachable ({type(exc).__name__}: {text})"
    return f"{type(exc).__name__}: {text}"


def _refusal(exc: BaseException) -> str | None:
    """Why the database refuses writes, when ``exc`` says it does; None for anything else
    (unreachable, a session it ended)."""
    code = _sqlstate(exc)
    return describe(exc) if code in _REFUSALS and code != _TERMINATED else None


def _reusable(conn: psycopg.Connection[Any]) -> bool:
    """Whether a connection a call just failed on may serve the next one: open, and idle. A
    call cut short can leave a command in progress on it (every later call then fails with
    "another command is already in progress") or a transaction open: such a connection is
    closed, and the next call makes a new one."""
    if conn.broken or conn.closed:
        return False
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def _sid(session_id: str) -> bytes:
    return session_id.encode("utf-8")


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
    ) -> None:
        super().__init__(options)
        self.url = url
        self.schema = postgres_schema.check_schema_name(schema)
        self.auto_upgrade = auto_upgrade
        self.connect_timeout = max(1, round(connect_timeout))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[psycopg.Connection[Any]] = []
        self._schema_checked = False
        self._closed = False
        #: The last write the database refused, and when (``write_refusal``).
        self._refused: tuple[float, str] | None = None
        s = self.schema
        # Parameters go in binary (%b): a value in text would be sent as hex and parsed back,
        # which cost a 32-save group more than its round trip and its commit together.
        self._apply_sql = f'SELECT {s}.apply(%b::"char", %b, %b, %b, %b, %b, %b, %b::jsonb, %b, %b)'
        #: The database's clock, read once per statement: ``now_ms()`` is volatile, so
        #: compared as it is it would be called per row and keep an index from bounding
        #: the scan (a sweep with nothing due would read every row: docs/performance.md).
        self._now = f"(SELECT {s}.now_ms())"
        self._apply_many_sql = (
            f'SELECT {s}.apply(u.op::"char", u.sid, u.seq, u.rid, u.value, u.version, u.ref, '
            "u.meta, %b, %b) FROM unnest(%b::text[], %b::bytea[], %b::bigint[], %b::bytea[], "
            "%b::bytea[], %b::bigint[], %b::text[], %b::jsonb[]) WITH ORDINALITY "
            "AS u(op, sid, seq, rid, value, version, ref, meta, n) ORDER BY u.n"
        )
        self._read_sql = (
            f"SELECT {s}.now_ms(), t.value, t.value_deadline_ms, t.fence_seq, "
            "t.fence_deleted, t.fence_request_id, t.fence_lapsed, t.fence_expires_ms "
            f"FROM (SELECT 1) AS one LEFT JOIN {s}.sessions AS t ON t.session_id = %s"
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
        )

    def __repr__(self) -> str:
        return f"PostgresStore({redact_url(self.url)}, schema={self.schema})"

    # -- connections --------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=self.connect_timeout,
            application_name="checkpointq",
        )
        if not self._schema_checked:
            try:
                postgres_schema.check(conn, self.schema, auto_upgrade=self.auto_upgrade)
            except BaseException:
                conn.close()
                raise
            self._schema_checked = True
        with self._lock:
            self._connections.append(conn)
        return conn

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
                conn = self._connect()
                self._local.conn, self._local.pid = conn, os.getpid()
            yield conn
        except BaseException as exc:
            if conn is not None and not _reusable(conn):
                self._forget(conn)
            if not isinstance(exc, psycopg.Error):
                raise
            error = StoreUnavailable(f"{action}: PostgreSQL {describe(exc)}")
            error.refusal = _refusal(exc)
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
        metadata = orjson.dumps(checkpoint.metadata.model_dump(mode="json", by_alias=True))
        if b"\\u0000" in metadata:  # jsonb holds no NUL; the value keeps it, the copy cannot
            metadata = metadata.replace(b"\\u0000", b"")
        args = self._args(
            _SAVE,
            checkpoint.session_id,
            seq,
            op.request_id,
            value=encoded.value,
            version=checkpoint.version,
            last_run_ref=checkpoint.last_run_ref.replace("\x00", ""),
            metadata=metadata.decode(),
        )
        return args, (seq, encoded)

    def apply_batch(self, ops: Sequence[BatchOp]) -> list[BatchResult]:
        """Every item in one statement, so one transaction (one round trip, one commit).

        Items are sent ordered by session id (each session's own in their order), so that
        two workers' groups lock rows in the same order and never deadlock.

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
        if sent:
            sent.sort(key=lambda item: item[0])  # stable: a session's items keep their order
            codes = self._apply_all([args for _, _, args, _ in sent])
            for (_, index, _, extra), code in zip(sent, codes, strict=True):
                op = ops[index]
                if isinstance(op, SaveOp):
                    seq, encoded = extra
                    ref = self.ref(op.checkpoint.session_id, op.checkpoint.version)
                    if code == _LAPSED:
                        results[index] = SaveResult.lapse(ref, op.checkpoint, seq)
                    else:
                        results[index] = SaveResult.of(
                            ref, op.checkpoint, seq, encoded, applied=code == _APPLIED
                        )
                else:
                    results[index] = code == _APPLIED
        return [result for result in results if result is not None]

    def _apply_all(self, params: list[_Args]) -> list[int]:
        action = "apply" if len(params) == 1 else f"apply a group of {len(params)}"
        with self._connection(action, write=True) as conn:
            if len(params) == 1:
                row = conn.execute(self._apply_sql, params[0]).fetchone()
                return [int(row[0])] if row else [0]
            # One statement (one round trip, its own transaction, one commit): the calls
            # run in the arrays' order, each seeing the ones before it.
            columns = [list(column) for column in zip(*params, strict=True)]
            ttl, margin = params[0][-2], params[0][-1]
            rows = conn.execute(self._apply_many_sql, (ttl, margin, *columns[:-2])).fetchall()
            return [int(row[0]) for row in rows]

    def save(
        self, checkpoint: Checkpoint, seq: int | None = None, request_id: str = ""
    ) -> SaveResult:
        result = self.apply_batch([SaveOp(checkpoint, seq, request_id)])[0]
        if isinstance(result, InvalidInput):
            raise result
        assert isinstance(result, SaveResult)
        return result

    def delete(self, session_id: str, seq: int | None = None, request_id: str = "") -> bool:
        result = self.apply_batch([DeleteOp(session_id, seq, request_id)])[0]
        if isinstance(result, InvalidInput):
            raise result
        return bool(result)

    def lapse(self, session_id: str, seq: int, request_id: str = "") -> bool:
        result = self.apply_batch([LapseOp(session_id, seq, request_id)])[0]
        if isinstance(result, InvalidInput):
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
                f"WHERE session_id = %(sid)s AND value IS NOT NULL "
                f"AND value_deadline_ms > {now} RETURNING true",
                {"sid": _sid(session_id), "ttl": self.ttl_ms, "margin": self.tombstone_ms},
            ).fetchone()
        return row is not None

    # -- reads --------------------------------------------------------------------------

    def _read(self, session_id: str) -> tuple[Any, ...]:
        self.check_session_id(session_id)
        with self._connection("load") as conn:
            row = conn.execute(self._read_sql, (_sid(session_id),)).fetchone()
        assert row is not None
        return tuple(row)

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
        with self._connection("read fences") as conn:
            rows = conn.execute(
                f"SELECT {self._now}, t.session_id, NULL::bytea, t.value_deadline_ms, "
                "t.fence_seq, t.fence_deleted, t.fence_request_id, t.fence_lapsed, "
                f"t.fence_expires_ms, t.value IS NOT NULL FROM {s}.sessions AS t "
                "WHERE t.session_id = ANY(%s)",
                ([_sid(i) for i in session_ids],),
            ).fetchall()
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
        with self._connection("list sessions") as conn:
            rows = conn.execute(
                f"SELECT session_id FROM {s}.sessions WHERE session_id > %s "
                f"AND value IS NOT NULL AND value_deadline_ms > {self._now} "
                "ORDER BY session_id LIMIT %s",
                (after, count + 1),
            ).fetchall()
        ids = [bytes(row[0]) for row in rows[:count]]
        next_cursor = ids[-1].hex() if len(rows) > count else None
        return Page([i.decode("utf-8") for i in ids], next_cursor)

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
                f" DELETE FROM {s}.sessions WHERE session_id IN ("
                f"  SELECT session_id FROM {s}.sessions WHERE value IS NULL"
                f"  AND fence_expires_ms <= {at} ORDER BY fence_expires_ms LIMIT %(limit)s"
                "  FOR UPDATE SKIP LOCKED)"
                f" AND value IS NULL AND fence_expires_ms <= {at}),"
                " due AS ("
                f" SELECT session_id, value_deadline_ms FROM {s}.sessions"
                f" WHERE value IS NOT NULL AND value_deadline_ms <= {at}"
                "  ORDER BY value_deadline_ms LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
                f" UPDATE {s}.sessions AS t SET value = NULL, value_deadline_ms = NULL,"
                " version = NULL, last_run_ref = NULL, metadata = NULL,"
                " updated_at = clock_timestamp()"
                " FROM due WHERE t.session_id = due.session_id"
                " RETURNING t.session_id, due.value_deadline_ms",
                {"now": None if now is None else int(now * 1000), "limit": limit},
            ).fetchall()
        rows.sort(key=lambda row: (row[1], bytes(row[0])))
        return [bytes(row[0]).decode("utf-8") for row in rows]

    def ping(self) -> None:
        """Raise StoreUnavailable unless the database answers."""
        with self._connection("ping") as conn:
            conn.execute("SELECT 1")

    def _probe_write(self) -> None:
        with self._connection("probe write", write=False) as conn:
            conn.execute(
                f"INSERT INTO {self.schema}.write_probe VALUES (1, clock_timestamp()) "
                "ON CONFLICT (id) DO UPDATE SET written_at = excluded.written_at"
            )

    def write_refusal(self) -> str | None:
        """None when the database took a probe write (and no real write was refused in
        the last minute); else why not.

        A probe that fails on a connection made earlier, losing it, tries once more on a
        new one: a session the server ended (``pg_terminate_backend``, an idle timeout, a
        restart since) says nothing of whether the database takes writes now."""
        try:
            try:
                earlier = getattr(self._local, "conn", None) is not None
                self._probe_write()
            except postgres_schema.SchemaMismatch:
                raise
            except StoreUnavailable:
                if not earlier or getattr(self._local, "conn", None) is not None:
                    raise
                self._probe_write()
        except postgres_schema.SchemaMismatch as exc:
            return str(exc)
        except StoreUnavailable as exc:
            cause = exc.__cause__
            return describe(cause) if cause is not None else str(exc)
        refused = self._refused
        if refused is not None and time.monotonic() - refused[0] < REFUSAL_MEMORY_SECONDS:
            return f"{refused[1]} (a write was refused {time.monotonic() - refused[0]:.0f}s ago)"
        return None


def validate_seq_or_raise(store: CheckpointStore, seq: int) -> int:
    """A lapse's ``seq``, checked as every store checks one."""
    return store.resolve_seq(seq)
