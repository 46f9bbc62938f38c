"""The Lua scripts, read once from ``store/lua/*.lua`` and registered once per client.

redis-py's ``Script`` sends EVALSHA and reloads on NOSCRIPT (after a restart or a failover),
and works inside pipelines, so callers never handle script caching themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.commands.core import Script


@cache
def script_source(name: str) -> str:
    """The text of ``store/lua/<name>.lua``, read from package data once per process."""
    return resources.files("store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Scripts:
    """The store's scripts bound to one client (or cluster client)."""

    save: Script
    delete: Script
    refresh: Script
    expire: Script

    @classmethod
    def register(cls, client: Any) -> Scripts:
        return cls(
            save=client.register_script(script_source("save")),
            delete=client.register_script(script_source("delete")),
            refresh=client.register_script(script_source("refresh")),
            expire=client.register_script(script_source("expire")),
        )
