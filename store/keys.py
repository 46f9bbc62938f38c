"""Every Redis key checkpointq touches is built here, from one configurable prefix.

Two decisions shape the layout. The checkpoint lives where Go keeps it (``<prefix>:<id>``),
and all our bookkeeping lives under ``<prefix>.cq:``, so a Go-style ``SCAN <prefix>:*`` sees
exactly the checkpoints. And keys are only ever concatenated, never used as patterns, with
the id as the whole suffix, so a session id holding ``*``, ``:`` or ``{`` names its own keys
and nobody else's. ``check_prefix`` keeps deployments that share a Redis apart the same way.
``KeySpace`` is the single-Redis layout and ``ClusterKeySpace`` the Redis Cluster one; their
docstrings list the keys (docs/scaling.md explains the cluster's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

#: The Go ``RedisStore``'s key prefix.
DEFAULT_PREFIX = "agentorca-session"


#: The suffix that turns a prefix into its bookkeeping prefix (``<prefix>.cq:...``).
INTERNAL_SUFFIX = ".cq"


def check_prefix(prefix: str) -> str:
    """Refuse a key prefix that could reach into another deployment's keys.

    Every key of a deployment starts with ``<prefix>:`` (data, whatever the session id) or
    ``<prefix>.cq:`` (bookkeeping). Deployments sharing one Redis stay apart exactly when
    neither family of one is a prefix of the other's, and that holds for any two different
    prefixes without ``:`` that do not end in ``.cq``: the first ``:`` of every key then
    sits right after the prefix (or after its ``.cq``). A prefix ``agentorca-session:b``
    would let a session id ``b.cq:fence:s0`` of deployment ``agentorca-session`` overwrite
    the fence of ``s0`` in deployment ``agentorca-session:b``; a prefix
    ``agentorca-session.cq`` would share its data keys with the bookkeeping of
    ``agentorca-session``. Both are refused, for every
    deployment, so no pair can nest whatever the other one chose.

    Raises:
        ValueError: empty, with glob, hash-tag, whitespace or ``:`` characters, or ending in
            ``.cq``.
    """
    if not prefix or any(c in prefix for c in "*?[]{}\\ \r\n\t"):
        raise ValueError(
            f"key prefix {prefix!r} must be non-empty and free of glob, hash-tag and "
            "whitespace characters"
        )
    if ":" in prefix or prefix.endswith(INTERNAL_SUFFIX):
        raise ValueError(
            f"key prefix {prefix!r} may not contain ':' nor end in {INTERNAL_SUFFIX!r}: the "
            "keys of deployments sharing a Redis could then nest into each other's "
            "(use e.g. 'agentorca-session-b')"
        )
    return prefix


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
    """Builds the keys of one single-Redis deployment from its prefix (the Go layout).

    With the default prefix (Go's)::

        agentorca-session:<id>              the checkpoint (zstd JSON), exactly where Go keeps it
        agentorca-session.cq:fence:<id>     hash: last applied seq, tombstone flag, deadline
        agentorca-session.cq:deadlines      sorted set: session id -> deadline (ms since epoch)
        agentorca-session.cq:sweep-lock     short lock held by one sweep at a time
        agentorca-session.cq:dead-letters   stream of requests that could not be applied
        agentorca-session.cq:refusals:<id>  hash: request id -> why it was dead-lettered, and where
        agentorca-session.cq:events         stream of expired and dropped session ids
        agentorca-session.cq:reconcile      hash: where the reconciliation pass stands
        agentorca-session.cq:sweep-hint     sorted set, cluster only: slot -> earliest deadline
        agentorca-session.cq:write-probe    written by workers and health checks: "can we write?"
        agentorca-session.cq:staging:<rnd>  a large value on its way into save.lua (seconds at most)

    And on the **broker** (a single Redis, whatever the store is), the pending records our
    producers write with each push (docs/protocol.md, "Pending records")::

        agentorca-session.cq:pending-requests:<id>      hash: request id -> "<seq> <op>", one
                                                        per request for <id> the queue may hold
        agentorca-session.cq:pending-value:<n>:<id>:<req>  a pending save's value (n: the
                                                        length of <id> in bytes)
        agentorca-session.cq:pending        sorted set: session id -> its latest deadline (ms)
        agentorca-session.cq:pending-epoch  a token that changes only when the broker lost data
        agentorca-session.cq:pending-mark   hash: 'n', a counter each publish advances (a
                                            broker gone back in time shows one lower), and
                                            the last loss found
        agentorca-session.cq:pending-counts hash: session id -> entries written and not
                                            settled (fewer left: some went missing)
        agentorca-session.cq:pending-counted:<id>  hash: the requests that count includes
                                            (request id -> "<seq> <op>"), each spent once
        agentorca-session.cq:pending-suspects  hash: entries whose message the last reap
                                            did not find (settled as lost at the next)
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    @property
    def _internal(self) -> str:
        return f"{self.prefix}{INTERNAL_SUFFIX}"

    @property
    def shards(self) -> int:
        """How many deadline indexes the sessions are split over (one on a single Redis)."""
        return 1

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

    def refusals(self, session_id: str) -> str:
        """The session's refusal records: a hash of request id -> the JSON of its dead
        letter's kind, reason and entry, so that a producer learns its request was refused
        (short-lived: see ``DeadLetters``). By session, so that a request id names nothing
        outside its session: a message for another session carrying the same id (a faulty
        or hostile producer) cannot make a request look refused."""
        return f"{self._internal}:refusals:{session_id}"

    def reconcile_cursor(self) -> str:
        """Where the reconciliation pass stands (phase, node or shard, cursor), shared by
        every worker so that each beat tick carries on from the last (store/reconcile.py)."""
        return f"{self._internal}:reconcile"

    def sweep_hint(self) -> str:
        """Cluster only: each slot's earliest known deadline, so that a sweep reads only the
        slot indexes that may hold due sessions (``RedisStore.expire_stale``)."""
        return f"{self._internal}:sweep-hint"

    def beat_prefix(self) -> str:
        """Prefix of beat's schedule and lock (celery-redbeat), so that deployments sharing
        a Redis do not share one beat lock."""
        return f"{self._internal}:beat:"

    def heartbeat(self, worker: str) -> str:
        """A worker's heartbeat: renewed every few seconds, expires when the worker stops."""
        return f"{self._internal}:heartbeat:{worker}"

    def identity(self) -> str:
        """The store's identity: a random id its first user writes once (``identity``)."""
        return f"{self._internal}:identity"

    def published_store(self) -> str:
        """On the broker: the identity of the store its workers write to, as they publish
        it with each heartbeat (``checkpointq.tasks.store_identity``)."""
        return f"{self._internal}:workers-store"

    def workers(self) -> str:
        """Set of the names of workers that sent a heartbeat (some may have stopped since)."""
        return f"{self._internal}:workers"

    def held_rows(self) -> str:
        """Hash: session id -> who holds its row in the database, as the worker that met the
        lock last saw it (JSON; the key expires a while after the last one): what
        ``checkpointq health`` and ``top`` report (tasks/held_rows.py)."""
        return f"{self._internal}:held-rows"

    def write_probe(self) -> str:
        """A short-lived key written only to learn whether the store accepts writes."""
        return f"{self._internal}:write-probe"

    def staging(self, session_id: str, token: str) -> str:
        """Where one save of ``session_id`` puts its value just before ``save.lua`` renames it
        onto the data key (``checkpointq.store.redis``, staged saves).

        ``token`` is random and new for every call, so concurrent savers never share a staging
        key, and the key names no session id: no id, however chosen, reaches it. It lives
        under ``<prefix>.cq:``, so neither Go's ``SCAN <prefix>:*`` nor reconciliation sees it,
        and no index holds it: nothing lists, counts or sweeps it. On a cluster it carries the
        tag of the session's slot (``ClusterKeySpace.staging``), as the script's keys must.
        """
        return f"{self._internal}:staging:{token}"

    # The pending records live on the broker, a single Redis even when the store is a
    # cluster: the same names in every layout, and no hash tags.

    def pending_requests(self, session_id: str) -> str:
        """The session's pending entries, on the broker: request id -> "<seq> <op>", one
        per request the queue may still hold."""
        return f"{self._internal}:pending-requests:{session_id}"

    def pending_value_prefix(self, session_id: str) -> str:
        """What a pending save's value key is named by, before its request id: the session
        id comes with its length, so no (session, request) pair names another's value."""
        return f"{self._internal}:pending-value:{len(session_id.encode())}:{session_id}:"

    def pending_value(self, session_id: str, request_id: str) -> str:
        """A pending save's value, on the broker: a staged save's producer writes it before
        its message, a plain save's publish script with it; the worker deletes it on
        settling the request."""
        return f"{self.pending_value_prefix(session_id)}{request_id}"

    def pending(self, session_id: str) -> str:
        """The session's record in the layout before issue 31 (one hash per session, the
        newest request only), which producers of that release write: loads still read it
        and workers still settle it."""
        return f"{self._internal}:pending:{session_id}"

    def legacy_pending_value(self, request_id: str) -> str:
        """A staged save's value in the layout before issue 31, named by request id alone:
        read by the worker only when it holds the request's own session's checkpoint."""
        return f"{self._internal}:pending-value:{request_id}"

    def pending_index(self) -> str:
        """The pending records' index (session id -> deadline, ms), on the broker."""
        return f"{self._internal}:pending"

    def pending_epoch(self) -> str:
        """The broker's pending epoch: a new token means it lost its records."""
        return f"{self._internal}:pending-epoch"

    def pending_mark(self) -> str:
        """The broker's pending mark: a counter each publish advances, and the last loss of
        a suffix of accepted requests found (publish.lua)."""
        return f"{self._internal}:pending-mark"

    def pending_counts(self) -> str:
        """How many entries each session's publishes wrote and settles did not remove, so
        that a load tells a missing entry from a settled one (read_pending.lua)."""
        return f"{self._internal}:pending-counts"

    def pending_counted(self, session_id: str) -> str:
        """The session's counted requests, on the broker: request id -> "<seq> <op>", each
        request its count includes and no settle has spent yet. Unlike its entry, which an
        operator or eviction may remove, this is how a settle knows the count is its own to
        spend, once (tests/model/README.md, finding 6)."""
        return f"{self._internal}:pending-counted:{session_id}"

    def pending_suspects(self) -> str:
        """Pending entries whose message the last reap did not find (tasks/orphans.py)."""
        return f"{self._internal}:pending-suspects"

    def oversize_index(self) -> str:
        """The raw bodies of oversize queue items kept on the broker (raw key -> time)."""
        return f"{self._internal}:oversize"

    def oversize_body(self, token: str) -> str:
        """One oversize queue item, as it was in the queue, on the broker; ``token`` is
        random, so the name carries nothing from the item."""
        return f"{self._internal}:oversize:{token}"


