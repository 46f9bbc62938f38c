"""Every Redis key checkpointq touches is built here, from one configurable prefix.

Layout (prefix ``agentorca-session``, the Go default)::

    agentorca-session:<id>              the checkpoint (zstd JSON), exactly where Go keeps it
    agentorca-session.cq:fence:<id>     hash: last applied seq, tombstone flag, deadline
    agentorca-session.cq:deadlines      sorted set: session id -> deadline (ms since epoch)
    agentorca-session.cq:sweep-lock     short lock held by one sweep at a time
    agentorca-session.cq:dead-letters   stream of requests that could not be applied
    agentorca-session.cq:events         stream of expired/deleted session ids

A Go-style ``SCAN agentorca-session:*`` therefore sees exactly the checkpoints: our
bookkeeping lives under ``<prefix>.cq:``, which that pattern cannot match. Keys are only ever
concatenated, never used as patterns, so a session id holding ``*``, ``?``, ``[`` or ``:``
names its own keys and nobody else's: data keys all start with ``<prefix>:`` and bookkeeping
keys with ``<prefix>.cq:``, and within each family the id is the whole suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The Go ``RedisStore``'s key prefix.
DEFAULT_PREFIX = "agentorca-session"


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The keys one session's atomic scripts touch, in the order the scripts expect them."""

    data: str
    fence: str
    index: str

    def as_list(self) -> list[str]:
        return [self.data, self.fence, self.index]


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Builds the keys of one deployment from its prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "*?[]{}\\ \r\n\t"):
            raise ValueError(
                f"key prefix {self.prefix!r} must be non-empty and free of glob, hash-tag and "
                "whitespace characters"
            )

    @property
    def _internal(self) -> str:
        return f"{self.prefix}.cq"

    def data(self, session_id: str) -> str:
        """Where the checkpoint value lives (Go-compatible)."""
        return f"{self.prefix}:{session_id}"

    def data_pattern(self) -> str:
        """The pattern Go's ``List`` scans with; used only by the one-off re-index."""
        return f"{self.prefix}:*"

    def session_id_from_data_key(self, key: str) -> str:
        return key[len(self.prefix) + 1 :]

    def fence(self, session_id: str) -> str:
        return f"{self._internal}:fence:{session_id}"

    def index(self) -> str:
        return f"{self._internal}:deadlines"

    def session(self, session_id: str) -> SessionKeys:
        return SessionKeys(self.data(session_id), self.fence(session_id), self.index())

    def sweep_lock(self) -> str:
        return f"{self._internal}:sweep-lock"

    def dead_letters(self) -> str:
        return f"{self._internal}:dead-letters"

    def events(self) -> str:
        return f"{self._internal}:events"
