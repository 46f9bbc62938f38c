"""Where the running system is: the configured URLs, or the embedded Redis of the data dir.

Every CLI command but ``up`` starts here: ``resolve()`` returns the settings with both URLs
filled in, so that nothing downstream needs to know whether Redis is embedded.
"""

from __future__ import annotations

from typing import Any

import redis

from checkpointq.store.base import CheckpointStore
from checkpointq.store.cluster import cluster_client_from_url
from checkpointq.store.errors import CheckpointError
from checkpointq.store.factory import store_from_settings
from checkpointq.store.keys import KeySpace
from checkpointq.store.redis import layout as store_layout
from checkpointq.store.urls import is_cluster_url, redis_py_url
from checkpointq.worker.embedded import EmbeddedRedis
from checkpointq.worker.settings import InvalidSettings as InvalidSettings
from checkpointq.worker.settings import Settings

#: Seconds a CLI command waits for Redis to connect or answer before reporting it down.
CLI_SOCKET_TIMEOUT = 5.0


class NotConfigured(CheckpointError):
    """No broker URL is set and no embedded Redis runs under the data directory."""


def load_settings(**overrides: Any) -> Settings:
    """Read the settings (``overrides``, by field name, win over the environment), turning
    a validation failure into one line without the values.

    Raises:
        InvalidSettings: the first refused variable and why (its value is not echoed: it
            may be a URL with a password).
    """
    return Settings(**overrides)


def with_embedded(settings: Settings, embedded: EmbeddedRedis) -> Settings:
    """``settings`` pointed at an embedded server (broker, and store if it was unset)."""
    return settings.model_copy(update={"broker_url": embedded.endpoint.url})


def resolve(settings: Settings) -> Settings:
    """The settings with a broker URL: the configured one, or (found by ``Settings()``
    itself) the embedded server's.

    Raises:
        NotConfigured: no URL and no ``checkpointq up`` running under ``data_dir``.
    """
    if settings.broker_url is None:
        raise NotConfigured(
            "no broker configured: set CHECKPOINTQ_BROKER_URL, or start `checkpointq up` "
            f"in this directory (no embedded Redis is running under {settings.data_dir.resolve()})"
        )
    return settings


def _required(url: str | None) -> str:
    if url is None:
        raise NotConfigured("no broker configured (call resolve() first)")
    return url


def store_client(settings: Settings, timeout: float = CLI_SOCKET_TIMEOUT) -> Any:
    """A client of the Redis beside the store (sweep lock, events, dead letters,
    heartbeats: the store's own, or the broker's beside a PostgreSQL store): a
    ``redis.Redis``, or a ``RedisCluster`` for a cluster URL (which connects at once)."""
    url = redis_py_url(_required(settings.resolved_redis_url))
    if is_cluster_url(url):
        return cluster_client_from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def open_store(settings: Settings) -> CheckpointStore:
    """The checkpoint store the workers write, for reading it directly."""
    return store_from_settings(settings, socket_timeout=CLI_SOCKET_TIMEOUT)


def key_space(settings: Settings) -> KeySpace:
    """The key layout of the Redis beside the store, as the store itself derives it from
    its URL and prefix."""
    return store_layout(settings.resolved_redis_url or "", settings.key_prefix)