@dataclass(frozen=True, slots=True)
class ClusterKeySpace(KeySpace):
    """The Redis Cluster layout: Go's data keys, each session's bookkeeping in its slot.

    A script may only touch keys of one slot, so a session's fence and index entry carry the
    hash tag of its data key's slot (every slot has one: the smallest decimal number whose
    CRC16 is that slot)::

        agentorca-session:<id>                        the checkpoint, as on a single Redis
        agentorca-session.cq:{<tag>}:fence:<id>       its fence hash
        agentorca-session.cq:{<tag>}:slot-deadlines   deadline index of the slot's sessions
        agentorca-session.cq:{<tag>}:staging:<rnd>    a staged value (see ``staging``)
        agentorca-session.cq:{<tag>}:refusals:<id>    its refusal records

    The tag comes first in a bookkeeping key, the prefix holds no braces and the tag is
    digits, so Redis hashes our tag whatever the id holds. There is one deadline index per
    slot (16384), walked node by node; the sweep lock, the streams and the sweep hint keep
    their single-Redis names.
    """

    @property
    def shards(self) -> int:
        return REDIS_CLUSTER_HASH_SLOTS

    def shard(self, session_id: str) -> int:
        """The slot of the session's data key, which its fence and index entry share."""
        return key_slot(self.data(session_id).encode("utf-8"))

    def tag(self, slot: int) -> str:
        """The hash tag (braces included) that places a key in ``slot``."""
        return f"{{{slot_tags()[slot]}}}"

    def fence(self, session_id: str) -> str:
        return f"{self._internal}:{self.tag(self.shard(session_id))}:fence:{session_id}"

    def index(self) -> str:
        raise TypeError(
            "a cluster layout has one deadline index per slot: use index_keys() or "
            "session(id).index"
        )

    def staging(self, session_id: str, token: str) -> str:
        return f"{self._internal}:{self.tag(self.shard(session_id))}:staging:{token}"

    def refusals(self, session_id: str) -> str:
        return f"{self._internal}:{self.tag(self.shard(session_id))}:refusals:{session_id}"

    def slot_index(self, slot: int) -> str:
        """The deadline index of the sessions whose data keys hash to ``slot``."""
        return f"{self._internal}:{self.tag(slot)}:slot-deadlines"

    def index_keys(self) -> list[str]:
        return list(_slot_indexes(self._internal))

    def session(self, session_id: str) -> SessionKeys:
        data = self.data(session_id)
        tag = self.tag(key_slot(data.encode("utf-8")))
        return SessionKeys(
            data,
            f"{self._internal}:{tag}:fence:{session_id}",
            f"{self._internal}:{tag}:slot-deadlines",
        )


