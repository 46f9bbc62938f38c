"""The URL rules, in one place: which schemes name what, how each library spells a unix
socket, and how a URL is shown to people (never with a password).

Lives in ``store/`` (the bottom layer) so that every layer reads the same rules:

* **One spelling for a unix socket: ``unix:///path/redis.sock``**, as redis-py, go-redis,
  node-redis and redis-cli's ``-u`` write it. kombu alone knows it only as
  ``redis+socket://``: ``kombu_url`` converts for Celery, ``redis_py_url`` converts back, so
  either spelling works wherever a URL is read.
* **Schemes by kind**: plain Redis, Sentinel, RabbitMQ. ``tasks/brokers.py`` maps these onto
  the transport options each kind needs.
* **Redis Cluster** (``redis+cluster://h:7000,h2:7000`` or ``...?cluster=true``) and
  **Sentinel** (kombu's ``sentinel://h:26379;sentinel://h2:26379``) URLs, taken apart into
  what redis-py's clients are built from (``store/cluster.py``, ``worker/ops/broker_probe.py``).
* **Checking**: ``check_url`` turns every malformed URL (a port that is not a number, a
  database that is not one, an option redis-py cannot read) into one ``ValueError`` line at
  start-up, instead of a traceback from deep inside redis-py or kombu on first use.
* **Redaction**: ``redact_url`` for one URL, ``redact_urls`` for every URL in a text. A
  password may hold any character but ``/ ? #`` and line breaks (quotes, spaces, ``@``), so
  the text is searched for ``scheme://...@``, not for a well-formed URL.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis.connection import parse_url

#: Plain Redis: redis-py's spellings and kombu's for a unix socket.
REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+socket", "socket"})
#: Redis Sentinel (kombu's ``sentinel://host:port;sentinel://host:port``).
SENTINEL_SCHEMES = frozenset({"sentinel", "sentinels"})
#: RabbitMQ.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
#: PostgreSQL (a store only: ``store/postgres.py``).
POSTGRES_SCHEMES = frozenset({"postgresql", "postgres"})
#: The broker schemes named in "unsupported scheme" errors, in the order a reader looks.
SUPPORTED_BROKER_SCHEMES = ("redis", "rediss", "unix", "sentinel", "amqp", "amqps")

#: kombu's names for a unix socket URL, which redis-py spells ``unix://``.
_KOMBU_SOCKET_PREFIXES = ("redis+socket://", "socket://")

#: A URL of any scheme inside a text (sentinel://, redis+cluster://, pyamqp:// URLs hold
#: passwords as well).
URL_PATTERN = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")

#: redis-py's reading of a URL (its options and their types); the library leaves it untyped.
redis_py_parse_url: Callable[[str], dict[str, Any]] = parse_url

_SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|sentinel_password|passwd)=)[^&]*")

#: A ``;`` that starts the next of several URLs (not one inside a password).
_NEXT_URL = re.compile(r";(?=\s*[a-zA-Z][a-zA-Z0-9+.-]*://)")
#: The credentials of a URL inside a text: the scheme, then everything up to the last ``@``
#: before the authority ends (``/``, ``?``, ``#`` or a line break), so that a raw password
#: holding quotes, spaces or ``@`` is hidden whole. Over-matching only hides more.
_TEXT_CREDENTIALS = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#\r\n]*)@")
#: A secret query option inside a text, up to the next option, fragment or blank.
_TEXT_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|sentinel_password|passwd)=)[^&#\s]*")


def scheme_of(url: str) -> str:
    """The scheme of ``url`` (of the first of ``;``-separated URLs), lower-cased."""
    return urlsplit(url.split(";", 1)[0].strip()).scheme.lower()


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names one plain Redis server (any spelling; not Sentinel, not AMQP)."""
    return scheme_of(url) in REDIS_SCHEMES


def is_postgres_url(url: str | None) -> bool:
    """Whether ``url`` names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return url is not None and scheme_of(url) in POSTGRES_SCHEMES


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
    urls = _NEXT_URL.split(url)
    if len(urls) > 1:
        return ";".join(redact_url(part) for part in urls)
    try:
        parts = urlsplit(url)
    except ValueError:  # "[" in a password reads as a broken IPv6 host: hide as in a text
        return redact_urls(url)
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
    text = _TEXT_CREDENTIALS.sub(_hide_credentials, text)
    return _TEXT_SECRET_QUERY.sub(r"\1***", text)


def _hide_credentials(match: re.Match[str]) -> str:
    scheme, auth = match.group(1), match.group(2)
    user, colon, _ = auth.partition(":")
    # As redact_url: a user and a password keep the user; a lone user is a token.
    return f"{scheme}{user}:***@" if colon else f"{scheme}***@"


def check_url(url: str) -> str:
    """``url`` unchanged if every part of it can be read, else one ``ValueError`` line.

    Checks what would otherwise fail on first use, as a traceback: the authority of each
    ``;``-separated URL (IPv6 brackets, a port that is a number in range), a Redis database
    path that is a number, redis-py's query options, and a cluster URL's seeds.

    Raises:
        ValueError: naming the URL (redacted) and what is wrong with it.
    """
    try:
        for part in url.split(";"):
            _check_one(part.strip())
    except ValueError as exc:
        raise ValueError(f"{redact_url(url)} is malformed: {exc}") from None
    return url


def _check_one(url: str) -> None:
    parts = urlsplit(url)  # raises on broken IPv6 brackets
    if "," not in parts.netloc:  # a cluster's seeds are checked by cluster_seeds below
        try:
            _ = parts.port  # reading it checks it
        except ValueError:
            port = parts.netloc.rpartition("@")[2].rpartition(":")[2]
            raise ValueError(f"port {port!r} is not a number from 0 to 65535") from None
    scheme = parts.scheme.lower()
    if scheme in CLUSTER_SCHEMES or is_cluster_url(url):
        cluster_seeds(url)
        return
    if scheme in SENTINEL_SCHEMES:
        database = parts.path.strip("/")
    elif scheme in ("redis", "rediss"):
        database = unquote(parts.path).strip("/")
    else:
        database = ""
    if database and not database.isdigit():
        raise ValueError(f"database {database!r} is not a number")
    if scheme in REDIS_SCHEMES:
        redis_py_parse_url(redis_py_url(url))  # its query options: "Invalid value for 'x'"
