"""An apiserver replica for the fault suite: a producer process with a clock of its own.

    python -m tests.faults.replica BROKER_URL STORE_URL OFFSET_SECONDS

The replica's ``seq`` clock runs ``OFFSET_SECONDS`` off the machine's (a host whose clock is
skewed). It answers ``ready`` on stdout, then reads one JSON line per round on stdin: a list
of ``[session_id, version]`` turns. For each turn it does what the apiserver does, load then
save (a checkpoint with that version); then it waits for every save's own outcome
(``wait_durable``) and writes one JSON line: per turn the version it loaded, the save's
``seq`` and its outcome, ``applied``, ``superseded``, ``refused`` (with the reason),
``refused at publish`` (the broker refused it at once: its seq or this replica's clock) or
``timeout`` (no outcome: a save dropped silently). An empty line or EOF ends it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from checkpointq.store.redis import RedisStore
from checkpointq.tasks.errors import RequestRefused, SeqRefused
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from tests.faults.harness import QUEUE
from tests.support.checkpoints import make_checkpoint

#: A save the broker refused at publish: never queued, nothing to wait for.
REFUSED_AT_PUBLISH = "refused at publish"

#: Longest wait for one save's outcome; past it the turn is reported as ``timeout``.
OUTCOME_TIMEOUT = 60.0


def play(client: CheckpointClient, turns: list[list[Any]]) -> list[dict[str, Any]]:
    """Load and save each turn's session, then learn each save's outcome."""
    played = []
    results: list[dict[str, Any]] = []
    for session_id, version in turns:
        loaded = client.load(session_id)
        loaded_version = loaded.version if loaded else None
        try:
            handle = client.save(make_checkpoint(session_id, version))
        except SeqRefused as refused:
            results.append(
                {"session": session_id, "version": version, "seq": None, "loaded": loaded_version}
                | {"outcome": REFUSED_AT_PUBLISH, "reason": str(refused)}
            )
            continue
        played.append((handle, version, loaded_version))
    for handle, version, loaded_version in played:
        result: dict[str, Any] = {"session": handle.session_id, "version": version}
        result.update(seq=handle.seq, loaded=loaded_version)
        try:
            result["outcome"] = client.wait_durable(handle, timeout=OUTCOME_TIMEOUT).outcome
        except RequestRefused as refused:
            result.update(outcome="refused", reason=f"{refused.kind}: {refused.reason}")
        except TimeoutError as timeout:
            result.update(outcome="timeout", reason=str(timeout))
        results.append(result)
    return results


def main(argv: list[str]) -> None:
    broker_url, store_url, offset = argv[0], argv[1], float(argv[2])
    offset_us = round(offset * 1_000_000)
    clock = SeqClock(lambda: wall_clock_us() + offset_us)
    store = RedisStore.from_url(store_url)
    with CheckpointClient(broker_url, store, queue=QUEUE, clock=clock) as client:
        print(json.dumps("ready"), flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            print(json.dumps(play(client, json.loads(line))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
