"""Which broker a URL names, and the kombu transport options each kind needs.

Both sides publish or consume through kombu, and each broker kind needs its own options:

* **Redis** (``redis://``, ``rediss://``, ``unix://``; the scheme sets are in
  ``checkpointq.store.urls``, with the URL rules): a queue is a
  list; a message fetched but never acknowledged comes back after the visibility timeout,
  which only kombu's Redis transport knows about.
* **Redis Sentinel** (``sentinel://host:port[;sentinel://host:port...]``): the same Redis
  transport, finding the master through the sentinels; it needs the master's name and, when
  the sentinels require one, their password (which may differ from the master's, given in the
  URL).
* **RabbitMQ** (``amqp://``, ``amqps://``, ``pyamqp://``): the broker redelivers on
  connection loss by itself (no visibility timeout); publisher confirms make a publish
  return only once the broker has taken responsibility for the message.

Only the Redis-based kinds can hold the store: a store URL must be given explicitly for
any other broker (``checkpointq.worker.settings`` enforces it).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from checkpointq.store.urls import AMQP_SCHEMES, REDIS_SCHEMES, SENTINEL_SCHEMES, scheme_of


class BrokerKind(Enum):
    """The broker families checkpointq configures differently."""

    REDIS = "redis"
    SENTINEL = "sentinel"
    AMQP = "amqp"
    OTHER = "other"


_SCHEMES = {
    **dict.fromkeys(REDIS_SCHEMES, BrokerKind.REDIS),
    **dict.fromkeys(SENTINEL_SCHEMES, BrokerKind.SENTINEL),
    **dict.fromkeys(AMQP_SCHEMES, BrokerKind.AMQP),
}


def broker_kind(url: str) -> BrokerKind:
    """The kind of broker ``url`` names (by its scheme; the first of ``;``-separated URLs)."""
    return _SCHEMES.get(scheme_of(url), BrokerKind.OTHER)


def is_known_transport(url: str) -> bool:
    """Whether kombu has a transport for ``url``'s scheme (``http://`` has none).

    Our own schemes are answered without kombu: a producer installed without Celery (the
    base install) publishes to Redis itself and never imports it.
    """
    scheme = scheme_of(url)
    if scheme in _SCHEMES:
        return True
    try:
        from kombu.transport import TRANSPORT_ALIASES
    except ModuleNotFoundError:  # no kombu: only the schemes the producer writes to itself
        return False
    return scheme in {alias.lower() for alias in TRANSPORT_ALIASES}


def transport_options(
    url: str,
    *,
    visibility_timeout: int | None = None,
    sentinel_master: str | None = None,
    sentinel_password: str | None = None,
) -> dict[str, Any]:
    """``broker_transport_options`` for ``url``.

    Args:
        visibility_timeout: seconds before a Redis broker redelivers an unacknowledged
            message (consumers only; ``None`` for a producer, which never restores).
        sentinel_master: the master's name as the sentinels know it (Sentinel brokers).
        sentinel_password: the sentinels' own password, if they require one.

    Raises:
        ValueError: a Sentinel URL without ``sentinel_master``.
    """
    kind = broker_kind(url)
    options: dict[str, Any] = {}
    if kind is BrokerKind.AMQP:
        # Publisher confirms: basic_publish waits for the broker's ack, so a publish that
        # returned was accepted (and, for a durable queue, persisted) by RabbitMQ; one it
        # refused raises instead of vanishing. Costs a round trip per publish.
        options["confirm_publish"] = True
        return options
    if kind is BrokerKind.SENTINEL:
        if not sentinel_master:
            raise ValueError(
                "a sentinel:// broker needs the master's name (CHECKPOINTQ_SENTINEL_MASTER)"
            )
        options["master_name"] = sentinel_master
        if sentinel_password:
            options["sentinel_kwargs"] = {"password": sentinel_password}
    if kind in (BrokerKind.REDIS, BrokerKind.SENTINEL) and visibility_timeout is not None:
        # Redis redelivers a message fetched but never acknowledged after this long. It
        # must exceed the longest task plus the longest retry countdown (settings validate
        # this), or a message waiting for its retry would be handed to a second worker.
        options["visibility_timeout"] = visibility_timeout
        # kombu looks for such messages only every interval x throttle seconds (10 x 10 by
        # default): a crashed worker's messages would wait up to 100 s past the timeout.
        # Look every tenth of the timeout instead (one ZRANGE, under a mutex).
        options["unacked_restore_interval"] = max(1, visibility_timeout // 10)
        options["unacked_restore_throttle"] = 1
    return options
