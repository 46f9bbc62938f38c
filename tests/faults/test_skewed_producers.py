"""Scenario 14: apiserver replicas with skewed clocks take turns on the same sessions.

Three producer processes (tests/faults/replica.py) whose ``seq`` clocks run 2 s ahead, 2 s
behind and one hour ahead (past ``CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS``) take turns on every
session through one real worker, each turn as the apiserver does it: load, save, and wait
for the save's own outcome (``wait_durable``). A round gives every session one turn by a
replica picked at random; the next round starts once every outcome is known, so each save
follows the previous one in real time. What must hold:

* no save is dropped silently: each is ``applied`` (and is then what the store holds and what
  the next turn loads), or ``wait_durable`` reports it superseded or refused, with a reason;
* the causal ``seq`` (docs/protocol.md) gets every save of the replicas 2 s off applied,
  4 s apart as they are; the replica an hour ahead is refused at once, at publish (the broker
  compares its clock with its own), never queued, never applied, never dead-lettered, and
  no other replica ever stamps after one of its saves;
* the final state is, per session, the last save in real-time order among those applied.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import select
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from checkpointq.tasks.producer.outcomes import APPLIED
from tests.faults.harness import (
    REPO,
    Deployment,
    Scale,
    Verdict,
    checkpointq_env,
    conclude,
)
from tests.faults.replica import REFUSED_AT_PUBLISH

#: Each replica's clock offset in seconds, and how often it takes the turn (weight).
REPLICAS = {"+2 s": (2.0, 45), "-2 s": (-2.0, 45), "+1 h": (3600.0, 10)}
#: The replica whose clock is past the tolerance (300 s): refused at publish, every time.
AHEAD = "+1 h"
#: What the broker's refusal of such a save says: the producer's clock, measured by the
#: broker after the round trip (so a publish that waited under load reads 3599.9 s, not 3600).
CLOCK_AHEAD = re.compile(
    r"clock: this producer's clock is (?P<seconds>[0-9.]+) s ahead of the broker's"
)
#: How far that measured offset may fall short of the skew: the publish's own round trip
#: (milliseconds, or a few seconds on a starved machine), never the skew itself.
MEASURE_SLACK_S = 30.0


def says_clock_ahead(reason: str) -> bool:
    """Whether a refusal names this producer's clock as ahead by about the skew."""
    match = CLOCK_AHEAD.search(reason)
    if match is None:
        return False
    return abs(float(match["seconds"]) - REPLICAS[AHEAD][0]) <= MEASURE_SLACK_S


@dataclass
class Replica:
    """A running tests/faults/replica.py: one JSON line of turns in, one of outcomes out."""

    name: str
    process: subprocess.Popen[str]

    def send(self, turns: list[list[Any]]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(turns) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float) -> Any:
        """The replica's next line, within ``timeout`` (it bounds each wait itself)."""
        out: IO[str] | None = self.process.stdout
        assert out is not None
        if not select.select([out], [], [], timeout)[0]:
            raise AssertionError(f"replica {self.name} said nothing for {timeout} s")
        line = out.readline()
        if not line:
            raise AssertionError(f"replica {self.name} exited ({self.process.wait(10)})")
        return json.loads(line)

    def stop(self) -> None:
        """Close its input (it exits at EOF) and wait; kill it if it does not exit."""
        assert self.process.stdin is not None and self.process.stdout is not None
        with contextlib.suppress(BrokenPipeError):  # it has exited already
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process.stdout.close()


