"""Scenario 13: a Go ``RedisStore`` writing directly to the sessions the queue writes.

During a rollout some apiserver paths still save (``SET EX 30d``) and delete (``DEL``) through
the Go store, on our keys, touching no fence and no index. The direct writer here is the Go
cross-check program, tests/go/gostore: encoding/json, klauspost's zstd and SET EX / DEL / SCAN,
as the Go package's ``RedisStore``. The expected state follows the rules of docs/semantics.md's
"Go compatibility" section, applied to each session's writes in real-time order (``expected``):

* a queued save applies iff its ``seq`` is above the last queued request applied; a queued
  delete iff it is at or above it (our fence; Go's writes never move it);
* a direct Go save or delete always takes effect, and nothing of ours undoes it: not the
  sweep, not reconciliation; only a later queued request does;
* a Go delete leaves no tombstone: a queued save stamped before it, arriving after it, brings
  the session back if it is newer than our last write (a save older than that stays refused).

Per session the real-time order is known because the Go writer acts on a session only once the
queue's requests for it have their outcome, and the requests that follow are sent only after
the Go write; meanwhile the worker drains the rest of the load and beat reconciles and sweeps,
all at once. Then, with the writes stopped, ``list()`` must converge to exactly the live keys
(time measured); finally our sweep runs with its clock moved past our TTL, and must expire
exactly the sessions we wrote last and keep every value Go wrote last.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from checkpointq.store.reconcile import SCAN_COUNT
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.outcomes import APPLIED
from tests.faults.harness import (
    QUEUE,
    SAVE,
    Deployment,
    Request,
    Scale,
    Verdict,
    conclude,
    generate_load,
    push,
)
from tests.support.checkpoints import make_checkpoint
from tests.support.gostore import GoStore
from tests.support.servers import wait_until

#: Our sessions' TTL here (an hour): the sweep's clock is moved past it, not past Go's 30 days.
TTL_SECONDS = 3600
#: Beat's reconciliation period here: one SCAN or ZSCAN call of SCAN_COUNT keys per second.
RECONCILE_SECONDS = 1

#: Suffixes of the ids of sessions Go writes alone: Go accepts any non-empty string.
ODD_IDS = ["", "\ttab", "\u2028line", "\u202ebidi", " space", "\U0001f642", "x" * 300]

Q_SAVE, Q_DELETE, GO_SAVE, GO_DELETE = "queued save", "queued delete", "go save", "go delete"
#: The sweep removing the value (our TTL passed, and we wrote it last).
EXPIRED = "expired"

# What happens to a session once the queue's first requests for it have their outcome, and
# how often (weights). "stamped before": the save is stamped before Go's delete and delivered
# after it (late); "older": a save whose seq is below the session's last applied request.
PLANS = {
    "queue only": 40,
    "go save": 15,
    "go save, queued save": 10,
    "go save, queued delete": 5,
    "go delete": 10,
    "go delete, save stamped before": 12,
    "go delete, older save": 8,
}


@dataclass(frozen=True, slots=True)
class Write:
    """One write of a session, queued (with its seq) or direct by Go."""

    kind: str
    version: int = 0
    seq: int = 0


def expected(writes: list[Write]) -> Write | None:
    """The write whose value the session holds after ``writes`` (in real-time order), by the
    documented rules; None when the session is absent."""
    fence: int | None = None
    holds: Write | None = None
    for write in writes:
        if write.kind == Q_SAVE and (fence is None or write.seq > fence):
            holds, fence = write, write.seq
        elif write.kind == Q_DELETE and (fence is None or write.seq >= fence):
            holds, fence = None, write.seq
        elif write.kind == GO_SAVE:
            holds = write
        elif write.kind in (GO_DELETE, EXPIRED):
            holds = None
    return holds


def written_by(writes: list[Write]) -> str | None:
    """The kind of write the session's value comes from (None: absent)."""
    holder = expected(writes)
    return None if holder is None else holder.kind


def seq_of(handle: Handle) -> int:
    assert handle.seq is not None, handle
    return handle.seq


def compare(deployment: Deployment, timelines: dict[str, list[Write]]) -> Verdict:
    """The store against ``expected``: lost (the expected value is missing, or a value no
    earlier write left), resurrected (absent expected), regressed (an earlier write's)."""
    store = deployment.store()
    verdict = Verdict()
    for sid, writes in timelines.items():
        want = expected(writes)
        cp = store.load(sid)
        got = None if cp is None else cp.version
        if got == (None if want is None else want.version):
            continue
        if want is None:
            verdict.resurrected.append(sid)
        elif got is not None and got in [w.version for w in writes[: writes.index(want)]]:
            verdict.regressed.append(sid)
        else:
            verdict.lost.append(sid)
    return verdict


