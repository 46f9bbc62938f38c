"""Holds a history against the invariants of docs/semantics.md ("The invariants").

Requests are ordered by their key (seq, delete after save, request id); "accepted" means the
producer's publish returned. A request still to land when the broker lost its data is lost
with it (the documented limit: run the broker with persistence) and exempt from then on.

(a) No accepted write lost: a load answers with a request ordered at or after every request
    accepted before it began, and with that request's value; "absent" only as the answer
    of a delete, or of a save past its deadline (by then every older value has expired).
(b) Deletes stick: follows from (a), since a delete accepted before a load is the newest
    or is passed only by a save ordered after it; checked with (a), on loads and lists.
(c) The final state, once the workers drained everything, is the newest accepted request's.
(d) One producer's fault never hurts another: a healthy producer's publish is never
    refused, none of its requests is dead-lettered or reported refused, and "expired" is
    reported only past the request's deadline.
(e) A loss is detected: a load that misses one of its own producer's requests, lost when
    the broker lost its data or went back in time (a rewind), is made by a producer that
    has counted a loss since (``epoch_changes``), even when other producers, unaware of
    the lost publishes, published since (tests/model/README.md, finding 7).
"""

from __future__ import annotations

from collections.abc import Iterator

from checkpointq.store.base import Fence
from tests.history.world import HEALTHY, SESSIONS, History, Read, Request

#: Rounding between the producers' microseconds and Redis's milliseconds.
TOLERANCE_US = 50_000


def check(history: History) -> list[str]:
    """Every violation the history shows (empty: it holds)."""
    if history.crash is not None:
        return [f"a step raised: {history.crash}"]
    return list(_Checker(history).violations())