@dataclass(frozen=True, slots=True)
class ShardedKeySpace:
    """The cluster layout before data keys were Go's, kept only to migrate away from it:
    ``<prefix>:{<tag>}:<id>`` data keys, split into ``shards`` shards whose indexes are
    ``<prefix>.cq:{<tag>}:deadlines``, where shard ``i``'s tag is slot ``i * 16384 // shards``'s.
    """

    prefix: str = DEFAULT_PREFIX
    shards: int = 1024

    def _tag(self, shard: int) -> str:
        return f"{{{slot_tags()[shard * REDIS_CLUSTER_HASH_SLOTS // self.shards]}}}"

    def index(self, shard: int) -> str:
        return f"{self.prefix}.cq:{self._tag(shard)}:deadlines"

    def data(self, shard: int, session_id: str) -> str:
        return f"{self.prefix}:{self._tag(shard)}:{session_id}"

    def fence(self, shard: int, session_id: str) -> str:
        return f"{self.prefix}.cq:{self._tag(shard)}:fence:{session_id}"


@cache
def slot_tags() -> tuple[str, ...]:
    """Hash-tag texts, one per slot: slot i's is the smallest decimal number hashing to it.

    This definition is part of the stored layout: never change it. Covering every slot takes
    ~110k CRC16s (~40 ms), once per process.
    """
    tags: list[str] = [""] * REDIS_CLUSTER_HASH_SLOTS
    missing = REDIS_CLUSTER_HASH_SLOTS
    candidate = 0
    while missing:
        text = str(candidate)
        slot = key_slot(text.encode())
        if not tags[slot]:
            tags[slot] = text
            missing -= 1
        candidate += 1
    return tuple(tags)


@cache
def _slot_indexes(internal: str) -> tuple[str, ...]:
    return tuple(f"{internal}:{{{tag}}}:slot-deadlines" for tag in slot_tags())
