"""The Lua scripts, read once from ``store/lua/*.lua`` and registered once per client.

redis-py's ``Script`` sends EVALSHA and reloads on NOSCRIPT (after a restart or a failover),
and works inside pipelines, so callers never handle script caching themselves. The one
exception is a Redis Cluster pipeline: see ``queue``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.cluster import ClusterPipeline
from redis.commands.core import Script


@cache
def script_source(name: str, package: str = "checkpointq.store") -> str:
    """The text of ``<package>/lua/<name>.lua`` (``store/lua`` by default), read from
    package data once per process."""
    return resources.files(package).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def queue(script: Script, pipe: Any, keys: list[str], args: list[Any]) -> None:
    """Add one call of ``script`` to ``pipe``, a plain or a cluster pipeline.

    redis-py refuses EVALSHA in cluster pipelines (it could not load a script missing on one
    node mid-pipeline) and leaves ``ClusterPipeline.eval`` unimplemented, so there the body
    goes as a raw EVAL. Left to itself the pipeline would ask the server which arguments of
    an EVAL are keys (one COMMAND GETKEYS round trip per call: a sweep ran 14x slower), so
    the call names its node from the client's slot map; MOVED and ASK replies are still
    followed.
    """
    if isinstance(pipe, ClusterPipeline):
        node = pipe.get_node_from_key(keys[0])  # type: ignore[no-untyped-call]
        pipe.execute_command(  # type: ignore[no-untyped-call]
            "EVAL", script.script, len(keys), *keys, *args, target_nodes=node
        )
    else:
        script(keys=keys, args=args, client=pipe)


@dataclass(frozen=True, slots=True)
class Scripts:
    """The store's scripts bound to one client (or cluster client)."""

    save: Script
    delete: Script
    refresh: Script
    expire: Script
    load: Script
    reconcile: Script
    due: Script
    hinted: Script
    page: Script
    count: Script

    @classmethod
    def register(cls, client: Any) -> Scripts:
        return cls(
            save=client.register_script(script_source("save")),
            delete=client.register_script(script_source("delete")),
            refresh=client.register_script(script_source("refresh")),
            expire=client.register_script(script_source("expire")),
            load=client.register_script(script_source("load")),
            reconcile=client.register_script(script_source("reconcile")),
            due=client.register_script(script_source("due")),
            hinted=client.register_script(script_source("hinted")),
            page=client.register_script(script_source("page")),
            count=client.register_script(script_source("count")),
        )