def converge(deployment: Deployment, go: GoStore, want: set[str], timeout: float) -> float | None:
    """Seconds until the queue is drained and both ``list()`` and the keyspace (what Go's
    ``List`` sees) are exactly ``want``; None if that did not happen within ``timeout``."""
    store = deployment.store()
    start = time.monotonic()

    def done() -> bool:
        if deployment.backlog():
            return False
        listed = store.list()
        return len(listed) == len(want) and set(listed) == want and set(go.list()) == want

    try:
        wait_until(done, timeout=timeout, interval=0.1, message="list() to show the live keys")
    except AssertionError:
        return None  # the verdict says what differs
    return time.monotonic() - start


def seconds(duration: float | None) -> str:
    return "never" if duration is None else f"{duration:.1f} s"


@dataclass
class Writers:
    """Our producer and the Go writer, each write recorded in its session's timeline."""

    deployment: Deployment
    client: CheckpointClient
    go: GoStore
    timelines: dict[str, list[Write]] = field(default_factory=lambda: defaultdict(list))
    _versions: Iterator[int] = field(default_factory=lambda: iter(range(10**7, 2 * 10**7)))

    def queued_save(self, sid: str, version: int | None = None) -> Handle:
        version = next(self._versions) if version is None else version
        handle = self.client.save(make_checkpoint(sid, version))
        self.timelines[sid].append(Write(Q_SAVE, version, seq_of(handle)))
        return handle

    def queued_delete(self, sid: str) -> Handle:
        handle = self.client.delete(sid)
        self.timelines[sid].append(Write(Q_DELETE, seq=seq_of(handle)))
        return handle

    def delayed_save(self, sid: str, seq: int) -> Request:
        """A save stamped ``seq``, not sent yet (a message late in transit)."""
        return Request(SAVE, sid, seq, next(self._versions))

    def deliver(self, late: Request) -> None:
        push(self.deployment.broker_client(), [late.envelope()])
        self.timelines[late.session_id].append(Write(Q_SAVE, late.version, late.seq))

    def go_save(self, sid: str) -> None:
        version = next(self._versions)
        self.go.save(checkpoint_to_wire(make_checkpoint(sid, version)))
        self.timelines[sid].append(Write(GO_SAVE, version))

    def go_delete(self, sid: str) -> None:
        self.go.delete(sid)
        self.timelines[sid].append(Write(GO_DELETE))

    def follow(self, sid: str, plan: str, fence: int) -> None:
        """The Go write of ``plan``, and what follows it; ``fence``: the seq of the session's
        last queued request, applied."""
        late = self.delayed_save(sid, self.client.clock.next(sid))  # stamped before Go writes
        if plan.startswith(GO_SAVE):
            self.go_save(sid)
        else:
            self.go_delete(sid)
        if plan.endswith("queued save"):
            self.queued_save(sid)
        elif plan.endswith("queued delete"):
            self.queued_delete(sid)
        elif plan.endswith("stamped before"):
            self.deliver(late)
        elif plan.endswith("older save"):
            self.deliver(self.delayed_save(sid, fence - 1))

    def live(self) -> set[str]:
        return {sid for sid, writes in self.timelines.items() if expected(writes) is not None}

    def go_last(self) -> set[str]:
        return {sid for sid, writes in self.timelines.items() if written_by(writes) == GO_SAVE}

    def go_writes(self) -> int:
        return sum(w.kind in (GO_SAVE, GO_DELETE) for ws in self.timelines.values() for w in ws)


def reconcile_slices(deployment: Deployment) -> int:
    """Slices in one reconciliation pass now: SCAN walks every key, ZSCAN the index."""
    client = deployment.store_client()
    keys, entries = int(client.dbsize()), int(client.zcard(deployment.keys.index()))
    return math.ceil(keys / SCAN_COUNT) + math.ceil(entries / SCAN_COUNT)


