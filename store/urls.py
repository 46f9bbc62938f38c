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
* **Redaction**: ``redact_url`` for one URL, ``redact_urls`` for every URL inside a text (log
  lines, error messages).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

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
