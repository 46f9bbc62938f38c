"""What a PostgreSQL error means for a request, by its SQLSTATE: the one place that decides.

* ``OUTAGE``: unreachable, the session ended, a deadlock, anything not named below: retried;
  the worker's probe decides whether to pause.
* ``REFUSAL``: the database refuses writes now (read-only 25006, class 53 out of resources,
  a starting or stopping server, classes 58 and XX, no grant 42501): the worker pauses and
  requests wait in the broker.
* ``BUSY``: the statement waited too long, on a row lock another client holds (55P03) or at
  all (57014): only the sessions it names wait, never a refusal.
* ``ITEM``: the database refuses this request's data (classes 22, 23, 54): dead-lettered with
  its words, never retried.
* ``SCHEMA``: the schema is not the one this code speaks (42883, 42P01, 42703, 3F000, ...): a
  rolling upgrade moved it; the worker pauses, dead-letters nothing, checks it again.

``reusable_after`` says whether the connection an error came on may serve the next call:
only after an error a statement raised and the server ended cleanly. Behind PgBouncer in
transaction mode a prepared statement can vanish (26000) or a message arrive cut (08P01):
such a connection is closed, never reused.
"""

from __future__ import annotations

import enum

import psycopg

from checkpointq.store.urls import redact_urls


class Kind(enum.Enum):
    """What an error means for the request that met it (see the module docstring)."""

    OUTAGE = "outage"
    REFUSAL = "refusal"
    BUSY = "busy"
    ITEM = "item"
    SCHEMA = "schema"


#: SQLSTATE codes that mean "the database refuses writes now", in plain words.
REFUSALS = {
    "25006": "read-only (a standby, not the primary)",
    "42501": "permission denied (the role lacks a grant: docs/operations.md#postgresql)",
    "53000": "out of resources",
    "53100": "disk full",
    "53200": "out of memory",
    "53300": "too many connections",
    "53400": "a configured limit was exceeded",
    "57P02": "restarting after a crash",
    "57P03": "not accepting connections (starting up, recovering or shutting down)",
}

#: Refusals by SQLSTATE class, for the codes not named above.
_REFUSAL_CLASSES = {"53": "out of resources", "58": "system error", "XX": "internal error"}

#: A session the server ended: ``pg_terminate_backend`` as well as a shutdown. No refusal to
#: report: the next call connects again, and a stopping server is what the probe sees.
TERMINATED = "57P01"

_BUSY = {
    "55P03": "waits on a lock (lock_timeout)",
    "57014": "statement cancelled (statement_timeout)",
}
_ITEM_CLASSES = frozenset({"22", "23", "54"})
_SCHEMA = frozenset({"42883", "42P01", "42703", "3F000", "42804", "42725", "42P13"})

#: Classes of errors a statement raised and ended cleanly: the session is as before.
_STATEMENT_CLASSES = frozenset({"22", "23", "25", "3F", "40", "42", "53", "54", "55", "P0"})
#: Codes of those classes that say the session's state is not what the client believes.
_SESSION_STATE = frozenset({"42P05", "25P02", "25001"})

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


def sqlstate(exc: BaseException) -> str | None:
    """The error's SQLSTATE, or the one its words stand for when libpq gave none."""
    code: str | None = getattr(exc, "sqlstate", None)
    if code is None and isinstance(exc, psycopg.OperationalError):
        text = str(exc)
        code = next((c for words, c in _CONNECT_REFUSALS if words in text), None)
    return code


def classify(exc: BaseException) -> Kind:
    """The kind of a database error (the module docstring)."""
    code = sqlstate(exc)
    if code is None or code == TERMINATED:
        return Kind.OUTAGE
    if code in _BUSY:
        return Kind.BUSY
    if code in _SCHEMA:
        return Kind.SCHEMA
    if code in REFUSALS or code[:2] in _REFUSAL_CLASSES:
        return Kind.REFUSAL
    if code[:2] in _ITEM_CLASSES:
        return Kind.ITEM
    return Kind.OUTAGE


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return redact_urls(text.splitlines()[0] if text else "")


def describe(exc: BaseException) -> str:
    """Why a database call failed, in one line an operator can act on (no password)."""
    text = _first_line(exc)
    code = sqlstate(exc)
    if code in REFUSALS:
        return f"{REFUSALS[code]}: {text}"
    if code in _BUSY:
        return f"{_BUSY[code]}: {text}"
    if code is not None and code[:2] in _REFUSAL_CLASSES:
        return f"{_REFUSAL_CLASSES[code[:2]]} (SQLSTATE {code}): {text}"
    if code in _SCHEMA:
        return f"the schema changed under this worker (SQLSTATE {code}): {text}"
    if (code and code.startswith("08")) or isinstance(exc, psycopg.OperationalError):
        return f"unreachable ({type(exc).__name__}: {text})"
    return f"{type(exc).__name__}: {text}"


def refusal(exc: BaseException) -> str | None:
    """Why the database refuses writes, when ``exc`` says it does (a refusal, or a schema
    this code does not speak); None for anything else."""
    return describe(exc) if classify(exc) in (Kind.REFUSAL, Kind.SCHEMA) else None


def reusable_after(exc: BaseException) -> bool:
    """Whether a connection may serve another call after ``exc`` (its state aside: see
    ``PostgresStore``): only after an error a statement raised and the server ended."""
    code = sqlstate(exc)
    if code is None or code in _SESSION_STATE:
        return False
    return code[:2] in _STATEMENT_CLASSES or code == "57014"
