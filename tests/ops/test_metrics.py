"""Metrics scraped over HTTP from a real prefork worker (2 processes) after a known load."""

from __future__ import annotations

import time

from checkpointq.store.redis import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from tests.ops.conftest import QUEUE, System, scrape, value
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.servers import wait_until

SAVE = "checkpoint.save"
MONTH = 31 * 24 * 3600


def test_a_known_load_is_counted_exactly_once_across_the_pool_processes(system: System) -> None:
    # Given a prefork worker (concurrency 2) serving /metrics
    system.start_worker()
    broker = system.broker_client()
    with system.client() as client:
        # And two sessions already past their deadline, written a month ago
        old = RedisStore.from_url(system.store.url, clock=lambda: time.time() - MONTH)
        for sid in ("expired-0", "expired-1"):
            old.save(make_checkpoint(sid), seq=1)
        old.close()

        # When 6 new sessions are saved (one with 105 messages: 5 over the history cap) ...
        fresh = [client.save(make_checkpoint(f"fresh-{i}")) for i in range(5)]
        fresh.append(client.save(make_checkpoint("fresh-5", messages=105)))
        # ... 3 more sessions are saved, then each gets a save older than the one applied ...
        newer = [client.save(make_checkpoint(f"older-{i}", version=2)) for i in range(3)]
        for handle in fresh + newer:
            client.wait_durable(handle, timeout=30)
        for handle in newer:
            old_save = checkpoint_to_wire(make_checkpoint(handle.session_id, version=1))
            assert handle.seq is not None
            client.send(SAVE, [old_save], {"seq": handle.seq - 1})
        # ... 2 sessions are deleted ...
        deletes = [client.delete("fresh-0"), client.delete("fresh-1")]
        # ... 3 poison messages arrive: an invalid checkpoint (refused by the task), an
        # unknown task and an undecodable body (both refused by the consumer) ...
        client.send(SAVE, [{"sessionId": "", "version": 1}], {})
        client.send("checkpoint.frobnicate", ["x"], {})
        broker.lpush(QUEUE, protocol2(SAVE, [], body=b"{not json"))
        # ... and a sweep runs
        client.sweep()
        for handle in deletes:
            client.wait_durable(handle, timeout=30)
    system.wait_drained()
    broker.close()

    # Then the counters add up to exactly that load, summed over both pool processes and
    # the main process (which dead-letters what the consumer refuses)
    def requests(task: str, outcome: str) -> float:
        return value(
            scrape(system.metrics_port), "checkpointq_requests_total", task=task, outcome=outcome
        )

    wait_until(
        lambda: requests("expire_stale", "swept") == 1 and requests("save", "dead_lettered") == 2,
        timeout=30,
        message="the sweep and the dead letters to be counted",
    )
    samples = scrape(system.metrics_port)
    counted = {
        (dict(labels)["task"], dict(labels)["outcome"]): count
        for (name, labels), count in samples.items()
        if name == "checkpointq_requests_total"
    }
    assert counted == {
        ("save", "applied"): 9,
        ("save", "superseded"): 3,
        ("delete", "deleted"): 2,
        ("save", "dead_lettered"): 2,  # the invalid checkpoint, the undecodable save
        ("other", "dead_lettered"): 1,  # the unknown task's name is not made a label
        ("expire_stale", "swept"): 1,
    }
    dead = {
        dict(labels)["kind"]: count
        for (name, labels), count in samples.items()
        if name == "checkpointq_dead_letters_total"
    }
    assert dead == {"invalid_input": 1, "unknown_task": 1, "undecodable": 1}

    # And each histogram observed each request it describes once
    assert value(samples, "checkpointq_apply_duration_seconds_count", task="save") == 12
    assert value(samples, "checkpointq_apply_duration_seconds_count", task="delete") == 2
    assert value(samples, "checkpointq_lag_seconds_count", task="save") == 12
    assert value(samples, "checkpointq_lag_seconds_count", task="delete") == 2
    assert value(samples, "checkpointq_lag_seconds_sum", task="save") > 0
    assert value(samples, "checkpointq_stored_value_bytes_count") == 9
    assert value(samples, "checkpointq_request_body_bytes_count", task="delete") == 2
    assert value(samples, "checkpointq_request_body_bytes_count", task="expire_stale") == 1
    # (the client's saves are staged: their bodies name their values and carry no checkpoint,
    # so a save's body is smaller than what it stores, even compressed, on this load)
    assert value(samples, "checkpointq_request_body_bytes_count", task="save") == 14
    body_mean = value(samples, "checkpointq_request_body_bytes_sum", task="save") / 14
    stored_mean = value(samples, "checkpointq_stored_value_bytes_sum") / 9
    assert body_mean < stored_mean

    # And the truncation and the sweep are counted
    assert value(samples, "checkpointq_trimmed_saves_total") == 1
    assert value(samples, "checkpointq_trimmed_messages_total") == 5
    assert value(samples, "checkpointq_sweeps_total", outcome="swept") == 1
    assert value(samples, "checkpointq_swept_sessions_total") == 2
    assert value(samples, "checkpointq_sweep_duration_seconds_count") == 1

    # And the gauges read from Redis at scrape time describe the state left behind
    assert value(samples, "checkpointq_redis_up", role="broker") == 1
    assert value(samples, "checkpointq_redis_up", role="store") == 1
    assert value(samples, "checkpointq_queue_depth", queue=QUEUE) == 0
    assert value(samples, "checkpointq_dead_letter_depth") == 3
    assert value(samples, "checkpointq_sessions", state="live") == 6 - 2 + 3
    assert value(samples, "checkpointq_sessions", state="expired") == 0

    # And scraping again counts nothing twice
    again = scrape(system.metrics_port)
    assert {k: v for k, v in again.items() if k[0] == "checkpointq_requests_total"} == {
        k: v for k, v in samples.items() if k[0] == "checkpointq_requests_total"
    }


def test_retries_while_the_store_is_down_are_counted_and_the_gauge_says_so(
    system: System,
) -> None:
    # Given a running worker, and then the store Redis going down
    system.start_worker()
    system.store.stop()
    with system.client() as client:
        # When a save arrives while the store is down
        handle = client.save(make_checkpoint("during-the-outage"))

        # Then its retries are counted, and the endpoint says the store is unreadable
        def requests(outcome: str) -> float:
            return value(
                scrape(system.metrics_port),
                "checkpointq_requests_total",
                task="save",
                outcome=outcome,
            )

        wait_until(lambda: requests("retried") >= 2, timeout=30, message="two retries counted")
        assert value(scrape(system.metrics_port), "checkpointq_redis_up", role="store") == 0

        # When the store comes back, the save is applied once
        system.store.start()
        client.wait_durable(handle, timeout=30)
    system.wait_drained()
    wait_until(lambda: requests("applied") == 1, timeout=10, message="the save to be counted")
    # And every retry the worker logged is counted: no more, no less
    assert system.worker is not None
    assert requests("retried") == system.worker.log().count("; retry ")