def test_a_go_writer_on_the_same_keys_loses_nothing_and_list_converges(
    deployment: Deployment, scale: Scale, gostore_binary: Path
) -> None:
    # Given a worker, and a beat that reconciles and sweeps every second
    deployment.settings.update(
        ttl_seconds=TTL_SECONDS,
        sweep_interval_seconds=1,
        reconcile_interval_seconds=RECONCILE_SECONDS,
        reconcile_budget=SCAN_COUNT,
    )
    deployment.worker()
    deployment.beat()
    client = CheckpointClient(
        deployment.broker.url, deployment.store(), queue=QUEUE, clock=SeqClock()
    )
    writers = Writers(deployment, client, GoStore(gostore_binary, deployment.store_server.port))
    rng = random.Random(13)

    # When our producer sends a load of saves and deletes over the sessions,
    load = generate_load(scale.sessions, scale.requests, rng, prefix="mixed")
    last: dict[str, Handle] = {}
    for req in load:
        if req.kind == SAVE:
            last[req.session_id] = writers.queued_save(req.session_id, req.version)
        else:
            last[req.session_id] = writers.queued_delete(req.session_id)
    queued_at_first_go_write = deployment.backlog()
    # and a Go writer acts on sessions as the worker finishes each (followed for some by a
    # queued request), and saves sessions of its own, deleting a third of them again,
    plans = dict(
        zip(last, rng.choices(list(PLANS), list(PLANS.values()), k=len(last)), strict=True)
    )
    go_only = [f"go-only-{i:04d}{ODD_IDS[i % len(ODD_IDS)]}" for i in range(scale.sessions // 10)]
    # (in the order of each session's last queued request: the order the worker ends them)
    for i, sid in enumerate(sorted(last, key=lambda s: seq_of(last[s]))):
        if plans[sid] != "queue only":
            assert client.wait_durable(last[sid], timeout=120).outcome == APPLIED
            writers.follow(sid, plans[sid], seq_of(last[sid]))
        if i < len(go_only):
            writers.go_save(go_only[i])
            if i % 3 == 0:
                writers.go_delete(go_only[i])

    # Then, once the writes stop, list() converges to exactly the live keys
    live, go_last = writers.live(), writers.go_last()
    convergence = converge(deployment, writers.go, live, timeout=120)
    slices = reconcile_slices(deployment)
    verdict = compare(deployment, writers.timelines)
    queue_only_regressed = [s for s in verdict.regressed if plans.get(s) == "queue only"]
    came_back = [s for s, plan in plans.items() if plan.endswith("stamped before") and s in live]

    # and our sweep, its clock moved past our TTL just after Go re-saved some sessions we
    # wrote last, expires exactly what we wrote last and keeps every value Go wrote last.
    for sid in sorted(live - go_last)[::4]:
        writers.go_save(sid)
    ours_last = writers.live() - writers.go_last()
    swept: list[str] = []
    store = deployment.store()
    while batch := store.expire_stale(now=time.time() + TTL_SECONDS + 60):
        swept += batch
    for sid in ours_last:
        writers.timelines[sid].append(Write(EXPIRED))
    after_sweep = compare(deployment, writers.timelines)
    settled = converge(deployment, writers.go, writers.go_last(), timeout=60)
    go_lost = sorted(
        (go_last & {*verdict.lost, *verdict.regressed})
        | (writers.go_last() & {*after_sweep.lost, *after_sweep.regressed})
    )

    logs = "\n".join(deployment.logs())
    errors = [line for line in logs.splitlines() if "ERROR" in line or "CRITICAL" in line]
    raw_ids = sum(logs.count(c) for c in ("\u2028", "\u202e"))  # ids must be shown escaped
    row = conclude(
        deployment,
        Verdict(
            lost=sorted({*verdict.lost, *after_sweep.lost}),
            resurrected=sorted({*verdict.resurrected, *after_sweep.resurrected}),
            regressed=sorted({*verdict.regressed, *after_sweep.regressed}),
        ),
        scenario="13-foreign-writer",
        title="a Go RedisStore saving and deleting the same sessions directly",
        load=f"{len(load)} queued requests / {scale.sessions} sessions; {writers.go_writes()} "
        f"direct Go writes ({len(go_only)} sessions Go's alone, ids with a tab, U+2028, "
        "a bidi override, 300 characters)",
        faults=f"Go re-saves and deletes behind the queue (from {queued_at_first_go_write} "
        f"requests still queued); {len(came_back)} saves stamped before a Go delete arrive "
        f"after it; a sweep with its clock {TTL_SECONDS // 3600} h ahead",
        notes="the direct writer is tests/go/gostore, a Go program writing as Go's RedisStore "
        "(encoding/json, klauspost zstd, SET EX 30 d, DEL); "
        f"Go-written values lost: {len(go_lost)} (of {len(go_last)}, then "
        f"{len(writers.go_last())} at the sweep); "
        f"list() converged {seconds(convergence)} after the last write (reconciliation: one "
        f"{SCAN_COUNT}-key slice every {RECONCILE_SECONDS} s, {slices} slices a pass here), "
        f"{seconds(settled)} after the sweep; the sweep expired {len(swept)} sessions, exactly "
        f"those we wrote last; {len(came_back)} sessions came back through a save stamped "
        "before Go's delete (documented: a Go delete leaves no tombstone); queue-only "
        f"sessions regressed: {len(queue_only_regressed)}; worker and beat errors logged: "
        f"{len(errors)}, odd ids logged unescaped: {raw_ids}",
        passed=not go_lost
        and sorted(swept) == sorted(ours_last)
        and None not in (convergence, settled)
        and not errors
        and not raw_ids,
    )
    client.close()
    assert verdict.exact, verdict
    assert after_sweep.exact, after_sweep
    assert not go_lost, go_lost
    assert sorted(swept) == sorted(ours_last)
    assert not queue_only_regressed
    assert convergence is not None and settled is not None
    assert not errors, errors[:5]
    assert not raw_ids
    assert row.result == "pass", row
