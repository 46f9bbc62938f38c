"""The order of requests, and how long each one may still apply.

Every save and delete of a session is ordered by its key ``(seq, rank, request id)``: the
``seq`` first (the producer rule's causal microseconds), then a delete over a save, then the
request id compared byte by byte. The order is total and does not depend on arrival, so the
store, the pending records on the broker and every producer agree on which of two requests
wins, and the worker's end state is the one of applying each request once, in that order
(docs/semantics.md, "The invariants"). The Lua scripts compare request ids with
``string.byte`` rather than ``<``, which follows the server's locale.

A ``seq`` at or after ``SEQ_TIME_FLOOR`` is a time (the producer rule stamps microseconds
since the epoch), and such a request has a **deadline**: ``seq`` + the session TTL. A save is
never applied at or after its deadline (it *lapses*: had it been applied on time, its
session would have expired by then), so a request can come back from a queue, an ``unacked``
hash or a dead letter only until its deadline, and a fence or tombstone that outlives the
deadlines of the requests ordered before it keeps every one of them out. A smaller ``seq`` is
a counter (raw producers that never followed the producer rule): it has no deadline and its
session lives TTL from when it was applied, as before.
"""

from __future__ import annotations

#: 2020-01-01T00:00:00Z in microseconds: a ``seq`` from here on is a time.
SEQ_TIME_FLOOR = 1_577_836_800_000_000

#: A request's rank in the order at equal ``seq``: a delete wins over a save.
SAVE_RANK, DELETE_RANK = 0, 1

OrderKey = tuple[int, int, bytes]


def order_key(seq: int, deleted: bool, request_id: str) -> OrderKey:
    """The request's place in its session's order (compare two with ``<``)."""
    return (seq, DELETE_RANK if deleted else SAVE_RANK, request_id.encode("utf-8", "surrogatepass"))


def is_time_seq(seq: int) -> bool:
    """Whether ``seq`` is a time (microseconds since the epoch) rather than a counter."""
    return seq >= SEQ_TIME_FLOOR


def deadline_ms(seq: int, ttl_ms: int) -> int | None:
    """When a request stamped ``seq`` lapses (ms since the epoch); None for a counter."""
    return seq // 1000 + ttl_ms if is_time_seq(seq) else None


def lapsed(seq: int, ttl_ms: int, now_ms: int) -> bool:
    """Whether a save stamped ``seq`` is past its deadline at ``now_ms``."""
    deadline = deadline_ms(seq, ttl_ms)
    return deadline is not None and deadline <= now_ms
