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
"""

from __future__ import annotations

from typing import Any

from redis.cluster import ClusterNode, RedisCluster

from checkpointq.store.urls import cluster_seeds


def cluster_client_from_url(url: str, **kwargs: Any) -> RedisCluster:
    """Build a cluster client from a ``redis+cluster://`` or ``...?cluster=true`` URL.

    Raises:
        ValueError: the URL names no node or a port that is not a number.
        redis.RedisError, redis.exceptions.RedisClusterException: no seed answered.
    """
    plain, seeds = cluster_seeds(url)
    startup_nodes = [ClusterNode(host, port) for host, port in seeds[1:]]  # type: ignore[no-untyped-call]
    return RedisCluster.from_url(plain, startup_nodes=startup_nodes, **kwargs)
