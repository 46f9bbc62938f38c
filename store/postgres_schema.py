"""The PostgreSQL store's schema: versioned, upgraded in place, never guessed at.

Each version is one file, ``store/sql/v<N>.sql``, applied once in its own transaction under
an advisory lock, so that two workers starting together upgrade once and a failed upgrade
leaves the previous version whole. ``{schema}.schema_version`` records what was applied.
``checkpointq db upgrade`` runs ``upgrade``; a store that finds its schema missing or older
runs it too unless told not to (``auto_upgrade``), and refuses a schema newer than it knows.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

from checkpointq.store.errors import StoreUnavailable

#: The schema version this code reads and writes.
SCHEMA_VERSION = 2

#: The default PostgreSQL schema (namespace) the tables live in.
DEFAULT_SCHEMA = "checkpointq"

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")


class SchemaMismatch(StoreUnavailable):
    """The database's schema is not the one this code speaks: missing (and not to be
    created), or newer than this code. A kind of ``StoreUnavailable``, and a refusal:
    requests wait in the broker (workers pause) until an operator upgrades one side, rather
    than be dead-lettered for a deployment's mistake."""

    def __init__(self, message: str, *, newer: bool = False) -> None:
        super().__init__(message)
        self.refusal = message
        #: The database holds a newer version: it may still serve reads (a rolling upgrade).
        self.newer = newer


def mismatch(found: int, schema: str, *, auto_upgrade: bool) -> str | None:
    """Why schema version ``found`` is not one this code writes to; None when it is (or
    when it is older and this code may upgrade it)."""
    if found == SCHEMA_VERSION or (found < SCHEMA_VERSION and auto_upgrade):
        return None
    if found > SCHEMA_VERSION:
        return (
            f"schema {schema} is at version {found}, newer than this checkpointq "
            f"({SCHEMA_VERSION}): upgrade checkpointq, or point it at another schema"
        )
    what = "missing" if found == 0 else f"at version {found}"
    return (
        f"schema {schema} is {what}; this checkpointq needs version {SCHEMA_VERSION}: "
        "run `checkpointq db upgrade`"
    )


def check_schema_name(name: str) -> str:
    """``name`` if it is a plain lower-case SQL identifier (it is spliced into statements)."""
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(
            f"schema {name!r} must be a lower-case SQL identifier: letters, digits and _ "
            "(at most 63, not starting with a digit)"
        )
    return name


@cache
def _source(version: int) -> str:
    return resources.files("checkpointq.store.sql").joinpath(f"v{version}.sql").read_text("utf-8")


def migration(version: int, schema: str) -> str:
    """The SQL that brings ``schema`` from ``version - 1`` to ``version``."""
    return _source(version).replace("{schema}", check_schema_name(schema))


def current_version(conn: Any, schema: str) -> int:
    """The schema version applied in the database; 0 when there is none yet."""
    check_schema_name(schema)
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.schema_version",)
    ).fetchone()
    if not row or not row[0]:
        return 0
    found = conn.execute(f"SELECT max(version) FROM {schema}.schema_version").fetchone()
    return int(found[0]) if found and found[0] is not None else 0


def upgrade(conn: Any, schema: str = DEFAULT_SCHEMA) -> list[int]:
    """Bring ``schema`` to ``SCHEMA_VERSION``; the versions applied (none when current).

    ``conn``: a psycopg connection in autocommit mode (each version commits on its own).

    Raises:
        SchemaMismatch: the database holds a newer version than this code knows.
    """
    check_schema_name(schema)
    applied: list[int] = []
    with conn.transaction():
        # One upgrader at a time per schema; the lock goes with the transaction.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"checkpointq:{schema}",))
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {schema}.schema_version ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        found = current_version(conn, schema)
        if found > SCHEMA_VERSION:
            raise SchemaMismatch(str(mismatch(found, schema, auto_upgrade=False)))
        for version in range(found + 1, SCHEMA_VERSION + 1):
            conn.execute(migration(version, schema))
            conn.execute(f"INSERT INTO {schema}.schema_version (version) VALUES (%s)", (version,))
            applied.append(version)
    return applied


def check(conn: Any, schema: str, *, auto_upgrade: bool) -> None:
    """Make sure ``schema`` is the version this code speaks, upgrading it if allowed.

    Raises:
        SchemaMismatch: missing or older with ``auto_upgrade`` off, or newer than this code.
    """
    found = current_version(conn, schema)
    if found == SCHEMA_VERSION:
        return
    why = mismatch(found, schema, auto_upgrade=auto_upgrade)
    if why is not None:
        raise SchemaMismatch(why, newer=found > SCHEMA_VERSION)
    upgrade(conn, schema)