@contextlib.contextmanager
def replicas(deployment: Deployment, logs: Path) -> Iterator[dict[str, Replica]]:
    """Start every replica of REPLICAS, each with its stderr in ``logs``; stop them after."""
    started: dict[str, Replica] = {}
    try:
        for name, (offset, _) in REPLICAS.items():
            args = [deployment.broker.url, deployment.store_server.url, str(offset)]
            with (logs / f"replica{name.replace(' ', '')}.log").open("w") as err:
                process = subprocess.Popen(
                    [sys.executable, "-m", "tests.faults.replica", *args],
                    cwd=REPO,
                    env=checkpointq_env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            started[name] = Replica(name, process)
        for replica in started.values():
            assert replica.receive(timeout=60) == "ready"
        yield started
    finally:
        for replica in started.values():
            replica.stop()


@dataclass
class Referee:
    """What each turn must show, given the saves applied before it in real time."""

    #: Per session, the versions applied so far, in real-time order.
    applied: dict[str, list[int]]
    outcomes: Counter[tuple[str, str]]
    #: The reasons given for refused saves ("<kind>: <reason>").
    reasons: list[str]
    #: Saves with no outcome, or reported applied yet not what the store then held.
    dropped: list[dict[str, Any]]
    #: Turns whose load did not return the last save applied before them.
    stale_loads: list[dict[str, Any]]

    def current(self, session_id: str) -> int | None:
        versions = self.applied[session_id]
        return versions[-1] if versions else None

    def take(self, replica: str, result: dict[str, Any]) -> None:
        sid, outcome = result["session"], result["outcome"]
        self.outcomes[replica, outcome] += 1
        if result["loaded"] != self.current(sid):
            self.stale_loads.append(result)
        if outcome == APPLIED:
            self.applied[sid].append(result["version"])
        elif outcome in ("refused", REFUSED_AT_PUBLISH):
            self.reasons.append(result["reason"])
        elif outcome == "timeout":
            self.dropped.append(result)

    def judge(self, deployment: Deployment) -> Verdict:
        """Each session's stored value against the last save applied to it."""
        store = deployment.store()
        verdict = Verdict()
        for sid, versions in self.applied.items():
            cp = store.load(sid)
            got = None if cp is None else cp.version
            if got == self.current(sid):
                continue
            if got in versions:
                verdict.regressed.append(sid)
            else:
                verdict.lost.append(sid)
        return verdict


def test_replicas_with_skewed_clocks_taking_turns_drop_no_save(
    deployment: Deployment, scale: Scale, tmp_path: Path
) -> None:
    # Given one worker, and three replicas whose clocks are +2 s, -2 s and +1 h off
    deployment.worker()
    sessions = [f"turns-{i:05d}" for i in range(scale.sessions)]
    rounds = scale.requests // scale.sessions
    rng = random.Random(14)
    names, weights = list(REPLICAS), [weight for _, weight in REPLICAS.values()]
    referee = Referee({s: [] for s in sessions}, Counter(), [], [], [])
    with replicas(deployment, tmp_path) as running:
        for round_ in range(rounds):
            # When in each round every session gets one turn (load, save, wait_durable)
            turns: dict[str, list[list[Any]]] = defaultdict(list)
            chosen = rng.choices(names, weights, k=len(sessions))
            for i, (sid, name) in enumerate(zip(sessions, chosen, strict=True)):
                turns[name].append([sid, round_ * len(sessions) + i + 1])
            for name, batch in turns.items():
                running[name].send(batch)
            for name in turns:
                for result in running[name].receive(timeout=300):
                    referee.take(name, result)
            # Then each save reported applied is what the store holds after the round
            after_round = referee.judge(deployment)
            referee.dropped += [{"round": round_, "session": s} for s in after_round.lost]
    verdict = referee.judge(deployment)
    total = Counter(name for name, _ in referee.outcomes.elements())
    outcomes = referee.outcomes
    refused = outcomes[AHEAD, REFUSED_AT_PUBLISH]
    said_ahead = sum(says_clock_ahead(reason) for reason in referee.reasons)
    kinds = ", ".join(sorted({reason.split(":", 1)[0] for reason in referee.reasons}))
    row = conclude(
        deployment,
        verdict,
        scenario="14-skewed-producers",
        title="three producer replicas, clocks +2 s, -2 s and +1 h, taking turns",
        load=f"{total.total()} saves (load, save, wait_durable) / {len(sessions)} sessions, "
        f"{rounds} rounds",
        faults="producer clocks 2 s ahead and 2 s behind (4 s apart), and 1 h ahead (past "
        "CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS)",
        notes=f"applied: {outcomes['+2 s', APPLIED]}/{total['+2 s']} (+2 s), "
        f"{outcomes['-2 s', APPLIED]}/{total['-2 s']} (-2 s); refused at publish: "
        f"{refused}/{total[AHEAD]} (+1 h; {kinds or 'none'}, {said_ahead} saying "
        f"'this producer's clock is 3600.0 s ahead of the broker's', within "
        f"{MEASURE_SLACK_S:.0f} s); "
        f"superseded: {sum(n for (_, o), n in outcomes.items() if o == 'superseded')}; "
        f"silently dropped: {len(referee.dropped)}; loads that missed the previous turn's "
        f"save: {len(referee.stale_loads)}",
        expect_dead=0,
        passed=not (referee.dropped or referee.stale_loads)
        and refused == total[AHEAD] == said_ahead
        and all(outcomes[n, APPLIED] == total[n] for n in names if n != AHEAD),
    )
    assert not referee.dropped, referee.dropped[:5]
    assert not referee.stale_loads, referee.stale_loads[:5]
    assert verdict.exact, verdict
    for name in names:
        want = REFUSED_AT_PUBLISH if name == AHEAD else APPLIED
        assert outcomes[name, want] == total[name], (name, outcomes)
    assert said_ahead == len(referee.reasons) == refused
    assert row.result == "pass", row
