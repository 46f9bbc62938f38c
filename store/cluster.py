"""How a store URL selects Redis Cluster, and the cluster client built from it.

Two spellings, both giving a ``redis.cluster.RedisCluster``:

* ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]`` (and
  ``rediss+cluster://`` for TLS): extra ``host:port`` seeds are tried when the first is down;
  the client discovers every other node from whichever answers.
* ``redis://host:port/0?cluster=true`` (or ``rediss://``): the same, for tools that only
  accept the standard schemes.

A cluster has only database 0 and no unix sockets. Unlike the single-Redis client, the
cluster client connects when it is built (it must learn the slot map first).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.cluster import ClusterNode, RedisCluster

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TRUE = {"1", "true", "yes", "on"}


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` asks for Redis Cluster (by scheme or by ``cluster=true``)."""
    parts = urlsplit(url)
    if parts.scheme in _CLUSTER_SCHEMES:
        return True
    return any(
        name == "cluster" and value.lower() in _TRUE for name, value in parse_qsl(parts.query)
    )


def cluster_client_from_url(url: str, **kwargs: Any) -> RedisCluster:
    """Build a cluster client from a ``redis+cluster://`` or ``...?cluster=true`` URL.

    Raises:
        ValueError: the URL names no node or a port that is not a number.
        redis.RedisError, redis.exceptions.RedisClusterException: no seed answered.
    """
    parts = urlsplit(url)
    scheme = _CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    auth, _, hosts = parts.netloc.rpartition("@")
    seeds = [_host_port(seed) for seed in hosts.split(",")]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "cluster"])
    first_host, first_port = seeds[0]
    netloc = f"{auth}@" if auth else ""
    netloc += f"[{first_host}]:{first_port}" if ":" in first_host else f"{first_host}:{first_port}"
    plain = urlunsplit((scheme, netloc, parts.path, query, parts.fragment))
    startup_nodes = [ClusterNode(host, port) for host, port in seeds[1:]]  # type: ignore[no-untyped-call]
    return RedisCluster.from_url(plain, startup_nodes=startup_nodes, **kwargs)


def _host_port(seed: str) -> tuple[str, int]:
    host, sep, port = seed.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"cluster seed {seed!r} must be host:port")
    return host.strip("[]"), int(port)
