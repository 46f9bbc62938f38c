"""Connection URLs as they may be shown to people: never with a password."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|sentinel_password|passwd)=)[^&]*")


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
