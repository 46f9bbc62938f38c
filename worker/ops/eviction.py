"""May the broker or the store evict our keys? Their ``maxmemory-policy`` says.

Every policy but ``noeviction`` lets a full Redis drop keys instead of refusing writes:
``volatile-*`` the keys with a TTL (on the broker the pending records and staged saves'
values, on the store the checkpoints, fences and tombstones), ``allkeys-*`` any key, the
queue included. Nothing in the data shows it happened, so the worker warns once per Redis
when its consumer starts (``install``), and ``checkpointq health`` reports the same lines as
warnings (``check``) without failing. The policy comes from ``INFO memory``, else
``CONFIG GET`` (managed Redis often disables one of them); a Redis that answers neither is
noted at DEBUG and passed over. A policy that evicts is reported even with ``maxmemory`` 0
(no limit, so nothing is evicted yet): it bites the day someone sets a limit, and the fix is
the same. docs/operations.md ("Eviction, on any Redis") says what to set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery import Celery, bootsteps
from redis import exceptions as redis_errors
from redis.cluster import RedisCluster

from checkpointq.store.urls import redact_url
from checkpointq.worker import connections
from checkpointq.worker.ops import broker_probe
from checkpointq.worker.settings import Settings

logger = logging.getLogger(__name__)

#: The one policy under which Redis never drops a key: a full Redis refuses writes instead.
SAFE_POLICY = "noeviction"
#: Seconds the start-up check waits for each Redis: it runs before the worker consumes.
STARTUP_TIMEOUT = 1.0
#: The roles a Redis plays, in the order they are reported.
BROKER, STORE = "broker", "store"

#: What each role loses under each family of policies, and what that does.
_LOSSES = {
    (BROKER, "volatile"): "pending records and staged saves' values (the keys with a TTL), "
    "so accepted saves are dead-lettered and loads miss queued writes",
    (BROKER, "allkeys"): "queued and unacknowledged requests, pending records and staged "
    "saves' values, so accepted requests are lost or dead-lettered and loads miss queued writes",
    (STORE, "volatile"): "checkpoints, fences and tombstones (the keys with a TTL), so "
    "sessions vanish early and a deleted one can come back",
    (STORE, "allkeys"): "checkpoints, fences, tombstones, the session index and dead letters, "
    "so sessions vanish early and a deleted one can come back",
}


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """What a Redis does when it reaches its memory limit."""

    #: ``maxmemory-policy``: ``noeviction``, ``volatile-lru``, ``allkeys-lfu``, ...
    policy: str
    #: ``maxmemory`` in bytes; 0 means no limit; None when the server did not say.
    maxmemory: int | None

    @property
    def evicts(self) -> bool:
        return self.policy != SAFE_POLICY

    @property
    def family(self) -> str:
        """``volatile`` (keys with a TTL) or ``allkeys`` (any key; unknown policies too)."""
        return "volatile" if self.policy.startswith("volatile-") else "allkeys"


@dataclass(frozen=True, slots=True)
class EvictionWarning:
    """One Redis whose policy can evict keys checkpointq needs."""

    #: ``broker``, ``store``, or ``broker and store`` when they are one Redis.
    roles: tuple[str, ...]
    #: The server, as it may be shown (password redacted; a cluster node's address added).
    where: str
    memory: MemoryPolicy

    @property
    def role(self) -> str:
        return " and ".join(self.roles)

    def line(self) -> str:
        """The warning in one line: the policy, what it can drop, and the fix."""
        memory = self.memory
        if memory.maxmemory == 0:
            size = " and maxmemory 0 (no limit: nothing is evicted yet)"
            when = "once a limit is set, Redis will evict"
        else:
            size = "" if memory.maxmemory is None else f" and maxmemory {_size(memory.maxmemory)}"
            when = "when full, Redis evicts"
        losses = ", and ".join(_LOSSES[role, memory.family] for role in self.roles)
        return (
            f"{self.role} {self.where} has maxmemory-policy {memory.policy}{size}: {when} "
            f"{losses}; fix: set maxmemory-policy {SAFE_POLICY} (a full Redis then refuses "
            "writes, and the workers pause until it has room)"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "redis": self.role,
            "where": self.where,
            "policy": self.memory.policy,
            "maxmemory": self.memory.maxmemory,
            "detail": self.line(),
        }


def _size(count: int) -> str:
    for unit, bytes_in in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= bytes_in:
            return f"{count / bytes_in:.1f} {unit}"
    return f"{count} B"


def read_policy(client: Any) -> MemoryPolicy | None:
    """``client``'s Redis memory policy (one server, a ``redis.Redis``): from ``INFO
    memory``, else ``CONFIG GET``; None when it refuses both, or does not answer (then
    CONFIG GET is not tried: a server that is down or slow costs one timeout, not two).
    Never raises for Redis errors."""
    try:
        info = client.info("memory")
        if "maxmemory_policy" in info:
            return MemoryPolicy(str(info["maxmemory_policy"]), _int(info.get("maxmemory")))
    except redis_errors.ResponseError as exc:
        logger.debug("INFO memory refused (%s): trying CONFIG GET", exc)
    except redis_errors.RedisError as exc:
        logger.debug("INFO memory not answered (%s)", exc)
        return None
    try:
        config = client.config_get("maxmemory*")
    except redis_errors.RedisError as exc:
        logger.debug("CONFIG GET maxmemory* not answered either (%s)", exc)
        return None
    policy = config.get("maxmemory-policy")
    return None if policy is None else MemoryPolicy(str(policy), _int(config.get("maxmemory")))


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _servers(client: Any, where: str) -> list[tuple[str, Any]]:
    """The servers behind ``client``: itself, or each primary of a cluster."""
    if isinstance(client, RedisCluster):
        primaries = client.get_primaries()  # type: ignore[no-untyped-call]  # no hints
        return [
            (f"{where} (node {node.name})", client.get_redis_connection(node)) for node in primaries
        ]
    return [(where, client)]


def warnings_for(roles: tuple[str, ...], where: str, client: Any) -> list[EvictionWarning]:
    """The warnings for the Redis ``client`` reaches (each primary of a cluster), playing
    ``roles``: one per server whose policy evicts; none for those that do not or that keep
    their policy to themselves (noted at DEBUG)."""
    found = []
    for shown, server in _servers(client, where):
        memory = read_policy(server)
        if memory is None:
            logger.debug("maxmemory-policy of %s %s unknown: not checked", "/".join(roles), shown)
        elif memory.evicts:
            found.append(EvictionWarning(roles, shown, memory))
    return found


def check(settings: Settings, broker: Any | None, store: Any | None) -> list[EvictionWarning]:
    """The warnings for the deployment's broker and store, one per Redis (the broker's
    Redis, when it is also the store, is read once for both).

    Args:
        settings: resolved settings (both URLs known).
        broker: a client of the broker's Redis (Sentinel's master); None on RabbitMQ, which
            evicts nothing, or when the broker did not answer.
        store: a client of the store (a single Redis or a cluster); None when it did not
            answer.
    """
    same = settings.resolved_redis_url == settings.broker_url
    found = []
    if broker is not None:
        roles = (BROKER, STORE) if same else (BROKER,)
        found += warnings_for(roles, redact_url(settings.broker_url or ""), broker)
    if store is not None and not same:
        found += warnings_for((STORE,), redact_url(settings.resolved_redis_url or ""), store)
    return found


def log_startup_warnings(settings: Settings, *, timeout: float = STARTUP_TIMEOUT) -> None:
    """Log one WARNING line per Redis whose policy can evict our keys (``check``), giving
    each Redis ``timeout`` seconds to answer; one that does not is passed over."""
    store = None
    try:
        store = connections.store_client(settings, timeout=timeout)
    except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
        logger.debug("maxmemory-policy of the store unknown: %s", exc)
    try:
        with broker_probe.open_probe(settings, timeout=timeout) as probe:
            found = check(settings, probe.redis_client, store)
    finally:
        if store is not None:
            store.close()
    for warning in found:
        logger.warning("%s", warning.line())


def install(app: Celery, settings: Settings) -> None:
    """Make ``app``'s workers check the policies when their consumer first starts."""

    class EvictionCheckStep(bootsteps.StartStopStep):  # type: ignore[misc]  # no celery hints
        """The check, once per worker: the consumer's first start (the broker answers)."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            self._done = False

        def start(self, consumer: Any) -> None:
            if not self._done:
                self._done = True
                log_startup_warnings(connections.resolve(settings))

    app.steps["consumer"].add(EvictionCheckStep)
