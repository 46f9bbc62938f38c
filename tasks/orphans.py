"""Pending records whose message is gone: found and settled as lost (issue 44).

A purge (``celery purge``, a ``DEL`` of the queue) or a broker that loses messages but not
their records leaves entries serving a turn no worker will ever apply: every replica's load
answers it until its deadline (30 days), and its producer's ``wait_durable`` never ends.
``reap`` finds them: entries published at least ``grace`` ago whose request is neither in
the queue nor in kombu's ``unacked`` hash (read after the queue, so a message a worker takes
meanwhile is seen there), in two passes in a row (the first notes them as suspects on the
broker, the next settles those still missing: a worker between its ack and its settle is
not taken for a loss). Each is settled as lost: its entry removed by settle.lua, matched by
id and stamp (a request a worker settled meanwhile is left alone), then a dead letter of
kind ``lost`` with the entry, and a refusal record, so ``wait_durable`` answers ``lost``
(unless the store's fence holds the request or one after it: applied, its settle lost).
The sweep task (``checkpoint.expire_stale``, every ``CHECKPOINTQ_SWEEP_INTERVAL_SECONDS``)
runs it: a lost record is settled within two sweeps once ``grace`` has passed.

The scan reads the whole queue, in pages: its cost grows with the backlog, and it runs only
when some entry is older than ``grace``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from checkpointq.store.base import CheckpointStore
from checkpointq.store.keys import KeySpace
from checkpointq.store.ordering import OrderKey, order_key
from checkpointq.tasks.dead_letters import DeadLetters, Reason, RefusedRequest
from checkpointq.tasks.producer.pending import DELETE_OP, Settlement, settle_command, settle_source

logger = logging.getLogger(__name__)

#: Entries younger than this (by their seq, the producer's clock) are not looked at: a
#: producer clock behind by up to the worker's seq limit, and messages on their way.
DEFAULT_GRACE_SECONDS = 600.0
#: Queue items read per LRANGE.
PAGE = 1000
#: kombu's Redis transport: the hash of messages delivered and not yet acknowledged, and
#: the separator of its priority queues' names (priorities 3, 6, 9 beside the plain one).
UNACKED = "unacked"
_PRIORITY_QUEUES = ("\x06\x163", "\x06\x166", "\x06\x169")
#: A message's ids as kombu and our producers write them ("id" in the headers; a batch's
#: requests are named "<task id>:<index>").
_ID = re.compile(rb'"id": ?"([^"]+)"')

REASON = (
    "its message is gone from the queue (purged, or lost with the broker's data) while its "
    "pending record stayed: it can never be applied"
)


@dataclass(frozen=True, slots=True)
class Orphan:
    """A pending entry whose message is gone."""

    session_id: str
    request_id: str
    seq: int
    op: str

    @property
    def key(self) -> OrderKey:
        return order_key(self.seq, self.op == DELETE_OP, self.request_id)

    @property
    def field(self) -> str:
        return json.dumps([self.session_id, self.request_id, self.seq, self.op])


def message_ids(raw: Iterable[bytes]) -> set[bytes]:
    """The ids (task ids) the messages ``raw`` carry."""
    return {found for item in raw for found in _ID.findall(item)}


def _queued_ids(broker: Any, queue: str) -> set[bytes]:
    ids: set[bytes] = set()
    for name in (queue, *(queue + suffix for suffix in _PRIORITY_QUEUES)):
        start = 0
        while page := broker.lrange(name, start, start + PAGE - 1):
            ids |= message_ids(page)
            start += PAGE
    for _tag, value in broker.hscan_iter(UNACKED, count=PAGE):
        ids |= message_ids([value])
    return ids


def _old_entries(broker: Any, keys: KeySpace, older_than_us: int) -> list[Orphan]:
    entries: list[Orphan] = []
    for session in broker.zrange(keys.pending_index(), 0, -1):
        session_id = session.decode()
        for req, entry in broker.hgetall(keys.pending_requests(session_id)).items():
            seq, _, op = entry.decode().partition(" ")
            if seq.isdigit() and int(seq) < older_than_us:
                entries.append(Orphan(session_id, req.decode(), int(seq), op))
    return entries


def _dropped(broker: Any, keys: KeySpace, now_us: int) -> list[str]:
    """Sessions live in the index with fewer entries left than counted (some went missing)."""
    ids = [i.decode() for i in broker.zrangebyscore(keys.pending_index(), now_us // 1000, "+inf")]
    if not ids:
        return []
    pipe = broker.pipeline(transaction=False)
    pipe.hmget(keys.pending_counts(), ids)
    for session_id in ids:
        pipe.hlen(keys.pending_requests(session_id))
    counts, *lengths = pipe.execute()
    return [i for i, n, left in zip(ids, counts, lengths, strict=True) if int(n or 0) > left]


def reap(
    broker: Any,
    keys: KeySpace,
    queue: str,
    store: CheckpointStore,
    dead_letters: DeadLetters,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
) -> list[Orphan]:
    """One pass: settle as lost the suspects of the last pass still missing, note the new
    ones. Returns those settled as lost. ``broker``: a ``redis.Redis`` on the broker. An
    entry whose request the store's fence already holds (or overtook: a settle that never
    came) is only removed."""
    seconds, micros = broker.time()
    now_us = int(seconds) * 1_000_000 + int(micros)
    old = _old_entries(broker, keys, now_us - int(grace_seconds * 1_000_000))
    suspects_key = keys.pending_suspects()
    dropped = _dropped(broker, keys, now_us)
    if not old and not dropped:
        broker.delete(suspects_key)
        return []
    present = _queued_ids(broker, queue)
    missing = [o for o in old if o.request_id.split(":")[0].encode() not in present]
    # Sessions whose entries went missing (``PendingRecordMissing``) wait for their queued
    # requests; with no message left anywhere, none can come: their counts are spent.
    empty = not present and not any(
        broker.llen(name) for name in (queue, *(queue + p for p in _PRIORITY_QUEUES))
    )
    fields = [o.field for o in missing] + ([f"dropped:{s}" for s in dropped] if empty else [])
    noted = {f.decode() for f in broker.hkeys(suspects_key)}
    settled = [o for o in missing if o.field in noted]
    spent = [s for s in dropped if empty and f"dropped:{s}" in noted]
    pipe = broker.pipeline(transaction=True)
    pipe.delete(suspects_key)
    if fresh := [f for f in fields if f not in noted]:
        pipe.hset(suspects_key, mapping=dict.fromkeys(fresh, now_us))
    for session_id in spent:
        pipe.hdel(keys.pending_counts(), session_id)
        pipe.delete(keys.pending_counted(session_id))
        pipe.zrem(keys.pending_index(), session_id)
    pipe.execute()
    if spent:
        logger.error(
            "%d session(s) had pending records missing (deleted by hand, or evicted) and no "
            "message left in the queue: their loads answer the store again",
            len(spent),
        )
    lost = []
    fences = store.fences([o.session_id for o in settled]) if settled else []
    for orphan, fence in zip(settled, fences, strict=True):
        # A save's value (as the store would hold it) goes into the dead letter, for people.
        value = broker.get(keys.pending_value(orphan.session_id, orphan.request_id))
        if not _settle(broker, keys, orphan):
            continue  # a worker settled it meanwhile
        if fence is not None and fence.key >= orphan.key:
            continue  # applied or overtaken, its settle lost: the entry only lingered
        lost.append(orphan)
        dead_letters.add(
            Reason.LOST,
            REASON,
            task=None,
            task_id=orphan.request_id,
            kwargs={"session_id": orphan.session_id, "seq": orphan.seq, "op": orphan.op},
            raw=value or b"",
            requests=[RefusedRequest(orphan.session_id, orphan.request_id, orphan.seq)],
        )
    if lost:
        logger.error("settled %d pending requests as lost: %s", len(lost), REASON)
    return lost


def _settle(broker: Any, keys: KeySpace, orphan: Orphan) -> bool:
    """Remove the orphan's entry if it is still there (by id and stamp); whether it was."""
    settlement = Settlement(
        orphan.session_id, orphan.request_id, orphan.seq, deleted=orphan.op == DELETE_OP
    )
    script_keys, args = settle_command(keys, [settlement])
    return bool(broker.eval(settle_source(), len(script_keys), *script_keys, *args))
