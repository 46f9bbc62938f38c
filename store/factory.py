"""From a deployment's settings to its checkpoint store: the one place that picks a kind.

A ``postgresql://`` store URL gives a ``PostgresStore`` (imported only then: psycopg is the
``checkpointq[postgres]`` extra); any other, a ``RedisStore``.
"""

from __future__ import annotations

from typing import Protocol

from checkpointq.store.base import CheckpointStore, StoreOptions
from checkpointq.store.errors import StoreNotConfigured
from checkpointq.store.redis import RedisStore
from checkpointq.store.urls import is_postgres_url


class PostgresSettings(Protocol):
    """What a PostgreSQL store reads (``PostgresStore.from_settings``), read-only."""

    @property
    def pg_schema(self) -> str: ...
    @property
    def pg_auto_upgrade(self) -> bool: ...
    @property
    def pg_prepared_statements(self) -> bool: ...
    @property
    def pg_lock_timeout_ms(self) -> int: ...
    @property
    def pg_durability(self) -> str: ...
    @property
    def pg_replication_timeout_seconds(self) -> float: ...
    @property
    def resolved_store_url(self) -> str | None: ...

    def store_options(self) -> StoreOptions: ...


class StoreSettings(PostgresSettings, Protocol):
    """What ``store_from_settings`` reads (``checkpointq.worker.settings.Settings``)."""

    key_prefix: str


class MissingExtra(StoreNotConfigured):
    """The store URL names a kind of store whose driver is not installed."""


def store_from_settings(settings: StoreSettings, *, socket_timeout: float = 5.0) -> CheckpointStore:
    """The store ``settings`` describe: its URL, prefix or schema, and options.

    Raises:
        StoreNotConfigured: no store URL.
        MissingExtra: a PostgreSQL URL without ``checkpointq[postgres]`` installed.
        StoreUnavailable: a cluster URL whose seeds do not answer.
    """
    if is_postgres_url(settings.resolved_store_url):
        try:
            from checkpointq.store.postgres import PostgresStore
        except ImportError as exc:
            raise MissingExtra(
                f"a PostgreSQL store needs psycopg ({exc.name} is missing): "
                "pip install 'checkpointq[postgres]'"
            ) from None
        return PostgresStore.from_settings(settings)
    return RedisStore.from_settings(settings, socket_timeout=socket_timeout)
