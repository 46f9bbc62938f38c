"""Request loads with a known end state: per session the highest ``seq`` wins (a delete at
equal ``seq``), whatever order and however often the requests arrive."""

from __future__ import annotations

import random
from dataclasses import dataclass

from checkpointq.store.base import CheckpointStore


@dataclass(frozen=True, slots=True)
class Request:
    """One save (``version`` set) or delete (``version`` None) of ``session_id``."""

    session_id: str
    seq: int
    version: int | None

    @property
    def is_delete(self) -> bool:
        return self.version is None


def mixed_load(
    prefix: str, sessions: int, per_session: int, *, seed: int, duplicates: int = 2
) -> list[Request]:
    """``per_session`` requests for each session (about one in four a delete, and some
    sessions ending on one), each repeated ``duplicates`` times, shuffled."""
    rng = random.Random(seed)
    requests: list[Request] = []
    for s in range(sessions):
        session = f"{prefix}-{s}"
        for i in range(per_session):
            seq = 1_000_000 + s * 1000 + i * 10
            delete = rng.random() < 0.25 or (s % 5 == 0 and i == per_session - 1)
            requests.append(Request(session, seq, None if delete else i + 1))
    load = [r for r in requests for _ in range(duplicates)]
    rng.shuffle(load)
    return load


def expected_state(load: list[Request]) -> dict[str, Request]:
    """The request that must be the last applied one, per session."""
    winners: dict[str, Request] = {}
    for request in load:
        best = winners.get(request.session_id)
        if best is None or (request.seq, request.is_delete) > (best.seq, best.is_delete):
            winners[request.session_id] = request
    return winners


def mismatches(store: CheckpointStore, expected: dict[str, Request]) -> list[str]:
    """Sessions whose fence, tombstone or value differs from ``expected`` (empty: exact)."""
    wrong = []
    for session_id, winner in sorted(expected.items()):
        fence = store.fence(session_id)
        loaded = store.load(session_id)
        if fence is None or fence.seq != winner.seq or fence.deleted != winner.is_delete:
            wrong.append(f"{session_id}: fence {fence} but expected {winner}")
        elif winner.is_delete and loaded is not None:
            wrong.append(f"{session_id}: deleted at {winner.seq} but holds v{loaded.version}")
        elif not winner.is_delete and (loaded is None or loaded.version != winner.version):
            got = None if loaded is None else loaded.version
            wrong.append(f"{session_id}: v{got} but expected v{winner.version}")
    return wrong


def all_applied(store: CheckpointStore, expected: dict[str, Request]) -> bool:
    """Whether every session's fence has reached its winning ``seq``."""
    for session_id, winner in expected.items():
        fence = store.fence(session_id)
        if fence is None or fence.seq < winner.seq:
            return False
    return True
