"""Every Redis key checkpointq touches is built here, from one configurable prefix.

Single Redis (``KeySpace``; prefix ``agentorca-session``, the Go default)::

    agentorca-session:<id>              the checkpoint (zstd JSON), exactly where Go keeps it
    agentorca-session.cq:fence:<id>     hash: last applied seq, tombstone flag, deadline
    agentorca-session.cq:deadlines      sorted set: session id -> deadline (ms since epoch)
    agentorca-session.cq:sweep-lock     short lock held by one sweep at a time
    agentorca-session.cq:dead-letters   stream of requests that could not be applied
    agentorca-session.cq:refused:<req>  hash: why request <req> was dead-lettered, and where
    agentorca-session.cq:events         stream of expired/deleted session ids
    agentorca-session.cq:reconcile      hash: where the reconciliation pass stands

A Go-style ``SCAN agentorca-session:*`` therefore sees exactly the checkpoints: our
bookkeeping lives under ``<prefix>.cq:``, which that pattern cannot match. Keys are only ever
concatenated, never used as patterns, so a session id holding ``*``, ``?``, ``[`` or ``:``
names its own keys and nobody else's: data keys all start with ``<prefix>:`` and bookkeeping
keys with ``<prefix>.cq:``, and within each family the id is the whole suffix.

Redis Cluster (``ClusterKeySpace``): a script may only touch keys of one hash slot, and one
deadline index for every session would put all of them in one slot. So sessions are split
into ``shards`` (default 1024) by a stable hash of their id, and every key of a shard carries
the shard's hash tag, which places it in the shard's slot::

    agentorca-session:{<tag>}:<id>             the checkpoint
    agentorca-session.cq:{<tag>}:fence:<id>    its fence hash
    agentorca-session.cq:{<tag>}:deadlines     the deadline index of this shard's sessions

The sweep lock and the two streams keep their single-Redis names (one key each, any slot).
Shard ``i``'s tag is the smallest decimal number whose CRC16 slot is ``i * 16384 // shards``,
so the shards sit evenly spaced over the 16384 slots and any contiguous slot ranges (how
``redis-cli --cluster create`` and rebalancing assign them) get equal numbers of shards.

Session ids holding ``{`` or ``}`` are safe: Redis hashes the text between the *first* ``{``
and the first ``}`` after it. The prefix may not contain braces and the tag is digits only,
so that is always our tag, whatever follows in the id.

The data key necessarily differs from Go's ``<prefix>:<id>``: Go's ``RedisStore`` cannot read
or write a cluster layout (reconciliation scans each primary for this layout's ``<prefix>:{*``).
The shard count is part of the layout: changing it moves every session to another key, so it
is chosen once per deployment, like the prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

#: The Go ``RedisStore``'s key prefix.
DEFAULT_PREFIX = "agentorca-session"

#: Index shards on a cluster: at most one per slot, and enough that even a 100-master cluster
#: holds ~10 per master (so masters share the sessions within a few percent), while a sweep
#: costs only one ZRANGE per shard.
DEFAULT_SHARDS = 1024


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
    """Builds the keys of one single-Redis deployment from its prefix (the Go layout)."""

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

    @property
    def shards(self) -> int:
        """How many deadline indexes the sessions are split over (one on a single Redis)."""
        return 1

    @property
    def go_compatible(self) -> bool:
        """Whether data keys are where the Go ``RedisStore`` reads and writes them."""
        return True

    def shard(self, session_id: str) -> int:
        """The index shard holding ``session_id``."""
        return 0

    def data(self, session_id: str) -> str:
        """Where the checkpoint value lives (Go-compatible)."""
        return f"{self.prefix}:{session_id}"

    def data_pattern(self) -> str:
        """The pattern Go's ``List`` scans with; the reconciliation pass scans with it too."""
        return f"{self.prefix}:*"

    def session_id_from_data_key(self, key: str) -> str:
        return key[len(self.prefix) + 1 :]

    def fence(self, session_id: str) -> str:
        return f"{self._internal}:fence:{session_id}"

    def index(self) -> str:
        """The deadline index (single Redis only; see ``index_keys``)."""
        return f"{self._internal}:deadlines"

    def index_keys(self) -> list[str]:
        """Every deadline index, in shard order: what listing and sweeping walk through."""
        return [self.index()]

    def session(self, session_id: str) -> SessionKeys:
        return SessionKeys(self.data(session_id), self.fence(session_id), self.index())

    def sweep_lock(self) -> str:
        return f"{self._internal}:sweep-lock"

    def dead_letters(self) -> str:
        return f"{self._internal}:dead-letters"

    def events(self) -> str:
        return f"{self._internal}:events"

    def refused(self, request_id: str) -> str:
        """A dead-lettered request's refusal record (kind, reason, entry), by request id, so
        that its producer learns it was refused (short-lived: see ``DeadLetters``)."""
        return f"{self._internal}:refused:{request_id}"

    def reconcile_cursor(self) -> str:
        """Where the reconciliation pass stands (phase, node or shard, cursor), shared by
        every worker so that each beat tick carries on from the last (store/reconcile.py)."""
        return f"{self._internal}:reconcile"

    def beat_prefix(self) -> str:
        """Prefix of beat's schedule and lock (celery-redbeat), so that deployments sharing
        a Redis do not share one beat lock."""
        return f"{self._internal}:beat:"

    def heartbeat(self, worker: str) -> str:
        """A worker's heartbeat: renewed every few seconds, expires when the worker stops."""
        return f"{self._internal}:heartbeat:{worker}"

    def workers(self) -> str:
        """Set of the names of workers that sent a heartbeat (some may have stopped since)."""
        return f"{self._internal}:workers"


