"""Continuous reconciliation: the deadline index catches up with what other writers did.

A Go ``RedisStore`` writing our keys directly updates no index, so its sessions would be
missing from ``list()`` and the sweep, its deletes would leave entries (and a fence saying
"live") behind, and its re-saves would leave a deadline that is not the value's. Each pass
fixes that a bounded slice at a time, in two phases: ``data`` (``SCAN <prefix>:* TYPE
string`` on every primary: adopt what the index lacks, move deadlines to the value's own)
and ``index`` (``ZSCAN`` of every deadline index: drop entries whose value is gone). Every
fix is one atomic ``reconcile.lua`` call per slot, so a pass is as safe beside concurrent
writes as any save, and passes overlapping only repeat idempotent work. The cursor lives in
Redis (``KeySpace.reconcile_cursor``), so each beat tick, in any worker, carries on. A key
written during a pass may be missed by SCAN and is found by the next one: a foreign write
is indexed at the latest one full pass later (docs/scaling.md has the measured pass time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster

from checkpointq.store.scripts import queue

if TYPE_CHECKING:
    from checkpointq.store.redis import RedisStore

logger = logging.getLogger(__name__)

#: Keys asked of one SCAN or ZSCAN call (its COUNT). Each call then walks about this many
#: entries: ~0.1-0.3 ms of Redis time, far from the 5 ms that no call may exceed.
SCAN_COUNT = 250

#: Sessions one ``reconcile.lua`` call handles (of one slot): 3-7 commands each. At 100, a
#: call took 0.73 ms of Redis time on average (1M sessions, a loaded 2-core machine); 50
#: keep a call near a third of a millisecond, far under the 5 ms no call may take.
SCRIPT_SESSIONS = 50

#: What an (almost) empty ZSCAN counts against a slice's budget: a round trip's worth.
MIN_ZSCAN_COST = 16

#: An index entry within this of the value's own deadline is left alone: the value's
#: deadline is computed from our clock plus Redis's PTTL, which differ by a few ms per pass.
TOLERANCE_MS = 1000

DATA, INDEX = "data", "index"

# reconcile.lua's replies, by name.
_OUTCOMES = {1: "adopted", 2: "moved", 3: "dropped"}


@dataclass(slots=True)
class ReconcileReport:
    """What one slice (or a whole pass) of reconciliation did."""

    #: Keys and index entries the slice looked at.
    examined: int = 0
    #: Values with no index entry, now indexed at their own deadline (Go wrote them alone).
    adopted: list[str] = field(default_factory=list)
    #: Entries whose deadline moved to the value's own (another writer re-saved it).
    moved: list[str] = field(default_factory=list)
    #: Entries whose value was gone (deleted directly), removed.
    dropped: list[str] = field(default_factory=list)
    #: True when this slice finished a pass: every key and entry has been seen since the
    #: pass began.
    completed_pass: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "examined": self.examined,
            "adopted": len(self.adopted),
            "moved": len(self.moved),
            "dropped": len(self.dropped),
            "completed_pass": self.completed_pass,
        }


@dataclass(slots=True)
class _Position:
    """Where a pass stands: its phase, which node or shard, and the cursor within it."""

    phase: str = DATA
    part: int = 0
    cursor: int = 0
    #: The node scanned in the data phase ("host:port"); a changed node list restarts it.
    node: str = ""


class Reconciler:
    """Runs reconciliation over one ``RedisStore``'s keys, a bounded slice at a time."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.client = store.client
        self.keys = store.keys

    def step(self, budget: int) -> ReconcileReport:
        """Look at about ``budget`` keys and entries, carrying on from where the last slice
        stopped. A SCAN call counts ``SCAN_COUNT`` (it walks that many slots of the
        keyspace, whatever it finds); a ZSCAN counts what it returned, at least
        ``MIN_ZSCAN_COST`` (so the 16,384 small per-slot indexes of a cluster take a few
        slices, not thousands). At least one call is made."""
        position = self._load()
        report = ReconcileReport()
        spent = 0
        while spent < budget:
            cost, complete = self._advance(position, report, budget - spent)
            spent += cost
            if complete:
                report.completed_pass = True
                position = _Position()
                break
        self._store(position)
        return report

    def run_pass(self) -> ReconcileReport:
        """A whole pass from the start, to completion (what ``reindex`` runs); the shared
        cursor is left alone."""
        position = _Position()
        report = ReconcileReport()
        while not self._advance(position, report, 50 * SCAN_COUNT)[1]:
            pass
        report.completed_pass = True
        return report

    # -- one SCAN call, or one pipeline of ZSCANs ---------------------------------------

    def _advance(
        self, position: _Position, report: ReconcileReport, budget: int
    ) -> tuple[int, bool]:
        """Move the pass on by about ``budget``: one SCAN of a primary's keyspace, or
        ZSCANs of index keys in one pipelined round trip; then the scripts for what was
        found. Returns what it cost (see ``step``) and whether the pass is complete."""
        if position.phase == INDEX:
            ids, cost = self._scan_indexes(position, budget)
            complete = position.part >= len(self.keys.index_keys())
        else:
            ids, cost = self._scan_data(position), SCAN_COUNT
            complete = False
        report.examined += len(ids)
        self._reconcile(ids, report)
        return cost, complete

    def _scan_data(self, position: _Position) -> list[str]:
        nodes = self._primaries()
        names = [name for name, _node in nodes]
        if (
            position.phase != DATA
            or position.part >= len(nodes)
            or (position.node and position.node != names[position.part])
        ):
            # Not a position this pass could have left (the primaries changed): the data
            # phase starts again; SCAN's guarantee only holds for a whole walk.
            position.phase, position.part, position.cursor = DATA, 0, 0
        position.node = names[position.part]
        cursor, raw = self._scan(nodes[position.part][1], position.cursor)
        if int(cursor):
            position.cursor = int(cursor)
        elif position.part + 1 < len(nodes):
            position.part, position.cursor, position.node = position.part + 1, 0, ""
        else:
            position.phase, position.part, position.cursor, position.node = INDEX, 0, 0, ""
        return self._session_ids(raw)

    def _scan_indexes(self, position: _Position, budget: int) -> tuple[list[str], int]:
        indexes = self.keys.index_keys()
        batch = indexes[position.part : position.part + max(1, budget // MIN_ZSCAN_COST)]
        pipe = self.client.pipeline(transaction=False)
        for offset, index in enumerate(batch):
            # The first index resumes at the cursor; the rest of the batch start afresh.
            pipe.zscan(index, position.cursor if offset == 0 else 0, count=SCAN_COUNT)
        ids: list[str] = []
        cost = 0
        for cursor, entries in pipe.execute():
            ids.extend(member.decode("utf-8") for member, _score in entries)
            cost += max(MIN_ZSCAN_COST, len(entries))
            if int(cursor):
                # This index has more: resume it next time; the later replies are dropped
                # (and read again then), so nothing is skipped.
                position.cursor = int(cursor)
                break
            position.part, position.cursor = position.part + 1, 0
        return ids, cost

    def _session_ids(self, raw: list[bytes]) -> list[str]:
        ids = []
        for key in raw:
            try:
                ids.append(self.keys.session_id_from_data_key(key.decode("utf-8")))
            except UnicodeDecodeError:
                # A Go string may hold any bytes; a session id (str) cannot name these, so
                # the session stays out of list() rather than be listed and unloadable.
                logger.warning("reconcile: skipped key %r: not UTF-8, no session id names it", key)
        return ids

    def _primaries(self) -> list[tuple[str, Any]]:
        if isinstance(self.client, RedisCluster):
            nodes = self.client.get_primaries()  # type: ignore[no-untyped-call]
            return sorted(((node.name, node) for node in nodes), key=lambda pair: pair[0])
        return [("", None)]

    def _scan(self, node: Any, cursor: int) -> tuple[int, list[bytes]]:
        pattern = self.keys.data_pattern()
        if node is None:
            found: tuple[int, list[bytes]] = self.client.scan(
                cursor, match=pattern, count=SCAN_COUNT, _type="string"
            )
            return found
        cursors, keys = self.client.scan(
            cursor, match=pattern, count=SCAN_COUNT, _type="string", target_nodes=node
        )
        return int(next(iter(cursors.values()))), keys

    def _reconcile(self, ids: list[str], report: ReconcileReport) -> None:
        """Pipelined ``reconcile.lua`` calls (one round trip; on a cluster one per node, the
        nodes at once), each for up to ``SCRIPT_SESSIONS`` sessions of one slot (all of
        them, on a single Redis)."""
        if not ids:
            return
        by_slot: dict[int, list[str]] = {}
        for session_id in ids:
            by_slot.setdefault(self.keys.shard(session_id), []).append(session_id)
        groups = [
            (slot, group[start : start + SCRIPT_SESSIONS])
            for slot, group in by_slot.items()
            for start in range(0, len(group), SCRIPT_SESSIONS)
        ]
        now_ms = int(self.store.clock() * 1000)
        script = self.store.scripts.reconcile
        calls = [
            (
                slot,
                [key for session_id in group for key in self.keys.session(session_id).as_list()],
                [now_ms, TOLERANCE_MS, *group],
            )
            for slot, group in groups
        ]
        if isinstance(self.client, RedisCluster):
            # EVALSHA down each node's connection. A cluster pipeline sends EVAL with the
            # 3 KB script body, and what one SCAN finds spreads over as many slots (one or
            # two sessions a call): that was 75% of a pass's time.
            replies = self.store.on_slot_nodes("reconcile", script, calls)
        else:
            pipe = self.client.pipeline(transaction=False)
            for _slot, keys, args in calls:
                queue(script, pipe, keys, args)
            replies = pipe.execute()
        new_deadlines: set[int] = set()
        for (_slot, group), outcomes in zip(groups, replies, strict=True):
            if isinstance(outcomes, Exception):
                continue  # its slot moved (MOVED): the next pass reconciles these
            for session_id, outcome in zip(group, outcomes, strict=True):
                name = _OUTCOMES.get(int(outcome))
                if name is not None:
                    getattr(report, name).append(session_id)
                if name in ("adopted", "moved"):
                    new_deadlines.add(self.keys.shard(session_id))
        # A deadline another writer chose may be earlier than the cluster's sweep hint
        # expects of its slot: the next sweep reads those slots.
        self.store.mark_slots_due(new_deadlines, now_ms)

    # -- the shared cursor ---------------------------------------------------------------

    def _load(self) -> _Position:
        raw = self.client.hgetall(self.keys.reconcile_cursor())
        fields = {key.decode(): value.decode() for key, value in raw.items()}
        try:
            return _Position(
                fields.get("phase", DATA),
                int(fields.get("part", 0)),
                int(fields.get("cursor", 0)),
                fields.get("node", ""),
            )
        except ValueError:
            return _Position()  # not ours to interpret: start a pass afresh

    def _store(self, position: _Position) -> None:
        self.client.hset(
            self.keys.reconcile_cursor(),
            mapping={
                "phase": position.phase,
                "part": position.part,
                "cursor": position.cursor,
                "node": position.node,
            },
        )
