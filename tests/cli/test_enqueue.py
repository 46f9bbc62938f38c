"""save, delete and dlq replay enqueue Celery messages on the broker's queue (no worker here)."""

from __future__ import annotations

import json
from typing import Any

import redis

from checkpointq.store.keys import KeySpace
from checkpointq.tasks.dead_letters import DeadLetters, Reason
from checkpointq.tasks.messages import envelope_body
from tests.cli.conftest import Cli


def _queued(client: redis.Redis) -> list[dict[str, Any]]:
    """The messages waiting in the queue, oldest first: headers and decoded body."""
    messages = []
    for raw in reversed(client.lrange("checkpoints", 0, -1)):
        envelope = json.loads(raw)
        body = json.loads(envelope_body(envelope))
        headers = envelope["headers"]
        messages.append(
            {"task": headers["task"], "id": headers["id"], "args": body[0], "kwargs": body[1]}
        )
    return messages


def _saved(client: redis.Redis, message: dict[str, Any]) -> Any:
    """The checkpoint a queued save carries: a staged save's value, on the broker."""
    assert message["task"] == "checkpoint.save_staged"
    value = client.get(KeySpace().pending_value(message["args"][0], message["id"]))
    assert value is not None
    return json.loads(value)


def test_save_from_stdin_and_delete_enqueue_fenced_requests(
    cli_env: Cli, redis_client: redis.Redis
) -> None:
    # When a checkpoint is saved from stdin and the session then deleted
    document = {"sessionId": "s-1", "version": 4, "metadata": {}}
    saved = cli_env("save", "-", "--json", input=json.dumps(document))
    deleted = cli_env("delete", "s-1", "--json")

    # Then both requests wait in the queue, in order, each with a later seq
    assert saved.exit_code == 0, saved.output
    assert deleted.exit_code == 0, deleted.output
    save_out, delete_out = json.loads(saved.stdout), json.loads(deleted.stdout)
    assert save_out["durable"] is False and delete_out["task"] == "checkpoint.delete"
    queued = _queued(redis_client)
    assert [m["task"] for m in queued] == ["checkpoint.save_staged", "checkpoint.delete"]
    assert queued[0]["args"] == ["s-1"] and _saved(redis_client, queued[0])["sessionId"] == "s-1"
    assert queued[0]["kwargs"]["seq"] == save_out["seq"] < delete_out["seq"]


def test_save_reads_a_file_argument(cli_env: Cli, redis_client: redis.Redis) -> None:
    path = cli_env.cwd / "cp.json"
    path.write_text(json.dumps({"sessionId": "from-file", "version": 1}))

    result = cli_env("save", str(path))

    assert result.exit_code == 0, result.output
    assert "enqueued save of session 'from-file'" in result.stdout
    assert _saved(redis_client, _queued(redis_client)[0])["sessionId"] == "from-file"


def test_save_wait_without_a_worker_times_out_with_one_helpful_line(cli_env: Cli) -> None:
    result = cli_env("save", "-", "--wait", "--timeout", "0.3", input='{"sessionId": "w"}')

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "not applied within 0.3s" in result.stderr
    assert "worker" in result.stderr


def test_dlq_replay_all_enqueues_the_replayable_and_keeps_the_rest(
    cli_env: Cli, redis_client: redis.Redis
) -> None:
    # Given 150 replayable dead letters and one undecodable one
    letters = DeadLetters(redis_client, KeySpace())
    for i in range(150):
        letters.add(
            Reason.RETRIES_EXHAUSTED, "store down", task="checkpoint.delete", task_id=f"t{i}",
            args=[f"s-{i}"], kwargs={"seq": i + 1},
        )  # fmt: skip
    letters.add(Reason.UNDECODABLE, "not JSON", task=None, task_id=None, raw=b"\xff")

    # When everything is replayed
    result = cli_env("dlq", "replay", "--all", "--json")

    # Then each replayable request is back in the queue, and only the undecodable one remains
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["replayed"]) == 150
    queued = _queued(redis_client)
    assert sorted(m["args"][0] for m in queued) == sorted(f"s-{i}" for i in range(150))
    assert letters.count() == 1


def test_dlq_replay_of_an_unreplayable_entry_fails_with_one_line(
    cli_env: Cli, redis_client: redis.Redis
) -> None:
    entry = DeadLetters(redis_client, KeySpace()).add(
        Reason.UNDECODABLE, "not JSON", task=None, task_id=None, raw=b"\xff"
    )

    result = cli_env("dlq", "replay", entry)

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert redis_client.llen("checkpoints") == 0