class _Checker:
    def __init__(self, history: History) -> None:
        self.history = history
        self.requests = history.requests
        self.lost_at: dict[str, int] = {}
        for loss in history.losses:
            for request_id in loss.lost:
                self.lost_at.setdefault(request_id, loss.at_us)

    def exempt(self, request: Request, at: int) -> bool:
        return self.lost_at.get(request.request_id, at + 1) <= at

    def newest(self, session: str, at: int) -> Request | None:
        """The newest request of ``session`` accepted by ``at`` and not lost by then."""
        accepted = [
            r
            for r in self.requests.values()
            if r.session == session and r.accepted_us <= at and not self.exempt(r, at)
        ]
        return max(accepted, key=lambda r: r.key, default=None)

    def violations(self) -> Iterator[str]:
        yield from self.publishes()
        yield from self.reads()
        yield from self.listings()
        yield from self.outcomes()
        yield from self.dead_letters()
        yield from self.finals()
        for loss in self.history.rekey_losses:
            yield f"(e) after rekey, without the old key: {loss}"

    def publishes(self) -> Iterator[str]:
        for name, session, why in self.history.refused_at_publish:
            if name in HEALTHY:
                yield f"(d) healthy {name}'s request for {session!r} refused at publish: {why}"

    def reads(self) -> Iterator[str]:
        for read in self.history.reads:
            what = f"load by {read.producer} of {read.session}"
            if read.error is not None:
                yield f"{what} raised: {read.error}"
                continue
            newest = self.newest(read.session, read.start_us)
            yield from self.judge(
                what, read.fence, read.version, newest, read.start_us, read.end_us
            )
            yield from self.detected(what, read)

    def detected(self, what: str, read: Read) -> Iterator[str]:
        """(e): each of the reader's own requests of the session whose pending entry a loss of
        the broker's data took (before it was applied) before the read began, answered by
        nothing as new and not yet past its deadline, is missed by a producer that counted
        a loss since."""
        for loss in self.history.losses:
            if loss.counted is None or loss.at_us > read.start_us:
                continue
            if read.counted > loss.counted.get(read.producer, 0):
                continue
            for request_id in loss.taken & loss.lost:
                request = self.requests[request_id]
                if (
                    request.producer == read.producer
                    and request.session == read.session
                    and (read.fence is None or read.fence.key < request.key)
                    and read.start_us < request.deadline_us - TOLERANCE_US
                ):
                    yield (
                        f"(e) {what} misses its own {_name(request)}, lost with the broker's "
                        f"data, and {read.producer} counted no loss"
                    )

    def judge(
        self,
        what: str,
        fence: Fence | None,
        version: int | None,
        newest: Request | None,
        start: int,
        end: int,
    ) -> Iterator[str]:
        """A read's answer (its fence, the version read) against the newest request
        accepted before it began."""
        if fence is None:
            if version is not None:
                yield f"{what}: version {version} without a fence"
            elif newest is not None and start < newest.deadline_us - TOLERANCE_US:
                yield f"{what}: answered nothing, but {_name(newest)} was accepted (lost: (a))"
            return
        named = self.requests.get(fence.request_id)
        if named is None:
            yield f"{what}: answered {fence} that no producer's publish returned for"
        elif newest is not None and fence.key < newest.key:
            if version is not None or start < newest.deadline_us - TOLERANCE_US:
                yield (
                    f"{what}: answered {_name(named)} (version {version}), older than "
                    f"{_name(newest)}, accepted before it began ((a), (b))"
                )
        elif named.deleted or fence.lapsed:
            if version is not None:
                yield f"{what}: {_name(named)} answered with version {version}"
        elif version is None:
            if end < named.deadline_us - TOLERANCE_US:
                yield f"{what}: {_name(named)} answered as absent before its deadline"
        elif version != named.version:
            yield f"{what}: {_name(named)} answered with version {version}, not its own"

    def listings(self) -> Iterator[str]:
        """A list answers for each session as a load would: listed only for a live save
        ordered at or after the newest accepted request, left out only for a delete (or an
        expired save) at or after it. Requests lost with the broker may still land (a worker
        held them): they count on both sides."""
        for listing in self.history.listings:
            start, end = listing.start_us, listing.end_us
            for session in SESSIONS:
                what = f"list by {listing.producer}: {session}"
                newest = self.newest(session, start)
                later = [
                    r
                    for r in self.requests.values()
                    if r.session == session
                    and r.accepted_us <= start
                    and (newest is None or r.key >= newest.key)
                ]
                if session in listing.sessions:
                    if not any(
                        not r.deleted and r.deadline_us > start - TOLERANCE_US for r in later
                    ):
                        yield f"{what} listed, but its newest request is {_name(newest)} ((a), (b))"
                elif newest is not None and not any(
                    r.deleted or r.deadline_us <= end + TOLERANCE_US for r in later
                ):
                    yield f"{what} not listed, but {_name(newest)} was accepted (lost: (a))"

    def outcomes(self) -> Iterator[str]:
        for read in self.history.outcomes:
            request = self.requests[read.request_id]
            refused = read.outcome.startswith("refused")
            if refused and request.producer in HEALTHY and not self.exempt(request, read.at_us):
                yield f"(d) {_name(request)} reported {read.outcome}"
            if read.outcome == "lost" and not self.exempt(request, read.at_us):
                yield f"(a) {_name(request)} reported lost, but no fault took it"
            if read.outcome == "expired" and read.at_us < request.deadline_us - TOLERANCE_US:
                yield f"(d) {_name(request)} reported expired before its deadline"

    def dead_letters(self) -> Iterator[str]:
        for session, task_id, seq in self.history.dead_letters:
            request = self.requests.get(task_id or "")
            if (
                request is None
                or request.session != session
                or request.seq != seq
                or request.producer not in HEALTHY
            ):
                continue  # a hijack's, or a faulty producer's: refused on its own account
            if not self.exempt(request, self.history.end_us):
                yield f"(d) {_name(request)} was dead-lettered"

    def finals(self) -> Iterator[str]:
        end = self.history.end_us
        for session, final in self.history.final.items():
            what = f"the final state of {session}"
            newest = self.newest(session, end)
            yield from self.judge(what, final.fence, final.version, newest, end, end)
            if final.loaded != final.version:
                yield f"{what}: loaded as version {final.loaded}, stored as {final.version}"


def _name(request: Request | None) -> str:
    if request is None:
        return "nothing"
    kind = "delete" if request.deleted else f"save v{request.version}"
    return f"{kind} {request.request_id[:8]} (seq {request.seq}, by {request.producer})"
