"""How a store URL selects Redis Cluster, and the cluster client built from it.

Two spellings, both giving a ``redis.cluster.RedisCluster``:

* ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]`` (and
  ``rediss+cluster://`` for TLS): extra ``host:port`` seeds are tried when the first is down;
  the client discovers every other node from whichever answers.
* ``redis://host:port/0?cluster=true`` (or ``rediss://``): the same, for tools that only
  accept the standard schemes.

The URL rules (``is_cluster_url``, ``cluster_seeds``) are in ``checkpointq.store.urls``.

A cluster has only database 0 and no unix sockets. Unlike the single-Redis client, the
cluster client connects when it is built (it must learn the slot map first).

The client retries a command that failed on a connection error, a timeout, ``CLUSTERDOWN``
or an uncovered slot ``CLUSTER_RETRIES`` times without waiting, on every redis-py: a failover
that outlasts them reaches the caller as ``StoreUnavailable``, and the worker's retry policy
does the waiting (docs/scaling.md, "Failover").
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from checkpointq.store.urls import cluster_seeds

#: Retries of a cluster command after its first attempt (redis-py 8's default count).
CLUSTER_RETRIES = 10

#: redis-py 5 counts the cluster client's retries in ``cluster_error_retry_attempts`` (its
#: ``retry=`` is each node connection's own); from 6.0 ``retry=`` sets them, and the count
#: argument is deprecated.
_RETRY_IN_CLUSTER_ARGUMENT = int(redis.__version__.split(".")[0]) < 6


def _retry_kwargs() -> dict[str, Any]:
    if _RETRY_IN_CLUSTER_ARGUMENT:
        return {"cluster_error_retry_attempts": CLUSTER_RETRIES}
    return {"retry": Retry(NoBackoff(), CLUSTER_RETRIES)}


def cluster_client_from_url(url: str, **kwargs: Any) -> RedisCluster:
    """Build a cluster client from a ``redis+cluster://`` or ``...?cluster=true`` URL, with
    ``CLUSTER_RETRIES`` retries and no backoff unless ``kwargs`` say otherwise.

    Raises:
        ValueError: the URL names no node or a port that is not a number.
        redis.RedisError, redis.exceptions.RedisClusterException: no seed answered.
    """
    plain, seeds = cluster_seeds(url)
    startup_nodes = [ClusterNode(host, port) for host, port in seeds[1:]]  # type: ignore[no-untyped-call]
    return RedisCluster.from_url(
        plain, startup_nodes=startup_nodes, **{**_retry_kwargs(), **kwargs}
    )
