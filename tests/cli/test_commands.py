"""The CLI's store and queue commands against a private redis-server (Given/When/Then)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import redis

from checkpointq.store import RedisStore
from checkpointq.store.keys import KeySpace
from checkpointq.tasks.dead_letters import DeadLetters, Reason
from tests.cli.conftest import Cli
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer


def test_show_prints_a_saved_checkpoint_as_text_and_as_json(
    cli_env: Cli, store: RedisStore
) -> None:
    # Given a session saved in the store
    store.save(make_checkpoint("sess-a", version=3, messages=4))

    # When it is shown, for people and for scripts
    human = cli_env("show", "sess-a")
    as_json = cli_env("show", "sess-a", "--json")

    # Then both succeed and describe the same checkpoint, the text in words for people
    assert human.exit_code == 0, human.output
    assert "sess-a" in human.stdout and "version   3" in human.stdout
    assert "messages  4 stored" in human.stdout and "HISTORY_CAP" not in human.stdout
    assert "0 total" not in human.stdout and "None" not in human.stdout
    document = json.loads(as_json.stdout)
    assert document["sessionId"] == "sess-a"
    assert document["version"] == 3
    assert len(document["conversationHistory"]) == 4


def test_show_of_an_unknown_session_fails_with_one_line(cli_env: Cli) -> None:
    result = cli_env("show", "nobody")

    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == ["checkpointq: error: no live session 'nobody'"]


def test_ls_lists_every_live_session_and_pages_with_a_cursor(
    cli_env: Cli, store: RedisStore
) -> None:
    # Given 30 live sessions
    ids = {f"s-{i:02d}" for i in range(30)}
    for session_id in ids:
        store.save(make_checkpoint(session_id))

    # When listed all at once, and page by page
    everything = cli_env("ls", "--json")
    paged: set[str] = set()
    cursor: str | None = None
    for _ in range(100):
        args = ["ls", "--json", "--page-size", "7"] + (["--cursor", cursor] if cursor else [])
        page = json.loads(cli_env(*args).stdout)
        paged.update(page["sessions"])
        cursor = page["cursor"]
        if cursor is None:
            break

    # Then both listings hold exactly those sessions
    assert set(json.loads(everything.stdout)["sessions"]) == ids
    assert paged == ids
    assert len(cli_env("ls", "--limit", "5").stdout.splitlines()) == 5


def test_stats_counts_queue_sessions_dead_letters_and_events(
    cli_env: Cli, store: RedisStore, redis_client: redis.Redis
) -> None:
    # Given 2 queued messages, 3 live sessions, 1 dead letter and 1 event
    keys = KeySpace()
    redis_client.lpush("checkpoints", "m1", "m2")
    for i in range(3):
        store.save(make_checkpoint(f"live-{i}"))
    DeadLetters(redis_client, keys).add(
        Reason.UNKNOWN_TASK, "no such task", task="nope", task_id="t1", args=[], kwargs={}
    )
    redis_client.xadd(keys.events(), {"type": "expired", "session_id": "gone"})

    # When stats are asked for
    result = cli_env("stats", "--json")

    # Then each count is right
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["queue_depth"] == 2
    assert stats["live_sessions"] == 3
    assert stats["dead_letters"] == 1
    assert stats["events"] == 1
    assert "queue_depth" in cli_env("stats").stdout


def test_sweep_expires_thousands_of_stale_sessions_in_locked_batches(
    cli_env: Cli, redis_client: redis.Redis
) -> None:
    # Given 2,500 sessions whose lifetime ended an hour ago, and one live session
    past = RedisStore(redis_client, clock=lambda: time.time() - 40 * 24 * 3600)
    pipe_store = past
    for i in range(2500):
        pipe_store.save(make_checkpoint(f"old-{i}", messages=1))
    RedisStore(redis_client).save(make_checkpoint("fresh"))

    # When swept by hand
    result = cli_env("sweep", "--json")

    # Then every stale session is gone, announced once each, and the live one stays
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"outcome": "swept", "expired": 2500}
    assert redis_client.xlen(KeySpace().events()) == 2500
    assert json.loads(cli_env("ls", "--json").stdout)["sessions"] == ["fresh"]
    assert "expired 0 session(s)" in cli_env("sweep").stdout


def test_dlq_lists_shows_and_purges_dead_letters(cli_env: Cli, redis_client: redis.Redis) -> None:
    # Given two dead letters
    letters = DeadLetters(redis_client, KeySpace())
    first = letters.add(
        Reason.INVALID_INPUT,
        "sessionId: must not be empty",
        task="checkpoint.save",
        task_id="t-1",
        args=[{"sessionId": ""}],
        kwargs={},
    )
    letters.add(Reason.UNDECODABLE, "not JSON", task=None, task_id=None, raw=b"\x80garbage")

    # When listed, one shown, then purged
    listed = json.loads(cli_env("dlq", "ls", "--json").stdout)
    shown = json.loads(cli_env("dlq", "show", first, "--json").stdout)
    human = cli_env("dlq", "show", first).stdout
    purged = cli_env("dlq", "purge", "--yes", "--json")

    # Then each command saw them, and none is left
    assert [entry["kind"] for entry in listed["entries"]] == ["invalid_input", "undecodable"]
    assert shown["task"] == "checkpoint.save" and shown["args"] == [{"sessionId": ""}]
    assert "sessionId: must not be empty" in human
    # (for people: a readable time, JSON arguments, no Python reprs)
    assert "None" not in human and "'sessionId'" not in human
    assert re.search(r"refused    \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(\d+ s ago\)", human), human
    assert 'args       [{"sessionId": ""}]' in human
    assert json.loads(purged.stdout) == {"removed": 2}
    assert json.loads(cli_env("dlq", "ls", "--json").stdout)["entries"] == []
    missing = cli_env("dlq", "show", first)
    assert missing.exit_code == 1
    assert missing.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("task", "args", "why"),
    [
        ("checkpoint.save", [{"sessionId": ""}], "its checkpoint is invalid"),
        ("checkpoint.save_staged", ["lost"], "staged save"),
    ],
    ids=["invalid-checkpoint", "staged-save"],
)
def test_dlq_show_never_calls_an_entry_that_can_never_apply_replayable(
    cli_env: Cli, redis_client: redis.Redis, task: str, args: list[object], why: str
) -> None:
    # Given a dead letter whose replay would be refused again, whatever the store holds
    letters = DeadLetters(redis_client, KeySpace())
    entry = letters.add(
        Reason.INVALID_INPUT, "refused", task=task, task_id="t-1", args=args, kwargs={"seq": 1}
    )

    # When it is shown, for people and as JSON
    human = cli_env("dlq", "show", entry).stdout
    shown = json.loads(cli_env("dlq", "show", entry, "--json").stdout)

    # Then neither calls it replayable, and the human view says why not
    (line,) = [line for line in human.splitlines() if line.startswith("replayable")]
    assert line.startswith("replayable no:") and why in line, line
    assert shown["replayable"] is False


def test_dlq_ls_says_when_there_are_no_dead_letters(cli_env: Cli) -> None:
    # Given no dead letters
    # When they are listed, for people and as JSON
    human = cli_env("dlq", "ls")
    as_json = json.loads(cli_env("dlq", "ls", "--json").stdout)

    # Then people are told the stream is empty, and JSON stays an empty list
    assert human.exit_code == 0
    assert human.stdout == "no dead letters\n"
    assert as_json == {"entries": [], "cursor": None}


def test_a_redis_socket_broker_url_also_serves_the_store(
    cli_offline: Cli, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a Redis on a unix socket, configured in kombu's spelling only
    socket_dir = tmp_path_factory.mktemp("sock")
    server = RedisServer(extra_args=["--unixsocket", str(socket_dir / "r.sock")]).start()
    try:
        RedisStore(server.client()).save(make_checkpoint("on-socket"))
        monkeypatch.setenv("CHECKPOINTQ_BROKER_URL", f"redis+socket://{socket_dir / 'r.sock'}")

        # When the store is read through it
        result = cli_offline("show", "on-socket", "--json")

        # Then the CLI translated the URL for redis-py
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["sessionId"] == "on-socket"
    finally:
        server.cleanup()


def test_ls_into_a_reader_that_stops_early_exits_quietly(cli_env: Cli, store: RedisStore) -> None:
    # Given more sessions than a pipe buffer holds as one line each
    for i in range(3000):
        store.save(make_checkpoint(f"piped-session-{i:05d}"))

    # When `checkpointq ls` is read like `| head -1`: one line, then the pipe is closed
    process = subprocess.Popen(
        [sys.executable, "-m", "checkpointq.worker.cli", "ls"],
        cwd=cli_env.cwd,
        env=cli_env.process_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    process.stderr.close()
    returncode = process.wait(timeout=60)

    # Then the line it read is a session id, and the command ends with no error at all
    assert first.decode().startswith("piped-session-")
    assert stderr == b""
    assert returncode == 0


def test_ls_and_show_print_odd_ids_escaped_and_json_keeps_them_exact(
    cli_env: Cli, store: RedisStore
) -> None:
    # Given sessions whose ids (as Go accepts them) hold a tab, a line separator, a newline
    odd = ["tab\there", "line\u2028sep", "new\nline"]
    for session_id in odd:
        store.save(make_checkpoint(session_id))

    # When listed for people and for scripts, and one is shown
    human = cli_env("ls")
    as_json = cli_env("ls", "--json")
    shown = cli_env("show", "new\nline")

    # Then people see one escaped line per id, and scripts get the ids exactly
    assert sorted(human.stdout.splitlines()) == ["line\\u2028sep", "new\\nline", "tab\\there"]
    assert sorted(json.loads(as_json.stdout)["sessions"]) == sorted(odd)
    assert shown.exit_code == 0 and "session   new\\nline" in shown.stdout


def test_ls_pages_print_the_next_pages_full_command_on_stderr(
    cli_env: Cli, store: RedisStore
) -> None:
    # Given more sessions than one page (and than Redis scans at once in a small set)
    for i in range(300):
        store.save(make_checkpoint(f"paged-{i:03d}"))

    # When one page is listed for people
    page = cli_env("ls", "--page-size", "5")

    # Then stdout holds only ids, and stderr the command for the next page
    assert page.exit_code == 0, page.output
    assert all(line.startswith("paged-") for line in page.stdout.splitlines())
    (hint,) = page.stderr.splitlines()
    assert hint.startswith("# more: checkpointq ls --page-size 5 --cursor ")
    following = cli_env(*hint.removeprefix("# more: checkpointq ").split())
    assert following.exit_code == 0
    assert set(following.stdout.split()).isdisjoint(page.stdout.split())


def test_stats_for_people_has_words_not_reprs(cli_env: Cli) -> None:
    result = cli_env("stats")

    assert result.exit_code == 0, result.output
    assert "None" not in result.stdout
    assert "next_sweep             no beat has scheduled one" in result.stdout
    assert "oldest_queued          - (queue empty)" in result.stdout
