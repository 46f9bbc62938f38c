"""Does the store accept writes? One write answers it, and says why not in plain words.

A ``PING`` answers while Redis refuses every write: out of memory under ``noeviction``
(``-OOM command not allowed``), a replica after a failover (``-READONLY``), a master that
lost its replicas (``-NOREPLICAS``), a full disk (``-MISCONF``). The worker pauses consuming
while the store refuses writes (``worker/backpressure.py``), a task whose retries run out
asks before it gives up on the store (``tasks/checkpoints.py``), and ``checkpointq health``
reports the reason; all three ask here, with a real write to a key of their own.
"""

from __future__ import annotations

from typing import Any

from redis import exceptions as redis_errors

#: The probe key lives this long: it is never read, only written.
PROBE_TTL_MS = 60_000

#: redis-py's classes for "this server refuses writes now", in plain words.
_REFUSAL_CLASSES: tuple[tuple[type[Exception], str], ...] = (
    (redis_errors.OutOfMemoryError, "out of memory (maxmemory reached, eviction off)"),
    (redis_errors.ReadOnlyError, "read-only (a replica, not the master)"),
    (redis_errors.BusyLoadingError, "loading its dataset"),
    (redis_errors.MasterDownError, "its master is down"),
    (redis_errors.ClusterDownError, "the cluster is down"),
)

#: Error codes redis-py has no class for (or that arrive inside a script's error text).
_REFUSAL_CODES = {
    "OOM": "out of memory (maxmemory reached, eviction off)",
    "READONLY": "read-only (a replica, not the master)",
    "NOREPLICAS": "not enough replicas (min-replicas-to-write)",
    "MISCONF": "cannot persist to disk (stop-writes-on-bgsave-error)",
    "BUSY": "busy running a script",
    # What a blocked BRPOP gets when its server turns replica (a failover)
    "UNBLOCKED": "unblocked: it changed role (master -> replica?)",
}


def describe(exc: BaseException) -> str:
    """Why a store write failed, in one line an operator can act on."""
    text = str(exc).strip()
    for cls, words in _REFUSAL_CLASSES:
        if isinstance(exc, cls):
            return f"{words}: {text}"
    code = text.split(" ", 1)[0].upper()
    if code in _REFUSAL_CODES:
        return f"{_REFUSAL_CODES[code]}: {text}"
    if isinstance(exc, redis_errors.TimeoutError):
        return f"no answer in time ({text or type(exc).__name__})"
    if isinstance(exc, redis_errors.ConnectionError):
        return f"unreachable ({type(exc).__name__}: {text})"
    return f"{type(exc).__name__}: {text}"


def refused(exc: BaseException) -> str | None:
    """Why the server refused a write, when ``exc`` is such an answer (out of memory,
    read-only, cannot persist, ...); None for anything else (unreachable, a bad command)."""
    text = str(exc).strip()
    if any(isinstance(exc, cls) for cls, _ in _REFUSAL_CLASSES):
        return describe(exc)
    # A command in a pipeline is reported as "Command # 1 (...) of pipeline caused error: ..."
    # with redis-py's class for its code: the classes above catch those.
    if isinstance(exc, redis_errors.ResponseError) and text.split(" ", 1)[0].upper() in (
        _REFUSAL_CODES
    ):
        return describe(exc)
    return None


def write_refusal(client: Any, key: str) -> str | None:
    """None when ``client``'s Redis accepted a write to ``key``; else why it did not.

    ``client`` is a ``redis.Redis`` or a ``RedisCluster``. Never raises for Redis errors:
    refusing is the answer.
    """
    try:
        client.set(key, b"1", px=PROBE_TTL_MS)
    except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
        return describe(exc)
    return None
