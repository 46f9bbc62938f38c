"""``show`` and ``ls`` answer what producers' loads and lists answer: writes still queued
included, and said to be queued until the store has them (no worker runs here, so every
request stays queued until the test applies it to the store itself)."""

from __future__ import annotations

import json

from checkpointq.store import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from tests.cli.conftest import Cli
from tests.support.checkpoints import make_checkpoint

PENDING_LINE = "pending   a save (seq {seq}, made "


def _saved(cli: Cli, session_id: str, version: int = 1) -> tuple[int, str]:
    """Enqueue a save through the CLI; its seq and request id."""
    document = checkpoint_to_wire(make_checkpoint(session_id, version=version))
    result = cli("save", "-", "--json", input=json.dumps(document))
    assert result.exit_code == 0, result.output
    sent = json.loads(result.stdout)
    return int(sent["seq"]), str(sent["task_id"])


def test_show_and_ls_see_a_queued_save_and_say_so_until_the_store_has_it(
    cli_env: Cli, store: RedisStore
) -> None:
    # Given an older version in the store, and a newer save accepted but still queued
    store.save(make_checkpoint("queued-a", version=1))
    seq, request = _saved(cli_env, "queued-a", version=2)
    new_seq, new_request = _saved(cli_env, "queued-new")

    # When it is shown and listed
    shown = cli_env("show", "queued-a")
    shown_json = cli_env("show", "queued-a", "--json")
    document = json.loads(shown_json.stdout)
    listed = cli_env("ls")
    listing = json.loads(cli_env("ls", "--json").stdout)

    # Then both answer the queued save, as a producer's load and list would, and say so
    assert shown.exit_code == 0, shown.output
    assert "version   2" in shown.stdout
    assert shown.stdout.splitlines()[1].startswith(PENDING_LINE.format(seq=seq))
    assert shown.stdout.splitlines()[1].endswith(") is queued and not yet in the store")
    # (as JSON: the checkpoint alone, savable as it is; the note on stderr)
    assert document["version"] == 2 and "pending" not in document
    assert shown_json.stderr.startswith(f"# pending: a save (seq {seq}, made ")
    assert listed.stdout.splitlines() == ["queued-a", "queued-new"]
    assert listed.stderr.splitlines() == [
        "# pending: queued-new: listed for a save still queued, not yet in the store"
    ]
    assert listing == {
        "sessions": ["queued-a", "queued-new"],
        "cursor": None,
        "pending_saves": ["queued-new"],
        "pending_deletes": [],
    }
    # (pages walk the store alone, and say they did not merge)
    page = json.loads(cli_env("ls", "--json", "--page-size", "10").stdout)
    assert page["sessions"] == ["queued-a"] and page["pending_saves"] is None

    # When the store applies both saves (what a worker does)
    store.save(make_checkpoint("queued-a", version=2), seq=seq, request_id=request)
    store.save(make_checkpoint("queued-new"), seq=new_seq, request_id=new_request)

    # Then the same answers come from the store, and nothing is said to be pending
    stored = cli_env("show", "queued-a")
    assert "version   2" in stored.stdout and "pending" not in stored.stdout
    stored_document = json.loads(cli_env("show", "queued-a", "--json").stdout)
    assert stored_document == checkpoint_to_wire(make_checkpoint("queued-a", version=2))
    relisted = cli_env("ls")
    assert relisted.stdout.splitlines() == ["queued-a", "queued-new"]
    assert relisted.stderr == ""
    assert json.loads(cli_env("ls", "--json").stdout)["pending_saves"] == []


def test_show_and_ls_see_a_queued_delete_and_say_so_until_the_store_has_it(
    cli_env: Cli, store: RedisStore
) -> None:
    # Given two sessions in the store, and a delete of one accepted but still queued
    store.save(make_checkpoint("doomed"))
    store.save(make_checkpoint("kept"))
    deleted = cli_env("delete", "doomed", "--json")
    assert deleted.exit_code == 0, deleted.output
    seq, request = json.loads(deleted.stdout)["seq"], json.loads(deleted.stdout)["task_id"]

    # When the deleted session is shown, and the sessions listed
    shown = cli_env("show", "doomed")
    listed = cli_env("ls")
    listing = json.loads(cli_env("ls", "--json").stdout)

    # Then show says a queued request deleted it, and ls leaves it out, saying why
    assert shown.exit_code == 1
    (line,) = shown.stderr.splitlines()
    assert line.startswith(
        f"checkpointq: error: no live session 'doomed': deleted by a request still queued "
        f"(seq {seq}, made "
    )
    assert line.endswith("), not yet applied in the store")
    assert listed.stdout.splitlines() == ["kept"]
    assert listed.stderr.splitlines() == [
        "# pending: doomed: not listed: a delete is queued, not yet applied in the store"
    ]
    assert listing["sessions"] == ["kept"] and listing["pending_deletes"] == ["doomed"]

    # When the store applies the delete
    assert store.delete("doomed", seq=seq, request_id=request)

    # Then the session is simply gone, and nothing is said to be pending
    gone = cli_env("show", "doomed")
    assert gone.stderr.splitlines() == ["checkpointq: error: no live session 'doomed'"]
    assert cli_env("ls").stderr == ""
    assert json.loads(cli_env("ls", "--json").stdout)["pending_deletes"] == []


def test_ls_limit_counts_the_merged_listing(cli_env: Cli, store: RedisStore) -> None:
    # Given a stored session and a queued save that sorts before it
    store.save(make_checkpoint("b-stored"))
    _saved(cli_env, "a-queued")

    # When only the first id is asked for
    listing = json.loads(cli_env("ls", "--json", "--limit", "1").stdout)

    # Then it is the queued one, marked as such
    assert listing["sessions"] == ["a-queued"] and listing["pending_saves"] == ["a-queued"]
