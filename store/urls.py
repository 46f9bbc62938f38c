"""The URL rules, in one place: which schemes name what, how each library spells a unix
socket, and how a URL is shown to people (never with a password).

Lives in ``store/`` (the bottom layer) so that the store, the tasks and the worker all read
the same rules:

* **One spelling for a unix socket: ``unix:///path/redis.sock``**, as redis-py, go-redis,
  node-redis and redis-cli's ``-u`` write it. kombu alone knows it only as
  ``redis+socket://``: ``kombu_url`` converts for Celery, ``redis_py_url`` converts back, so
  either spelling works wherever a URL is read.
* **Schemes by kind**: plain Redis, Sentinel, RabbitMQ. ``tasks/brokers.py`` maps these onto
  the transport options each kind needs.
* **Redis Cluster** (``redis+cluster://h:7000,h2:7000`` or ``...?cluster=true``) and
  **Sentinel** (kombu's ``sentinel://h:26379;sentinel://h2:26379``) URLs, taken apart into
  what redis-py's clients are built from (``store/cluster.py``, ``worker/ops/broker_probe.py``).
* **Redaction**: ``redact_url`` for one URL, ``redact_urls`` for every URL inside a text (log
  lines, error messages).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

#: Plain Redis: redis-py's spellings and kombu's for a unix socket.
REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+socket", "socket"})
#: Redis Sentinel (kombu's ``sentinel://host:port;sentinel://host:port``).
SENTINEL_SCHEMES = frozenset({"sentinel", "sentinels"})
#: RabbitMQ.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
#: The broker schemes named in "unsupported scheme" errors, in the order a reader looks.
SUPPORTED_BROKER_SCHEMES = ("redis", "rediss", "unix", "sentinel", "amqp", "amqps")

#: kombu's names for a unix socket URL, which redis-py spells ``unix://``.
_KOMBU_SOCKET_PREFIXES = ("redis+socket://", "socket://")

#: A URL of any scheme inside a text (sentinel://, redis+cluster://, pyamqp:// URLs hold
#: passwords as well).
URL_PATTERN = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")

_SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|sentinel_password|passwd)=)[^&]*")


def scheme_of(url: str) -> str:
    """The scheme of ``url`` (of the first of ``;``-separated URLs), lower-cased."""
    return urlsplit(url.split(";", 1)[0].strip()).scheme.lower()


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names one plain Redis server (any spelling; not Sentinel, not AMQP)."""
    return scheme_of(url) in REDIS_SCHEMES


def redis_py_url(url: str) -> str:
    """The same server as redis-py spells it: kombu's ``redis+socket://`` is ``unix://``.

    >>> redis_py_url("redis+socket:///run/redis.sock")
    'unix:///run/redis.sock'
    """
    for prefix in _KOMBU_SOCKET_PREFIXES:
        if url.startswith(prefix):
            return "unix://" + url.removeprefix(prefix)
    return url


def kombu_url(url: str) -> str:
    """The same server as kombu (Celery's broker) spells it: ``unix://`` is ``redis+socket://``.

    >>> kombu_url("unix:///run/redis.sock")
    'redis+socket:///run/redis.sock'
    """
    if url.startswith("unix://"):
        return "redis+socket://" + url.removeprefix("unix://")
    return url


def unix_socket_url(path: str) -> str:
    """The URL of a Redis listening on the unix socket at ``path`` (absolute)."""
    return f"unix://{path}"


#: Cluster schemes and the plain scheme of each seed.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TRUE = {"1", "true", "yes", "on"}
#: A sentinel's port when its URL gives none.
SENTINEL_PORT = 26379


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` asks for Redis Cluster (by scheme or by ``cluster=true``)."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        return True
    return any(
        name == "cluster" and value.lower() in _TRUE for name, value in parse_qsl(parts.query)
    )


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL as redis-py's ``RedisCluster.from_url`` takes it: the first seed's
    plain ``redis://`` (or ``rediss://``) URL, credentials and options kept, and every seed.

    Raises:
        ValueError: the URL names no node or a port that is not a number.
    """
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    auth, _, hosts = parts.netloc.rpartition("@")
    seeds = [_host_port(seed) for seed in hosts.split(",")]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "cluster"])
    first_host, first_port = seeds[0]
    netloc = f"{auth}@" if auth else ""
    netloc += f"[{first_host}]:{first_port}" if ":" in first_host else f"{first_host}:{first_port}"
    return urlunsplit((scheme, netloc, parts.path, query, parts.fragment)), seeds


def _host_port(seed: str) -> tuple[str, int]:
    host, sep, port = seed.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"cluster seed {seed!r} must be host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A Sentinel broker URL taken apart: the sentinels, and the master's credentials and
    database (given on the first sentinel's URL, as kombu reads them)."""

    sentinels: list[tuple[str, int]]
    username: str | None
    password: str | None
    db: int
    ssl: bool


def parse_sentinel_url(url: str) -> SentinelURL:
    """``sentinel://[:password@]host:port[/db]`` URLs joined by ``;`` (kombu's spelling)."""
    parts = [urlsplit(part.strip()) for part in url.split(";") if part.strip()]
    first = parts[0]
    return SentinelURL(
        sentinels=[(p.hostname or "127.0.0.1", p.port or SENTINEL_PORT) for p in parts],
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        db=int(first.path.strip("/") or 0),
        ssl=first.scheme == "sentinels",
    )


def redact_url(url: str) -> str:
    """Replace any password (in the authority or the query) or lone user token with ``***``.

    >>> redact_url("redis://:hunter2@cache:6379/0")
    'redis://:***@cache:6379/0'

    Several URLs joined by ``;`` (kombu's failover and Sentinel spelling) are redacted
    one by one.
    """
    if ";" in url:
        return ";".join(redact_url(part) for part in url.split(";"))
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    query = _SECRET_QUERY.sub(r"\1***", parts.query)
    if parts.password is None and not parts.username:
        if query == parts.query:
            return url
        # Rebuild by hand: urlunsplit would turn "unix:///path" into "unix:/path".
        head = url.split("?", 1)[0]
        return f"{head}?{query}" + (f"#{parts.fragment}" if parts.fragment else "")
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is not None:
        host = f"{host}:{port}"
    user = parts.username or ""
    # A user with no password in a redis URL is usually a token: hide it too.
    auth = f"{user}:***" if parts.password is not None else "***"
    return urlunsplit((parts.scheme, f"{auth}@{host}", parts.path, query, parts.fragment))


def redact_urls(text: str) -> str:
    """``text`` with the password of every URL in it replaced (log lines, error messages)."""
    if "://" not in text:
        return text
    return URL_PATTERN.sub(lambda match: redact_url(match.group(0)), text)