@dataclass(frozen=True, slots=True)
class ClusterKeySpace(KeySpace):
    """The Redis Cluster layout: every session's keys and its index shard share one slot."""

    shard_count: int = DEFAULT_SHARDS

    def __post_init__(self) -> None:
        # Not super(): slotted dataclasses are rebuilt, which breaks zero-argument super().
        KeySpace.__post_init__(self)
        if not 1 <= self.shard_count <= REDIS_CLUSTER_HASH_SLOTS:
            raise ValueError(
                f"shard count must be between 1 and {REDIS_CLUSTER_HASH_SLOTS}, "
                f"got {self.shard_count}"
            )

    @property
    def shards(self) -> int:
        return self.shard_count

    @property
    def go_compatible(self) -> bool:
        return False

    def shard(self, session_id: str) -> int:
        # blake2b, not Python's hash(): stable across processes and versions, and unrelated
        # to CRC16, so ids that share a prefix still spread evenly.
        digest = hashlib.blake2b(session_id.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.shard_count

    def tag(self, shard: int) -> str:
        """The hash tag (braces included) that places ``shard``'s keys in its slot."""
        return f"{{{shard_tags(self.shard_count)[shard]}}}"

    def data(self, session_id: str) -> str:
        return f"{self.prefix}:{self.tag(self.shard(session_id))}:{session_id}"

    def data_pattern(self) -> str:
        return f"{self.prefix}:{{*"

    def session_id_from_data_key(self, key: str) -> str:
        return key.split("}:", 1)[1]

    def fence(self, session_id: str) -> str:
        return f"{self._internal}:{self.tag(self.shard(session_id))}:fence:{session_id}"

    def index(self) -> str:
        raise TypeError(
            "a cluster layout has one deadline index per shard: use index_keys() or "
            "session(id).index"
        )

    def shard_index(self, shard: int) -> str:
        return f"{self._internal}:{self.tag(shard)}:deadlines"

    def index_keys(self) -> list[str]:
        return [self.shard_index(shard) for shard in range(self.shard_count)]

    def session(self, session_id: str) -> SessionKeys:
        shard = self.shard(session_id)
        return SessionKeys(self.data(session_id), self.fence(session_id), self.shard_index(shard))


@cache
def shard_tags(shards: int) -> tuple[str, ...]:
    """Hash-tag texts for ``shards`` shards: shard i's lands in slot ``i * 16384 // shards``.

    Each tag is the smallest decimal number hashing to its slot. This definition is part of
    the stored layout: never change it. Covering every slot takes ~110k CRC16s (~40 ms),
    once per process.
    """
    wanted = {shard * REDIS_CLUSTER_HASH_SLOTS // shards: shard for shard in range(shards)}
    tags: list[str] = [""] * shards
    missing = len(wanted)
    candidate = 0
    while missing:
        text = str(candidate)
        shard = wanted.pop(key_slot(text.encode()), None)
        if shard is not None:
            tags[shard] = text
            missing -= 1
        candidate += 1
    return tuple(tags)
